"""llama.cpp's hybrid GGUF layouts (qwen35, qwen35moe, qwen3next) written from transformers' checkpoints, as its
converter (conversion/qwen.py) and llama-quantize lay them out, and read back into the checkpoint's names: the
test side of tests/test_gguf_hybrid.py. tools/llamacpp_hybrid_check.py compares what to_gguf makes with the
converter's own files, tensor for tensor."""

from __future__ import annotations

import json
import re

import gguf
import numpy as np
import torch
from gguf import quants
from safetensors.torch import load_file
from test_interop import random_blocks

T = gguf.GGMLQuantizationType
ARCH = {"qwen3_5": "qwen35", "qwen3_5_moe": "qwen35moe", "qwen3_next": "qwen3next"}
#: partial RoPE of 16 dims whose M-RoPE sections (3 + 3 + 2 pairs) fit them, as llama.cpp asserts
ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25, "mrope_section": [3, 3, 2],
        "mrope_interleaved": True}
#: tiny shapes whose matrices are whole 256-column k-quant rows
SHAPES = {"qwen3_5": dict(intermediate_size=256),
          "qwen3_5_moe": dict(moe_intermediate_size=256, shared_expert_intermediate_size=256),
          "qwen3_next": dict(mlp_only_layers=[], moe_intermediate_size=256, shared_expert_intermediate_size=256)}
COMMON = dict(layers=4, hidden_size=256, head_dim=64, rope_parameters=ROPE, linear_key_head_dim=64,
              linear_value_head_dim=64)
NAMES = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
         "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
         "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
         "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
         "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
         "mlp.down_proj.weight": "ffn_down.weight", "mlp.gate.weight": "ffn_gate_inp.weight",
         "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
         "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
         "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
         "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
         "linear_attn.in_proj_qkv.weight": "attn_qkv.weight", "linear_attn.in_proj_z.weight": "attn_gate.weight",
         "linear_attn.in_proj_b.weight": "ssm_beta.weight", "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
         "linear_attn.in_proj_ba.weight": "ssm_ba.weight", "linear_attn.conv1d.weight": "ssm_conv1d.weight",
         "linear_attn.dt_bias": "ssm_dt.bias", "linear_attn.A_log": "ssm_a",
         "linear_attn.norm.weight": "ssm_norm.weight",
         "linear_attn.out_proj.weight": "ssm_out.weight"}
TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
       "lm_head.weight": "output.weight"}
EXPERTS = {"gate_proj": "ffn_gate_exps.weight", "up_proj": "ffn_up_exps.weight", "down_proj": "ffn_down_exps.weight"}
#: an MTP block's own tensors (mtp.*) and their nextn names under blk.L. (L: the decoder's layer count)
NEXTN = {"mtp.fc.weight": "nextn.eh_proj.weight", "mtp.pre_fc_norm_embedding.weight": "nextn.enorm.weight",
         "mtp.pre_fc_norm_hidden.weight": "nextn.hnorm.weight", "mtp.norm.weight": "nextn.shared_head_norm.weight"}


def heads_order(t: torch.Tensor, dim: int, outer: int, inner: int, size: int) -> torch.Tensor:
    """[outer, inner, size] blocks along `dim` as [inner, outer, size]: the converter's _reorder_v_heads with
    (outer, inner) = (key heads, value heads per key head); swapped, its inverse."""
    shape = list(t.shape)
    d = dim % t.dim()
    return t.reshape(*shape[:d], outer, inner, size, *shape[d + 1:]).transpose(d, d + 1).reshape(shape)


