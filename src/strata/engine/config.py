"""How an engine decodes: one EngineConfig, validated once, that the CLI, the server, the bench and the
tools all build engines from."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import StrataError
from ..layers.kernels import ATTENTION_KINDS

DRAFT_SAMPLING_MODES = ("sample", "argmax")


@dataclass(frozen=True)
class EngineConfig:
    max_len: int | None = None  # context length; None: the model's
    allow_long_context: bool = False  # max_len past the model's trained context, knowingly
    window: int | None = None  # verify window W (anchor + W-1 candidates); None: the drafter's default
    static: bool = False  # fixed-shape steps over device-side positions: the CUDA-graph layout
    graphs: bool = True  # static layout on a GPU: capture the steps in CUDA graphs
    compile: bool = True  # with graphs: torch.compile's fused elementwise groups
    triton: bool = True  # with compile: Strata's Triton kernels where their shapes allow
    attention: str = "grouped"  # attention of the static steps: "grouped" or "sdpa"
    pad_rows: int = 1  # target-only decoding in windows of this many rows (see ModelRunner)
    tree: int | None = None  # tree verification with this many nodes (engine/tree.py); None: the chain
    adaptive_window: bool = False  # each round's window chosen by measured cost and acceptance (window_policy.py)
    draft_sampling: str = "sample"  # sampled decoding: draw candidates from q, or take its argmax
    profile: bool = False  # time the draft and verify parts of each round (waits for the device)

    def __post_init__(self):
        if self.draft_sampling not in DRAFT_SAMPLING_MODES:
            raise StrataError(f"--draft-sampling: expected one of {', '.join(DRAFT_SAMPLING_MODES)}, "
                              f"got {self.draft_sampling!r}")
        if self.attention not in ATTENTION_KINDS:
            raise StrataError(f"--attention: expected one of {', '.join(ATTENTION_KINDS)}, got {self.attention!r}")
        if self.max_len is not None and self.max_len < 2:
            raise StrataError(f"--max-model-len must be >= 2, got {self.max_len}")
        if self.pad_rows < 1:
            raise StrataError(f"pad_rows must be >= 1, got {self.pad_rows}")
        if self.tree is not None and self.tree < 1:
            raise StrataError(f"--tree must be >= 1, got {self.tree}")

    def rows(self) -> tuple[int, str] | None:
        """The verify step's rows the options fix before a drafter loads, and the option that sets them: a
        tree's nodes and its anchor, or --spec W."""
        if self.tree is not None:
            return self.tree + 1, f"--tree {self.tree}"
        return None if self.window is None else (self.window, f"--spec {self.window}")

    def check_sampling(self, params) -> None:
        """Tree verification is greedy: lossless sampling over a tree needs recursive rejection across
        siblings (SpecInfer), which Strata does not implement, so a sampled request is refused."""
        if self.tree is not None and not params.greedy:
            raise StrataError("sampled decoding (temperature > 0) is not supported with --tree (its verification "
                              "is greedy); drop --tree to sample with the chain", "temperature")

    def context(self, target_cfg) -> int:
        """The context length: max_len, refused past the model's own unless allow_long_context."""
        trained = target_cfg.max_position_embeddings
        if self.max_len is not None and self.max_len > trained and not self.allow_long_context:
            raise StrataError(f"--max-model-len {self.max_len} exceeds the model's context of {trained} tokens "
                              f"(max_position_embeddings); add --allow-long-context to use it anyway")
        return self.max_len or trained

    def window_for(self, drafter) -> int:
        """The verify window with this drafter (1 without one), or a one-line error."""
        if drafter is None or drafter.max_window == 1:
            if self.window is not None:
                raise StrataError("--spec needs a drafter (--dflash or --prompt-lookup)")
            if self.adaptive_window:
                raise StrataError("--adaptive-window needs a drafter (--dflash or --prompt-lookup)")
            if self.tree is not None:
                raise StrataError("--tree needs a drafter (--dflash)")
            return 1
        w = self.window if self.window is not None else drafter.window
        if not 2 <= w <= drafter.max_window:
            raise StrataError(f"--spec {w}: must be between 2 and the drafter's {drafter.limit} {drafter.max_window}")
        if self.tree is not None and self.adaptive_window:
            raise StrataError("--adaptive-window and --tree: a tree's depth is fixed; choose one")
        if self.tree is not None:
            from .tree import largest_budget

            if not drafter.gives_logits:
                raise StrataError(f"--tree needs a drafter that scores its candidates (DFlash); the {drafter.name} "
                                  f"drafter does not")
            if self.tree > largest_budget(w - 1):
                raise StrataError(f"--tree {self.tree}: a tree of depth {w - 1} holds at most "
                                  f"{largest_budget(w - 1)} nodes")
        return w
