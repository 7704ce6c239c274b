"""`strata inspect`: what a drafter artifact holds, and the validator's verdict."""

from __future__ import annotations

from pathlib import Path

from ..errors import ArtifactError
from .artifact import load_artifact


def inspect_path(path: str | Path) -> tuple[str, bool]:
    path = Path(path)
    try:
        art = load_artifact(path)
    except ArtifactError as e:
        return f"{path}\n  verdict: INVALID: {e}", False
    c = art.cfg
    lines = [
        f"{path}",
        f"  format: {'GGUF (llama.cpp layout)' if art.fmt == 'gguf' else 'Hugging Face (reference layout)'}",
        "  architecture: dflash",
        f"  layers: {c.num_layers}",
        f"  hidden: {c.hidden_size}, intermediate: {c.intermediate_size}",
        f"  heads: {c.num_heads}, kv heads: {c.num_kv_heads}, head dim: {c.head_dim}",
        f"  block size: {c.block_size}",
        f"  taps (HF layer ids): {c.target_layer_ids}",
        f"  taps (GGUF boundaries, dflash.target_layers): {[t + 1 for t in c.target_layer_ids]}",
        f"  target hidden: {c.target_hidden_size}" + (f", target layers: {c.num_target_layers}"
                                                      if c.num_target_layers else ""),
        f"  mask token id: {c.mask_token_id}",
        f"  rope theta: {c.rope_theta:g}, rms eps: {c.rms_norm_eps:g}",
        f"  tensors: {len(art.tensors)}",
        f"  parameters: {art.parameter_count:,}",
        "  verdict: OK",
    ]
    return "\n".join(lines), True