def to_gguf(hf: dict[str, torch.Tensor], cfg: dict, family: str) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under llama.cpp's names and in its converter's form (float32)."""
    kh, vh, kd, vd = (cfg[f"linear_{k}"] for k in ("num_key_heads", "num_value_heads", "key_head_dim",
                                                   "value_head_dim"))
    rep, tiled = vh // kh, family != "qwen3_next" and kh != vh
    out, stacks, layers = {}, {}, cfg["num_hidden_layers"]
    for name, t in hf.items():
        t = t.float()
        if name in TOP:
            out[TOP[name]] = t + 1 if name == "model.norm.weight" else t
            continue
        if name in NEXTN:  # the MTP block's own parts (its norms stored as 1 + w as the decoder's are)
            out[f"blk.{layers}.{NEXTN[name]}"] = t if name == "mtp.fc.weight" else t + 1
            continue
        name = re.sub(r"^mtp\.layers\.0\.", f"model.layers.{layers}.", name)  # its layer follows the decoder's
        n, rest = re.match(r"model\.layers\.(\d+)\.(.+)", name).groups()
        blk = f"blk.{n}."
        expert = re.match(r"mlp\.experts\.(\d+)\.(\w+)\.weight", rest)
        if expert:
            stacks.setdefault(blk + EXPERTS[expert.group(2)], {})[int(expert.group(1))] = t
            continue
        if rest.endswith("norm.weight") and not rest.startswith("linear_attn."):
            t = t + 1
        if rest == "linear_attn.A_log":
            t = -torch.exp(t)
        if rest == "linear_attn.conv1d.weight":
            t = t.squeeze(1)
        if tiled and rest.startswith("linear_attn."):
            t = tile_v(t, rest, kh, rep, kd, vd)
        if rest == "linear_attn.in_proj_qkvz.weight":
            groups = t.unflatten(0, (kh, -1))
            cuts = np.cumsum([0, kd, kd, rep * vd, rep * vd])
            q, k, v, z = (groups[:, a:b].flatten(0, 1) for a, b in zip(cuts[:-1], cuts[1:]))
            out[blk + "attn_qkv.weight"], out[blk + "attn_gate.weight"] = torch.cat([q, k, v]), z
            continue
        out[blk + NAMES[rest]] = t
    for name, by_expert in stacks.items():
        out[name] = torch.stack([by_expert[e] for e in range(len(by_expert))])
    return out


def tile_v(t: torch.Tensor, rest: str, kh: int, rep: int, kd: int, vd: int, inverse: bool = False) -> torch.Tensor:
    """The converter's value-head reorder of one DeltaNet tensor (grouped by key head -> tiled), or its inverse."""
    outer, inner = (rep, kh) if inverse else (kh, rep)
    if rest in ("linear_attn.in_proj_qkv.weight", "linear_attn.conv1d.weight"):  # q, k, then v rows / channels
        return torch.cat([t[:2 * kh * kd], heads_order(t[2 * kh * kd:], 0, outer, inner, vd)])
    if rest == "linear_attn.in_proj_z.weight":
        return heads_order(t, 0, outer, inner, vd)
    if rest in ("linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight", "linear_attn.A_log",
                "linear_attn.dt_bias"):
        return heads_order(t, 0, outer, inner, 1)
    if rest == "linear_attn.out_proj.weight":
        return heads_order(t, 1, outer, inner, vd)
    return t


