"""Random-weight checkpoints of named shapes, written in the Hugging Face layout.

They let benchmarks run an 8B-shaped model without a download, and tests build tiny targets."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..files import replacing
from .loader import checkpoint_shapes
from .registry import family_for
from .shapes import SHAPES



def qwen3_config(**overrides) -> dict:
    """A Qwen3 config.json (Qwen3-MoE when the overrides name experts, Qwen3.5 when they list layer types,
    Qwen3.5-MoE when both)."""
    moe, hybrid = "num_experts" in overrides, "layer_types" in overrides
    arch, kind = {(False, False): ("Qwen3ForCausalLM", "qwen3"), (True, False): ("Qwen3MoeForCausalLM", "qwen3_moe"),
                  (False, True): ("Qwen3_5ForCausalLM", "qwen3_5_text"),
                  (True, True): ("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text")}[moe, hybrid]
    cfg = dict(architectures=[arch], model_type=kind, rms_norm_eps=1e-6, rope_theta=1000000.0,
               tie_word_embeddings=False, attention_bias=False, bos_token_id=None, eos_token_id=None,
               torch_dtype="bfloat16")
    cfg.update(overrides)
    return cfg


def write_random_model(out_dir: str | Path, shape: str = "tiny", seed: int = 0, dtype=torch.float32,
                       **overrides) -> Path:
    """Write config.json + model.safetensors with N(0, 0.02) weights and unit norms."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fam, mcfg, cfg = shape_config(shape, **overrides)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shp in checkpoint_shapes(fam.hf_layout(mcfg)).items():
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(shp, dtype=dtype)
        else:
            tensors[name] = (torch.randn(shp, generator=gen) * 0.02).to(dtype)
    with replacing(out_dir / "model.safetensors") as tmp:
        save_file(tensors, str(tmp))
    with replacing(out_dir / "config.json") as tmp:
        tmp.write_text(json.dumps(cfg, indent=2))
    return out_dir


def shape_config(shape: str, **overrides):
    """(family, ModelConfig, config.json's dict) of a named shape, without building it."""
    hf = qwen3_config(**{**SHAPES[shape], **overrides})
    where = Path(f"<random {shape}>")
    fam = family_for(hf, where)
    return fam, fam.config(hf, where), hf


def random_target(shape: str = "tiny", device="cpu", dtype=torch.float32, seed: int = 0, quant: str | None = None,
                  quantized: bool | None = None, mtp: bool = False, **overrides):
    """A random-weight target built directly on the device (no files: an 8B shape needs no download). With
    quant (a llama.cpp file type: Q4_K_M, Q8_0, ...) its matrices are random valid GGUF blocks of the
    types that file type gives them, kept quantized on a GPU (or with quantized=True: the Triton kernels
    then run, in the interpreter on the CPU) and on the CPU dequantized by gguf's reference, as load_target
    keeps a GGUF file's. mtp: with an MTP block (a hybrid shape's: models/mtp.py)."""
    fam, cfg, _ = shape_config(shape, **overrides)
    if mtp:
        if cfg.linear is None:
            from ..errors import StrataError

            raise StrataError(f"--mtp: shape {shape} has no MTP block (the hybrid shapes have one: "
                              f"{', '.join(s for s, v in SHAPES.items() if 'layer_types' in v)})")
        cfg.mtp_layers, cfg.load_mtp = 1, True
    with torch.device("meta"):
        model = fam.build(cfg)
    gen = torch.Generator(device=device).manual_seed(seed)
    if quant is not None:
        quantize_randomly(model, cfg, quant, device, dtype, gen)
    model = model.to_empty(device=device).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen, device=device, dtype=torch.float32).mul_(0.02))
    if quant is not None and not (torch.device(device).type == "cuda" if quantized is None else quantized):
        dequantize_blocks(model, dtype)
    return model.tie_weights_().eval().requires_grad_(False)


def dequantize_blocks(model, dtype) -> None:
    """Every quantized matrix of the model replaced by its values, dequantized by gguf's reference
    (gguf_file.reference_values), as parameters of dtype."""
    from ..gguf_file import reference_values
    from ..layers.moe import SparseMoE
    from ..layers.quant import QuantWeight

    for module in model.modules():
        if isinstance(module, SparseMoE):
            module.dequantize_experts(lambda q: reference_values(q.data.cpu().numpy(), q.qtype).to(q.device, dtype))
        for attr, w in list(vars(module).items()):
            if isinstance(w, QuantWeight):
                values = torch.cat([reference_values(s.data.cpu().numpy(), s.qtype) for s in w.segments])
                values = values.to(device=w.segments[0].data.device, dtype=dtype)
                delattr(module, attr)
                module.register_parameter(attr, torch.nn.Parameter(values, requires_grad=False))


#: matrices llama-quantize leaves in float: the routers (of the experts, of the shared expert) and the convolution
KEPT_FLOAT = ("mlp.gate.weight", "shared_expert_gate.weight", "conv_weight")


def quantize_randomly(model, cfg, recipe: str, device, dtype, gen) -> None:
    """Every matrix of a meta-built model replaced by random GGUF blocks as `recipe` types them."""
    from ..errors import StrataError
    from ..layers.quant import RECIPES, QuantWeight, Segment, random_blocks, recipe_types, replace_parameter

    if recipe not in RECIPES:
        raise StrataError(f"--quant: expected one of {', '.join(RECIPES)}, got {recipe!r}")
    from ..layers.moe import SparseMoE
    from ..layers.quant import QuantExperts

    def check(name: str, cols: int) -> None:
        if cols % 256:
            raise StrataError(f"--quant: matrix '{name}' has rows of {cols} values; the quantized kernels take "
                              f"multiples of 256 (use a larger --shape)")

    q_rows = (cfg.num_heads + cfg.num_kv_heads) * cfg.head_dim
    layers = [(f"layers.{n}", layer) for n, layer in enumerate(model.layers)]
    for name, layer in layers + ([("mtp.layer", model.mtp.layer)] if model.mtp is not None else []):
        if isinstance(layer.mlp, SparseMoE):  # as llama.cpp quantizes ffn_{gate,up,down}_exps; the router stays
            _, experts, inter, hidden = layer.mlp.gate_up_proj.shape
            down_type = recipe_types(recipe, f"{name}.mlp.down_proj.weight", cfg.num_layers)[0][0]
            for attr, t, rows, cols in (("gate_up_proj", RECIPES[recipe][0], 2 * inter, hidden),
                                        ("down_proj", down_type, hidden, inter)):
                check(f"{name}.mlp.{attr}", cols)
                blocks = random_blocks(t, experts * rows, cols, device, gen).view(experts, rows, -1)
                replace_parameter(model, f"{name}.mlp.{attr}", QuantExperts(t, blocks, cols, dtype))
    for name, p in list(model.named_parameters()):
        if p.dim() != 2 or name.endswith(KEPT_FLOAT):
            continue
        rows, cols = p.shape
        check(name, cols)
        spans = {"all": rows, "qk": q_rows, "v": rows - q_rows}
        segments = []
        for t, role in recipe_types(recipe, name, cfg.num_layers):
            blocks = random_blocks(t, spans[role], cols, device, gen)
            if segments and segments[-1].qtype == t:  # one segment per run of a type: one kernel launch
                blocks = torch.cat([segments.pop().data, blocks])
            segments.append(Segment(t, blocks))
        replace_parameter(model, name, QuantWeight(segments, cols, dtype))
