"""`strata inspect`: what a drafter artifact holds (hyper-parameters, tensor types, the vocabulary it
carries), the validator's verdict, and with a target model its fit to that target."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from ..errors import ArtifactError, StrataError
from .artifact import check_against_target, load_artifact


def _target_fit(art, model: Path) -> str | None:
    """Why the drafter does not fit the target in `model`, or None."""
    from ..gguf_vocab import for_target
    from ..models.loader import load_model_config

    _, target_cfg = load_model_config(model)
    check_against_target(art.cfg, target_cfg, str(art.source), art.vocab)
    if art.vocab is not None and (model / "tokenizer.json").is_file():
        diff = art.vocab.difference(for_target(model, target_cfg.vocab_size, art.vocab.pre))
        if diff:
            return f"its vocabulary differs from {model}'s: {diff}"
    return None


def inspect_path(path: str | Path, model: str | Path | None = None) -> tuple[str, bool]:
    path = Path(path)
    try:
        art = load_artifact(path)
    except ArtifactError as e:
        return f"{path}\n  verdict: INVALID: {e}", False
    c = art.cfg
    types = Counter(art.types.values() or [str(t.dtype).removeprefix("torch.") for t in art.tensors.values()])
    lines = [
        f"{path}",
        f"  format: {'GGUF (llama.cpp layout)' if art.fmt == 'gguf' else 'Hugging Face (reference layout)'}",
        "  architecture: dflash" + (" (DFlash2: convolutions and a candidate selector)" if c.variant == "dflash2"
                                    else ""),
        f"  layers: {c.num_layers}",
        f"  hidden: {c.hidden_size}, intermediate: {c.intermediate_size}",
        f"  heads: {c.num_heads}, kv heads: {c.num_kv_heads}, head dim: {c.head_dim}",
        f"  block size: {c.block_size}",
        f"  taps (HF layer ids): {c.target_layer_ids}",
        f"  taps (GGUF boundaries, dflash.target_layers): {[t + 1 for t in c.target_layer_ids]}",
        f"  target hidden: {c.target_hidden_size}" + (f", target layers: {c.num_target_layers}"
                                                      if c.num_target_layers else ""),
        f"  mask token id: {c.mask_token_id}",
        *([f"  DFlash2: convolution taps {c.conv_kernel_size}, group {c.conv_group_size} channels; selector "
           f"rank {c.selector_rank}, top-{c.selector_top_k} candidates a slot"] if c.variant == "dflash2" else []),
        f"  rope theta: {c.rope_theta:g}, rms eps: {c.rms_norm_eps:g}",
        f"  tensors: {len(art.tensors)} ({', '.join(f'{n} {t}' for t, n in sorted(types.items()))})",
        f"  parameters: {art.parameter_count:,}",
    ]
    v = art.vocab
    if v is not None:
        mask = repr(v.tokens[c.mask_token_id]) if c.mask_token_id < len(v.tokens) else "outside it"
        lines.append(f"  vocabulary: {v.model} (pre-tokenizer {v.pre}), {len(v.tokens)} tokens, {len(v.merges)} "
                     f"merges; mask token {mask}")
    elif art.fmt == "gguf":
        lines.append("  vocabulary: none (llama.cpp refuses such a file: it loads a vocabulary for every model)")
    if model is not None:
        try:
            why = _target_fit(art, Path(model))
        except StrataError as e:
            why = str(e)
        lines.append(f"  target {model}: {'fits' if why is None else 'DOES NOT FIT: ' + why}")
        if why is not None:
            lines.append(f"  verdict: INVALID: {why}")
            return "\n".join(lines), False
    lines.append("  verdict: OK")
    return "\n".join(lines), True