def from_gguf(values: dict[str, torch.Tensor], cfg: dict, family: str) -> dict[str, torch.Tensor]:
    """to_gguf's inverse: a GGUF file's (dequantized) values under the checkpoint's names."""
    kh, vh, kd, vd = (cfg[f"linear_{k}"] for k in ("num_key_heads", "num_value_heads", "key_head_dim",
                                                   "value_head_dim"))
    rep, tiled = vh // kh, family != "qwen3_next" and kh != vh
    back, layers = {v: k for k, v in NAMES.items()}, cfg["num_hidden_layers"]
    out = {}
    for name, t in values.items():
        t = t.float()
        top = next((k for k, v in TOP.items() if v == name), None)
        if top:
            out[top] = t - 1 if top == "model.norm.weight" else t
            continue
        n, rest = re.match(r"blk\.(\d+)\.(.+)", name).groups()
        own = next((k for k, v in NEXTN.items() if v == rest), None)
        if own:
            out[own] = t if own == "mtp.fc.weight" else t - 1
            continue
        hf = "mtp.layers.0." if int(n) == layers else f"model.layers.{n}."
        if rest in EXPERTS.values():
            part = next(p for p, g in EXPERTS.items() if g == rest)
            out.update({f"{hf}mlp.experts.{e}.{part}.weight": t[e] for e in range(t.shape[0])})
            continue
        if rest == "attn_gate.weight" and family == "qwen3_next":
            continue  # with attn_qkv below
        if rest == "attn_qkv.weight" and family == "qwen3_next":
            z = values[f"blk.{n}.attn_gate.weight"].float()
            q, k, v = t[:kh * kd], t[kh * kd:2 * kh * kd], t[2 * kh * kd:]
            per = lambda x: x.unflatten(0, (kh, -1))  # noqa: E731
            out[hf + "linear_attn.in_proj_qkvz.weight"] = torch.cat([per(q), per(k), per(v), per(z)], 1).flatten(0, 1)
            continue
        rest = back[rest]
        if rest.endswith("norm.weight") and not rest.startswith("linear_attn."):
            t = t - 1
        if tiled and rest.startswith("linear_attn."):
            t = tile_v(t, rest, kh, rep, kd, vd, inverse=True)
        if rest == "linear_attn.A_log":
            t = torch.log(-t)
        if rest == "linear_attn.conv1d.weight":
            t = t.unsqueeze(1)
        if rest == "mlp.shared_expert_gate.weight":
            t = t.reshape(1, -1)
        out[hf + rest] = t
    return out


def quantizable(name: str, t: torch.Tensor) -> bool:
    """What llama-quantize quantizes: matrices, but the norms, routers and the convolution."""
    return t.dim() >= 2 and t.shape[-1] % 256 == 0 and not name.endswith(("norm.weight", "ffn_gate_inp.weight",
                                                                            "ssm_conv1d.weight", "shexp.weight"))


#: llama.cpp's converter's --fuse-qkv and --fuse-gate-up-exps: the tensor that holds the parts, stacked along rows
FUSED = {"attn_qkv.weight": ("attn_q.weight", "attn_k.weight", "attn_v.weight"),
         "ffn_gate_up_exps.weight": ("ffn_gate_exps.weight", "ffn_up_exps.weight")}


