"""How an engine decodes: one EngineConfig that the CLI, the server, the bench and the checks all build
engines from. Its fields are checked on their own when it is made, against a model's config and the
device before anything loads (check_before_load), and against the loaded target and drafter once, when an
engine resolves its Plan. Its errors name the settings (SettingError); a front end maps them to its own
names."""

from __future__ import annotations

from dataclasses import dataclass

from ..cache import refuse_rows_unless_fit, refuse_unless_fits
from ..errors import SettingError
from ..layers.kernels import ATTENTION_KINDS, KernelOptions

DRAFT_SAMPLING_MODES = ("sample", "argmax")
#: how the steps run, from the most dynamic to the most fused: eager (dynamic shapes, the CPU's default),
#: static (fixed shapes over device-side positions, no capture), graphs (static steps captured in CUDA
#: graphs), graphs+compile (with torch.compile's fused elementwise groups), graphs+triton (with Strata's
#: Triton kernels where their shapes allow: the GPU's default). Without a CUDA device the graphs backends
#: run as static: there is nothing to capture.
BACKENDS = ("eager", "static", "graphs", "graphs+compile", "graphs+triton")


@dataclass(frozen=True)
class Plan:
    """What an engine's settings come to for one target and drafter, checked: the verify window W, the
    context, and the rows of a verify step (a tree's nodes and its anchor; W, or pad_rows if more, in the
    static layout)."""

    window: int
    max_len: int
    rows: int


