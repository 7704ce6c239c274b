"""One loader for a target + drafter pair, used by the CLI, the server, the bench and the checks: which
model (the embedded demo pair when none is named), on which device and dtype, which drafter, and the
stop ids the model declares. It sits above both the engine and the drafter formats."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import demo, gguf_file
from .dflash.artifact import check_against_target, load_artifact
from .dflash.drafter import load_drafter
from .engine.config import EngineConfig
from .engine.decode import check_prompt
from .engine.mtp import MTPDrafter
from .engine.prompt_lookup import PromptLookupDrafter
from .errors import StrataError
from .gguf_vocab import UnsupportedVocab
from .models.config import read_json, token_ids
from .models.loader import check_tensors, load_model_config, load_target, parse_dtype
from .models.placement import PLACEMENTS, place_experts
from .tokenizer import Tokenizer


@dataclass(frozen=True)
class PairSpec:
    model: str | None = None  # a target folder or GGUF file; None: the embedded demo pair
    device: str = "cpu"
    dtype: str = "auto"  # auto: float32 on the CPU, bfloat16 on CUDA
    dflash: str | None = None  # a drafter (GGUF or Hugging Face folder); the demo's by default with the demo
    no_dflash: bool = False
    prompt_lookup: int | None = None  # n-gram drafting with n-grams up to this
    mtp: bool = False  # drafting with the target's own MTP block (engine/mtp.py)
    dflash_window: int = 32768  # the drafter's attention window in context cells
    expert_cache: int | None = None  # MiB of experts on the device (models/placement.py); None: auto
    expert_placement: str = "static"  # which experts the device keeps (models/placement.py's PLACEMENTS)
    check_tensors: bool = False  # scan every weight for NaN / inf at load
    stop_ids: tuple[int, ...] = ()  # stop ids beyond those the model declares

    def __post_init__(self):
        chosen = [flag for flag, on in (("--dflash", self.dflash), ("--prompt-lookup", self.prompt_lookup is not None),
                                        ("--mtp", self.mtp)) if on]
        if len(chosen) > 1:
            raise StrataError(f"{' and '.join(chosen)} are mutually exclusive: choose one drafter")
        if self.mtp and self.no_dflash:
            raise StrataError("--mtp and --no-dflash: --mtp drafts with the model's MTP block; drop one")
        if self.prompt_lookup is not None and self.prompt_lookup < 1:
            raise StrataError(f"--prompt-lookup must be >= 1, got {self.prompt_lookup}")
        if self.dflash_window < 1:
            raise StrataError(f"--dflash-window must be >= 1, got {self.dflash_window}")
        if self.expert_cache is not None and self.expert_cache < 0:
            raise StrataError(f"--expert-cache must be >= 0 MiB, got {self.expert_cache}")
        if self.expert_placement not in PLACEMENTS:
            raise StrataError(f"--expert-placement must be one of {', '.join(PLACEMENTS)}, got {self.expert_placement!r}")

    def check_for(self, cfg) -> None:
        """The options that depend on the target, checked against its config before its weights load."""
        if cfg.moe is None and (self.expert_cache is not None or self.expert_placement != "static"):
            option = "--expert-cache" if self.expert_cache is not None else "--expert-placement"
            raise StrataError(f"{option}: the target is a dense model (it has no experts to place)")
        bad = [i for i in self.stop_ids if not 0 <= i < cfg.vocab_size]
        if bad:
            raise StrataError(f"--stop-ids: token id {bad[0]} outside the vocabulary 0..{cfg.vocab_size - 1}")

    def torch_device(self) -> str:
        if self.device == "cuda" and not torch.cuda.is_available():
            raise StrataError("--device cuda: no CUDA device is available")
        return self.device

    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.device == "cuda" else torch.float32
        return parse_dtype(self.dtype)


@dataclass
class Pair:
    target: torch.nn.Module
    tokenizer: Tokenizer | None
    drafter: object | None  # a Drafter, or None for target-only
    model_dir: Path
    using_demo: bool = False
    stop_ids: set[int] = field(default_factory=set)
    no_tokenizer: str = ""  # why tokenizer is None
    prompt_ids: list[int] | None = None  # load_pair's prompt, checked before the weights loaded

    def text_tokenizer(self, why: str = "use --prompt-ids") -> Tokenizer:
        """The tokenizer, for text in or out; without one a one-line error that says why and what to do."""
        return text_tokenizer(self.tokenizer, self.no_tokenizer, why)

    @property
    def label(self) -> str:
        return "demo" if self.using_demo else (self.model_dir.stem if self.model_dir.is_file() else self.model_dir.name)


def text_tokenizer(tokenizer: Tokenizer | None, no_tokenizer: str, why: str = "use --prompt-ids") -> Tokenizer:
    if tokenizer is None:
        raise StrataError(f"{no_tokenizer}; {why}")
    return tokenizer


def resolve(spec: PairSpec) -> tuple[Path, str | None, bool]:
    """(target folder, drafter path or None, whether it is the demo pair)."""
    if spec.model:
        return Path(spec.model), None if spec.no_dflash else spec.dflash, False
    if not demo.available():
        raise StrataError("--model: no target model given and the embedded demo pair is not installed")
    dflash = spec.dflash
    if not dflash and not spec.no_dflash and spec.prompt_lookup is None and not spec.mtp:
        dflash = str(demo.DRAFTER)
    return demo.TARGET, None if spec.no_dflash else dflash, True


def load_pair(spec: PairSpec, engine: EngineConfig = EngineConfig(), drafter: bool = True,
              prompt: Callable[[Tokenizer | None, str], list[int]] | None = None) -> Pair:
    """The target, its tokenizer and stop ids, and (drafter=True) the drafter the spec names, checked
    against the target before any decoding starts. prompt: makes the prompt's ids from the tokenizer
    (None without one, and why); they are checked against the context and the vocabulary before the
    weights load, and kept as the pair's prompt_ids."""
    model_dir, dflash, using_demo = resolve(spec)
    model_config = load_model_config(model_dir)  # a bad context length or vocabulary is refused
    cfg = model_config[1]
    spec.check_for(cfg)
    device = spec.torch_device()
    max_len = engine.check_before_load(cfg, device, spec.torch_dtype())
    artifact = None
    if drafter and dflash and spec.prompt_lookup is None:  # a drafter that cannot serve is refused first
        artifact = load_artifact(dflash)
        check_against_target(artifact.cfg, cfg, str(artifact.source), artifact.vocab)
    tokenizer, no_tokenizer = tokenizer_of(model_dir)  # before the weights load
    prompt_ids = None
    if prompt is not None:
        prompt_ids = prompt(tokenizer, no_tokenizer)
        check_prompt(prompt_ids, max_len, cfg.vocab_size)

    target = load_target(model_dir, device=device, dtype=spec.torch_dtype(), place=lambda model: place_experts(
        model, device, spec.expert_cache, max_len, footprint(dflash), spec.expert_placement), model_config=model_config,
        mtp=spec.mtp)
    stops = declared_stop_ids(target, model_dir, tokenizer) | set(spec.stop_ids)
    pair = Pair(target, tokenizer, None, model_dir, using_demo, stops, no_tokenizer, prompt_ids)
    if drafter:
        pair.drafter = load_drafter_for(spec, target, engine, artifact or dflash)
    if spec.check_tensors:
        check_tensors(target, model_dir)
        if getattr(pair.drafter, "model", None) is not None:
            check_tensors(pair.drafter.model, dflash)
    return pair