def write(path, hf_dir, family: str, qtype=T.F32, seed: int = 0, mtp: bool = False,
          fuse: bool = False) -> dict[str, torch.Tensor]:
    """The checkpoint in llama.cpp's layout (and with qtype, its matrices quantized: gguf's quantizer for
    Q8_0, Q4_0 and Q5_0, valid random blocks for the others, Q6_K for attn_v and ffn_down as Q4_K_M has them; the shared
    expert's router as the [n] vector a quantized file holds). mtp: a trailing MTP block: the checkpoint's
    (mtp.*), or without one the last layer again with nextn parts (what Strata skips without --mtp). fuse: the
    full-attention layers' q/k/v and the experts' gate/up as one tensor each (the
    converter's --fuse-qkv and --fuse-gate-up-exps; one type for the parts, as llama-quantize gives the fused
    tensor). Returns the values stored under the checkpoint's names (the reference's weights)."""
    from test_gguf_target import add_vocabulary

    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = ARCH[family]
    layers = cfg["num_hidden_layers"]
    w = gguf.GGUFWriter(str(path), arch)
    keys = {"block_count": layers + mtp, "context_length": cfg["max_position_embeddings"],
            "embedding_length": cfg["hidden_size"], "attention.head_count": cfg["num_attention_heads"],
            "attention.head_count_kv": cfg["num_key_value_heads"], "attention.key_length": cfg["head_dim"],
            "attention.value_length": cfg["head_dim"], "ssm.conv_kernel": cfg["linear_conv_kernel_dim"],
            "ssm.state_size": cfg["linear_key_head_dim"], "ssm.group_count": cfg["linear_num_key_heads"],
            "ssm.time_step_rank": cfg["linear_num_value_heads"],
            "ssm.inner_size": cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"],
            "full_attention_interval": cfg.get("full_attention_interval", 4),
            "rope.dimension_count": int(cfg["head_dim"] * ROPE["partial_rotary_factor"])}
    if "intermediate_size" in cfg:
        keys["feed_forward_length"] = cfg["intermediate_size"]
    if family != "qwen3_5":
        keys.update({"expert_count": cfg["num_experts"], "expert_used_count": cfg["num_experts_per_tok"],
                     "expert_feed_forward_length": cfg["moe_intermediate_size"],
                     "expert_shared_feed_forward_length": cfg["shared_expert_intermediate_size"]})
    if mtp:
        keys["nextn_predict_layers"] = 1
    for key, value in keys.items():
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.rope.freq_base", ROPE["rope_theta"])
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    w.add_array(f"{arch}.attention.recurrent_layers",
                [t == "linear_attention" for t in cfg["layer_types"]] + [False] * mtp)
    if family != "qwen3_next":
        w.add_array(f"{arch}.rope.dimension_sections", ROPE["mrope_section"] + [0])
    add_vocabulary(w, hf_dir, cfg["vocab_size"])
    checkpoint = load_file(hf_dir / "model.safetensors")
    tensors = to_gguf(checkpoint, cfg, family)
    if mtp and "mtp.fc.weight" not in checkpoint:  # no block of its own: the last layer again, with nextn parts
        last, h = f"blk.{layers - 1}.", cfg["hidden_size"]
        tensors.update({f"blk.{layers}." + k[len(last):]: t for k, t in list(tensors.items()) if k.startswith(last)})
        tensors.update({f"blk.{layers}.nextn.eh_proj.weight": torch.randn(h, 2 * h) * 0.02,
                        **{f"blk.{layers}.nextn.{k}.weight": torch.ones(h) for k in ("enorm", "hnorm",
                                                                                     "shared_head_norm")}})
    gen, stored, arrays = np.random.default_rng(seed), {}, {}
    for name, t in tensors.items():
        kind = T.Q6_K if qtype == T.Q4_K and name.endswith(("attn_v.weight", "ffn_down.weight")) else qtype
        if kind == T.F32 or not quantizable(name, t):
            if kind != T.F32 and name.endswith("ffn_gate_inp_shexp.weight"):
                t = t.reshape(-1)
            arrays[name] = (t.numpy(), T.F32)
            stored[name] = t
            continue
        flat = t.reshape(-1, t.shape[-1]).numpy()
        arr = quants.quantize(flat, kind) if kind in (T.Q8_0, T.Q4_0, T.Q5_0) else random_blocks(kind, *flat.shape, gen)
        stored[name] = torch.from_numpy(quants.dequantize(arr, kind).reshape(t.shape).copy())
        arrays[name] = (arr.reshape(*t.shape[:-1], -1), kind)
    if fuse:
        for name in [n for n in arrays if n.endswith(FUSED["attn_qkv.weight"][0]) or
                     n.endswith(FUSED["ffn_gate_up_exps.weight"][0])]:
            blk = name.rsplit(".", 2)[0]
            whole, parts = next((f, p) for f, p in FUSED.items() if name.endswith(p[0]))
            pieces = [arrays.pop(f"{blk}.{p}") for p in parts]
            assert len({kind for _, kind in pieces}) == 1, "a fused tensor has one type"
            arrays[f"{blk}.{whole}"] = (np.concatenate([a for a, _ in pieces], axis=pieces[0][0].ndim - 2),
                                        pieces[0][1])
    for name, (arr, kind) in arrays.items():
        w.add_tensor(name, arr, raw_shape=arr.shape, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    keep = "mtp.fc.weight" in checkpoint  # the block's values too, where the checkpoint has it
    return from_gguf({k: v for k, v in stored.items() if keep or not re.match(rf"blk\.{layers}\.", k)}, cfg, family)