@dataclass(frozen=True)
class EngineConfig:
    max_len: int | None = None  # context length; None: the model's
    allow_long_context: bool = False  # max_len past the model's trained context, knowingly
    window: int | None = None  # verify window W (anchor + W-1 candidates); None: the drafter's default
    backend: str = "eager"  # one of BACKENDS
    attention: str = "grouped"  # attention of the static steps: "grouped" or "sdpa"
    pad_rows: int = 1  # target-only decoding in windows of this many rows (see ModelRunner)
    tree: int | None = None  # tree verification with this many nodes (engine/tree.py); None: the chain
    adaptive_window: bool = False  # each round's window chosen by measured cost and acceptance (window_policy.py)
    auto_window: bool = False  # each round's window chosen by measured cost and the drafter's confidences
    draft_p_min: float = 0.0  # a draft ends before its first candidate rated below this (llama.cpp's p_min)
    draft_sampling: str = "sample"  # sampled decoding: draw candidates from q, or take its argmax
    profile: bool = False  # time the draft and verify parts of each round (waits for the device)
    kernels: KernelOptions = KernelOptions()  # the kernels' switches (an A/B run sets its own)

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise SettingError(f"{{backend}}: expected one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.draft_sampling not in DRAFT_SAMPLING_MODES:
            raise SettingError(f"{{draft_sampling}}: expected one of {', '.join(DRAFT_SAMPLING_MODES)}, "
                               f"got {self.draft_sampling!r}")
        if self.attention not in ATTENTION_KINDS:
            raise SettingError(f"{{attention}}: expected one of {', '.join(ATTENTION_KINDS)}, got {self.attention!r}")
        if self.max_len is not None and self.max_len < 2:
            raise SettingError(f"{{max_len}} must be >= 2, got {self.max_len}")
        if self.pad_rows < 1:
            raise SettingError(f"{{pad_rows}} must be >= 1, got {self.pad_rows}")
        if self.tree is not None and self.tree < 1:
            raise SettingError(f"{{tree}} must be >= 1, got {self.tree}")
        if not 0.0 <= self.draft_p_min <= 1.0:
            raise SettingError(f"{{draft_p_min}} must be between 0 and 1, got {self.draft_p_min}")
        if self.auto_window and self.adaptive_window:
            raise SettingError("{auto_window} and {adaptive_window} both choose the window; choose one")

    @property
    def reads_confidence(self) -> str | None:
        """The setting that reads a drafter's confidence in its candidates, where one is on."""
        return "auto_window" if self.auto_window else "draft_p_min" if self.draft_p_min > 0 else None

    @property
    def static(self) -> bool:
        """Fixed-shape steps (every backend but eager)."""
        return self.backend != "eager"

    @property
    def graphs(self) -> bool:
        """Steps captured in CUDA graphs, on a CUDA device."""
        return self.backend.startswith("graphs")

    @property
    def compile(self) -> bool:
        return self.backend in ("graphs+compile", "graphs+triton")

    @property
    def triton(self) -> bool:
        return self.backend == "graphs+triton"

    def rows(self) -> tuple[int, str] | None:
        """The verify step's rows the settings fix before a drafter loads, and the setting that fixes them
        (a message template): a tree's nodes and its anchor, or W."""
        if self.tree is not None:
            return self.tree + 1, f"{{tree}} {self.tree}"
        return None if self.window is None else (self.window, f"{{window}} {self.window}")

    def check_sampling(self, params) -> None:
        """Tree verification is greedy: lossless sampling over a tree needs recursive rejection across
        siblings (SpecInfer), which Strata does not implement, so a sampled request is refused."""
        if self.tree is not None and not params.greedy:
            raise SettingError("sampled decoding (temperature > 0) is not supported with {tree} (its verification "
                               "is greedy); drop {tree} to sample with the chain", "temperature")

    def context(self, target_cfg) -> int:
        """The context length: max_len, refused past the model's own unless allow_long_context."""
        trained = target_cfg.max_position_embeddings
        if self.max_len is not None and self.max_len > trained and not self.allow_long_context:
            raise SettingError(f"{{max_len}} {self.max_len} exceeds the model's context of {trained} tokens "
                               f"(max_position_embeddings); add {{allow_long_context}} to use it anyway")
        return self.max_len or trained

    def check_before_load(self, target_cfg, device, dtype) -> int:
        """The settings against a model's config and the device, before its weights load: the context (the
        returned length), its KV cache and the verify step's rows in the device's memory."""
        max_len = self.context(target_cfg)
        refuse_unless_fits(target_cfg.num_layers, (max_len, target_cfg.num_kv_heads, target_cfg.head_dim), device,
                           dtype)
        fixed = self.rows()
        if fixed is not None:
            refuse_rows_unless_fit(*fixed, target_cfg, max_len, device, dtype)
        return max_len

    def resolve(self, target, drafter) -> Plan:
        """The settings against the loaded target and drafter (None: target-only): the engine's Plan."""
        return self.plan(target, self.window_for(drafter))

    def plan(self, target, window: int) -> Plan:
        """The Plan for a target and a verify window already chosen (the checks run windows of their own)."""
        max_len = self.context(target.cfg)
        if self.tree is not None and target.recurrent:
            raise SettingError("{tree}: this target has linear-attention layers, whose recurrent state follows "
                               "one sequence, not a tree; use the chain (no {tree})")
        for flag in ("adaptive_window", "auto_window"):
            if getattr(self, flag) and target.recurrent:
                raise SettingError(f"{{{flag}}}: this target has linear-attention layers, whose states are kept "
                                   f"for a fixed window; drop {{{flag}}}")
        rows = self.tree + 1 if self.tree is not None else max(window, self.pad_rows) if self.static else window
        fixed = self.rows()
        what = fixed[1] if fixed is not None else f"the verify window {window}"
        refuse_rows_unless_fit(rows, what, target.cfg, max_len, target.device, target.dtype)
        return Plan(window, max_len, rows)

    def window_for(self, drafter) -> int:
        """The verify window with this drafter (1 without one), or a one-line error."""
        if drafter is None or drafter.max_window == 1:
            if self.window is not None:
                raise SettingError("{window} needs a drafter (--dflash, --mtp or --prompt-lookup)")
            if self.adaptive_window:
                raise SettingError("{adaptive_window} needs a drafter (--dflash, --mtp or --prompt-lookup)")
            if self.reads_confidence:
                raise SettingError(f"{{{self.reads_confidence}}} needs a DFlash drafter")
            if self.tree is not None:
                raise SettingError("{tree} needs a drafter (--dflash)")
            return 1
        w = self.window if self.window is not None else drafter.window
        if not 2 <= w <= drafter.max_window:
            raise SettingError(f"{{window}} {w}: must be between 2 and the drafter's {drafter.limit} "
                               f"{drafter.max_window}")
        chooser = "adaptive_window" if self.adaptive_window else self.reads_confidence
        if self.tree is not None and chooser:
            raise SettingError(f"{{{chooser}}} and {{tree}}: a tree's depth is fixed; choose one")
        if self.reads_confidence and not drafter.rates_drafts:
            raise SettingError(f"{{{self.reads_confidence}}} reads the drafter's confidence in its candidates; the "
                               f"{drafter.name} drafter gives none (use a DFlash drafter)")
        if self.tree is not None:
            from .tree import largest_budget

            if not drafter.gives_logits:
                raise SettingError(f"{{tree}} needs a drafter that scores its candidates (DFlash); the "
                                   f"{drafter.name} drafter does not")
            most = largest_budget(w - 1, drafter.tree_top_k)
            if self.tree > most:
                raise SettingError(f"{{tree}} {self.tree}: a tree of depth {w - 1} holds at most {most} nodes")
        return w