def load_drafter_for(spec: PairSpec, target, engine: EngineConfig, dflash):
    """The drafter the spec names for a loaded target; dflash: a DFlash drafter's path or artifact."""
    if spec.prompt_lookup is not None:
        return PromptLookupDrafter(spec.prompt_lookup, device=target.device)
    if spec.mtp:
        return MTPDrafter(target, max_len=engine.context(target.cfg))
    if dflash:
        return load_drafter(dflash, target, window_cells=spec.dflash_window, max_len=engine.context(target.cfg))
    return None


def footprint(drafter: str | None) -> int:
    """Bytes a drafter's weights take: its GGUF file, or its folder's safetensors (0 without one)."""
    if not drafter:
        return 0
    path = Path(drafter)
    files = [path] if path.is_file() else list(path.glob("*.safetensors")) if path.is_dir() else []
    return sum(f.stat().st_size for f in files)


def tokenizer_of(model: Path) -> tuple[Tokenizer | None, str]:
    """A folder's tokenizer.json, or the vocabulary a GGUF file carries; without one (or with one of a kind
    Strata cannot rebuild: the model still runs on token ids), None and why."""
    if model.is_dir():
        return Tokenizer.from_folder(model), f"{model}: no tokenizer.json"
    try:
        return Tokenizer.from_gguf(gguf_file.read(model)[0], model), f"{model}: no vocabulary (tokenizer.ggml.*)"
    except UnsupportedVocab as e:
        return None, str(e)


def declared_stop_ids(target, model_dir: Path, tokenizer: Tokenizer | None = None) -> set[int]:
    """EOS ids from config.json and generation_config.json; a GGUF file: tokenizer.ggml.eos/eot and the
    tokens its vocabulary ends generation at, as llama.cpp stops."""
    ids = set(target.cfg.eos_token_ids) | (tokenizer.end_ids if tokenizer is not None else set())
    gen_cfg = model_dir / "generation_config.json"
    if model_dir.is_dir() and gen_cfg.is_file():
        ids |= set(token_ids(read_json(gen_cfg, "generation_config.json").get("eos_token_id"), "eos_token_id", gen_cfg))
    return ids
