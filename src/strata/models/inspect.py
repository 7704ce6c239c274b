"""`strata inspect` of a target model (a Hugging Face folder or a GGUF file): its family and shape, its experts
and linear-attention layers, and whether it ships an MTP block for --mtp."""

from __future__ import annotations

from pathlib import Path

from ..errors import StrataError


def describe_target(path: str | Path) -> str | None:
    """The summary lines of a target model, or None where the path holds none (a drafter, say)."""
    from .loader import load_model_config

    path = Path(path)
    try:
        fam, cfg = load_model_config(path)
    except StrataError:
        return None
    linear = len(cfg.linear.layers) if cfg.linear is not None else 0
    lines = [f"{path}",
             f"  target: {fam.name} (" + (f"GGUF, llama.cpp's {fam.gguf_arch} layout" if path.is_file()
                                         else "Hugging Face folder") + ")",
             f"  layers: {cfg.num_layers}" + (f" ({linear} linear-attention, {cfg.num_layers - linear} full-attention)"
                                              if linear else ""),
             f"  hidden: {cfg.hidden_size}, heads: {cfg.num_heads}, kv heads: {cfg.num_kv_heads}, head dim: "
             f"{cfg.head_dim}, vocabulary: {cfg.vocab_size}"]
    moe = cfg.moe
    if moe is not None:
        lines.append(f"  experts: {moe.experts} in each of {len(moe.layers)} layers, top-{moe.top_k}"
                     + (f", a shared expert of {moe.shared}" if moe.shared else ""))
    if cfg.mtp_layers:
        mlp = "a mixture of experts" if moe is not None else f"an MLP of {cfg.intermediate_size}"
        lines.append(f"  MTP: {cfg.mtp_layers} block{'s' if cfg.mtp_layers > 1 else ''} (one full-attention layer "
                     f"with {mlp}, fc [{cfg.hidden_size}, {2 * cfg.hidden_size}]): --mtp drafts with it")
    else:
        lines.append("  MTP: none (--mtp needs a model that ships a block)")
    return "\n".join(lines)
