"""Random-weight GGUF targets of a named shape, written directly in llama.cpp's layout and one of its file types
(`strata init-random --shape S --quant TYPE OUT.gguf`): the one file llama-bench and Strata both read for a
side-by-side figure, with no download and no BF16 file on the way (a 35B-A3B would be 70 GB). The matrices are
random valid blocks of the types llama-quantize gives that file type, streamed to the file one tensor at a time;
the vocabulary is a placeholder (llama.cpp needs one; the bench feeds token ids)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

from ..errors import StrataError
from ..files import replacing
from ..layers.kernels.qtypes import BLOCKS
from ..layers.quant import RECIPES, random_blocks, use_more_bits
from .random_init import shape_config

T = gguf.GGMLQuantizationType
#: tensors llama-quantize leaves in F32 (besides vectors)
KEPT_F32 = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "ssm_conv1d.weight")
#: matrices that get the recipe's larger type in llama.cpp's "more bits" layers
MORE_BITS = ("attn_v.weight", "ffn_down.weight", "ffn_down_exps.weight", "ffn_down_shexp.weight")


def metadata(w: gguf.GGUFWriter, arch: str, cfg, recipe: str) -> None:
    """The `{arch}.*` keys llama.cpp reads for this config (and Strata's gguf_config reads back)."""
    def u32(key: str, value: int) -> None:
        w.add_uint32(f"{arch}.{key}", int(value))

    for key, value in (("block_count", cfg.num_layers), ("context_length", cfg.max_position_embeddings),
                       ("embedding_length", cfg.hidden_size), ("feed_forward_length", cfg.intermediate_size),
                       ("attention.head_count", cfg.num_heads), ("attention.head_count_kv", cfg.num_kv_heads),
                       ("attention.key_length", cfg.head_dim), ("attention.value_length", cfg.head_dim)):
        u32(key, value)
    w.add_float32(f"{arch}.rope.freq_base", cfg.rope.theta)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    w.add_file_type(gguf.LlamaFileType[f"MOSTLY_{recipe}"])  # llama.cpp's name of each recipe
    if cfg.moe is not None:
        u32("expert_count", cfg.moe.experts)
        u32("expert_used_count", cfg.moe.top_k)
        u32("expert_feed_forward_length", cfg.moe.intermediate)
        if cfg.moe.shared:
            u32("expert_shared_feed_forward_length", cfg.moe.shared)
    lin = cfg.linear
    if lin is not None:
        for key, value in (("ssm.conv_kernel", lin.kernel), ("ssm.state_size", lin.k_dim),
                           ("ssm.group_count", lin.k_heads), ("ssm.time_step_rank", lin.v_heads),
                           ("ssm.inner_size", lin.v_heads * lin.v_dim), ("full_attention_interval", 4),
                           ("rope.dimension_count", cfg.rope.rotary_dim)):
            u32(key, value)
        w.add_array(f"{arch}.attention.recurrent_layers", [n in lin.layers for n in range(cfg.num_layers)])
        if arch != "qwen3next":  # llama.cpp's qwen35 loaders require the M-RoPE sections (one RoPE for text)
            pairs = cfg.rope.rotary_dim // 2
            w.add_array(f"{arch}.rope.dimension_sections", [pairs - 2 * (pairs // 3), pairs // 3, pairs // 3, 0])


def placeholder_vocabulary(w: gguf.GGUFWriter, size: int) -> None:
    """A SentencePiece-style vocabulary of `size` tokens: <unk>, <s>, </s>, the 256 bytes, then filler pieces."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    tokens += [f"\u2581t{i}" for i in range(size - len(tokens))]
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * size)
    w.add_token_types([2, 3, 3] + [6] * 256 + [1] * (size - 259))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)


def tensor_type(name: str, shape: tuple, recipe: str, layers: int) -> int:
    """The type llama-quantize gives a tensor of this file type: vectors, routers and the convolution stay F32,
    the head and the "more bits" layers' v and down matrices get the larger type; a matrix whose rows are not
    whole blocks of its type falls back to Q8_0, else F32."""
    if len(shape) == 1 or name.endswith(KEPT_F32):
        return T.F32
    base, more = RECIPES[recipe]
    parts = name.split(".")
    layer = int(parts[1]) if parts[0] == "blk" else None
    kind = more if name == "output.weight" or (layer is not None and name.endswith(MORE_BITS)
                                              and use_more_bits(layer, layers)) else base
    for candidate in (kind, T.Q8_0):
        if shape[-1] % BLOCKS[candidate][0] == 0:
            return candidate
    return T.F32


def vector(name: str, shape: tuple, gen: torch.Generator) -> np.ndarray:
    """An F32 tensor's values: norms (stored as 1 + w) ones, A (stored as -exp(A_log)) -1, dt's bias 0, the
    rest N(0, 0.02)."""
    if name.endswith("norm.weight"):
        return np.ones(shape, dtype=np.float32)
    if name.endswith("ssm_a"):
        return -np.ones(shape, dtype=np.float32)
    if name.endswith("ssm_dt.bias"):
        return np.zeros(shape, dtype=np.float32)
    return (torch.randn(shape, generator=gen, device=gen.device) * 0.02).cpu().numpy()


def write_random_gguf(path: str | Path, shape: str, recipe: str, seed: int = 0, device: str = "cpu",
                      **overrides) -> dict[str, int]:
    """Write the shape's random GGUF of file type `recipe` (overrides: config.json fields, as shape_config
    takes them); the values drawn on `device` (a GPU draws a 35B shape's in seconds, other values than the
    CPU's for a seed). Returns the count of tensors of each type."""
    if recipe not in RECIPES:
        raise StrataError(f"--quant: expected one of {', '.join(RECIPES)}, got {recipe!r}")
    fam, cfg, _ = shape_config(shape, **overrides)
    if not fam.gguf_arch:
        raise StrataError(f"--shape {shape}: llama.cpp has no GGUF layout of the {fam.name} family")
    layout = fam.gguf_layout(cfg)
    tensors = {}
    for sources in layout.values():
        for name, shp, _ in sources:
            tensors[name] = shp
    gen, counts = torch.Generator(device).manual_seed(seed), {}
    plan = [(name, shp, tensor_type(name, shp, recipe, cfg.num_layers)) for name, shp in tensors.items()]
    with replacing(Path(path)) as tmp:
        w = gguf.GGUFWriter(str(tmp), fam.gguf_arch)
        w.add_name(f"random {shape} {recipe}")
        metadata(w, fam.gguf_arch, cfg, recipe)
        placeholder_vocabulary(w, cfg.vocab_size)
        for name, shp, qtype in plan:
            if qtype == T.F32:
                w.add_tensor_info(name, shp, np.dtype(np.float32), int(np.prod(shp)) * 4)
            else:
                block, size = BLOCKS[qtype] if qtype in BLOCKS else gguf.GGML_QUANT_SIZES[qtype]
                raw = (*shp[:-1], shp[-1] // block * size)
                w.add_tensor_info(name, raw, np.dtype(np.uint8), int(np.prod(raw)), raw_dtype=qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for name, shp, qtype in plan:
            counts[qtype.name] = counts.get(qtype.name, 0) + 1
            if qtype == T.F32:
                w.write_tensor_data(vector(name, shp, gen))
                continue
            rows = int(np.prod(shp[:-1]))
            blocks = random_blocks(qtype, rows, shp[-1], device, gen).cpu().numpy()
            w.write_tensor_data(blocks.reshape(*shp[:-1], -1))
        w.close()
    return counts
