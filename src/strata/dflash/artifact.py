"""A DFlash drafter artifact in either format, and its fit to a target.

`load_artifact` is the strict loader every command uses: it returns the config and the tensors under
their Hugging Face names, or raises ArtifactError naming the file and what is wrong. The formats
themselves live in hf_format.py and gguf_format.py."""

from __future__ import annotations

from pathlib import Path

from ..errors import ArtifactError
from ..gguf_vocab import Vocab
from . import contract as C
from .contract import Artifact
from .gguf_format import read_gguf
from .hf_format import read_hf


def load_artifact(path: str | Path) -> Artifact:
    path = Path(path)
    if path.is_dir():
        return read_hf(path)
    if not path.exists():
        raise ArtifactError(f"{path}: no such file or folder (expected a DFlash drafter: a GGUF file or a "
                            f"Hugging Face folder)")
    return read_gguf(path)


def check_against_target(cfg: C.DFlashConfig, target_cfg, where: str, vocab: Vocab | None = None) -> None:
    """A drafter must fit its target before any decoding starts."""
    n = target_cfg.num_layers
    bad = [t for t in cfg.target_layer_ids if not 0 <= t < n]
    if bad:
        raise ArtifactError(f"{where}: target layer id {bad[0]} (HF convention) is outside the target's "
                            f"{n} layers 0..{n - 1}")
    if cfg.target_hidden_size != target_cfg.hidden_size:
        raise ArtifactError(f"{where}: fc expects target hidden size {cfg.target_hidden_size} per tap, the target "
                            f"has {target_cfg.hidden_size}")
    if cfg.hidden_size != target_cfg.hidden_size:
        raise ArtifactError(f"{where}: drafter hidden size {cfg.hidden_size} differs from the target's "
                            f"{target_cfg.hidden_size} (it uses the target's embedding and LM head)")
    if cfg.vocab_size is not None and cfg.vocab_size != target_cfg.vocab_size:
        raise ArtifactError(f"{where}: drafter vocabulary {cfg.vocab_size} differs from the target's "
                            f"{target_cfg.vocab_size}")
    if vocab is not None and len(vocab.tokens) != target_cfg.vocab_size:
        raise ArtifactError(f"{where}: the drafter's vocabulary has {len(vocab.tokens)} tokens, the target's "
                            f"{target_cfg.vocab_size}")
    if cfg.mask_token_id >= target_cfg.vocab_size:
        raise ArtifactError(f"{where}: mask_token_id {cfg.mask_token_id} is outside the target's vocabulary "
                            f"of {target_cfg.vocab_size}")
    if cfg.num_target_layers is not None and cfg.num_target_layers != n:
        raise ArtifactError(f"{where}: drafter was trained for a target of {cfg.num_target_layers} layers, "
                            f"this target has {n}")
