"""Qwen3.5 (text): a hybrid of gated DeltaNet linear-attention layers and gated full-attention layers
(3:1 by default), partial RoPE, zero-centred RMSNorms; transformers' Qwen3_5ForCausalLM and llama.cpp's
qwen35 layout, with their mixture-of-experts kin (Qwen3.5-MoE: qwen35moe; Qwen3-Next: qwen3next)."""

from __future__ import annotations

import torch

from ..errors import StrataError
from ..gguf_names import HYBRID, nextn_layer
from ..layers.linear_attention import GatedDeltaNet
from .config import LinearAttentionConfig, moe_from_hf, optional, require
from .decoder import DenseFamily, attention, dense_gguf_config, dense_hf_layout, gguf_count, gguf_value
from .mtp import MTPHead
from .qwen3_moe import moe_gguf_config, sparse_gguf_layout
from .registry import register


def in_checkpoint(layout: dict, cfg) -> dict:
    """A layout's checkpoint names under the config's prefix (a vision-language checkpoint's decoder)."""
    if cfg.checkpoint_prefix == "model.":
        return layout
    rename = lambda name: cfg.checkpoint_prefix + name[len("model."):] if name.startswith("model.") else name  # noqa: E731
    return {param: [(rename(name), shape) for name, shape in sources] for param, sources in layout.items()}


def rope_order(head_dim: int, rotary: int) -> torch.Tensor:
    """Where each of a head's dims goes so that rotate-half over the whole head pairs exactly the dims
    partial RoPE rotates (the rotating halves at 0 and head_dim / 2, the rest beside them at angle 0)."""
    half, rest = rotary // 2, (head_dim - rotary) // 2
    return torch.cat([torch.arange(half), torch.arange(rotary, rotary + rest), torch.arange(half, rotary),
                      torch.arange(rotary + rest, head_dim)])


def rows(index: torch.Tensor):
    """A transform of a tensor's rows (gguf_layout's third field): these rows, in this order."""
    return lambda t: t.index_select(0, index)


def hybrid_gguf_config(fam, kv: dict, tensors: dict, where: str):
    """A hybrid's hyper-parameters from llama.cpp's keys: the decoder's as for a dense file (without the
    `nextn_predict_layers` MTP blocks that follow it), partial RoPE from `rope.dimension_count` (the M-RoPE
    sections are one RoPE for text, whose positions are the same in each), the DeltaNet shape from the
    `ssm.*` keys, its layers from `attention.recurrent_layers` (else every `full_attention_interval`-th layer
    attends), the experts from `expert_*`."""
    a = fam.gguf_arch
    total = gguf_count(kv, f"{a}.block_count", where)
    nextn = gguf_value(kv, f"{a}.nextn_predict_layers", where, 0, f"a count below {a}.block_count {total}", int,
                       lambda v: 0 <= v < total)
    layers = total - nextn
    main = {name: info for name, info in tensors.items() if nextn_layer(name, layers) is None}
    plain = {k: v for k, v in kv.items() if k not in (f"{a}.expert_count", f"{a}.rope.dimension_count")}
    plain[f"{a}.block_count"] = layers
    moe = f"{a}.expert_count" in kv
    if moe and f"{a}.feed_forward_length" not in kv:
        plain[f"{a}.feed_forward_length"] = kv.get(f"{a}.expert_feed_forward_length")
    cfg = dense_gguf_config(fam, plain, main, where)
    cfg.mtp_layers = nextn
    rotary = gguf_value(kv, f"{a}.rope.dimension_count", where, None,
                        f"an even count up to the head dim {cfg.head_dim}", int,
                        lambda v: 0 < v <= cfg.head_dim and v % 2 == 0)
    cfg.rope.rotary_dim = rotary

    def count(key: str, default=None) -> int:
        return gguf_count(kv, f"{a}.{key}", where, default)

    k_heads, v_heads, k_dim, inner = (count(f"ssm.{k}") for k in ("group_count", "time_step_rank", "state_size",
                                                                   "inner_size"))
    if v_heads % k_heads or inner % v_heads:
        raise StrataError(f"{where}: metadata keys '{a}.ssm.time_step_rank' {v_heads} (value heads) and "
                          f"'{a}.ssm.inner_size' {inner} must be multiples of '{a}.ssm.group_count' {k_heads} and of "
                          f"the value heads")
    recurrent = kv.get(f"{a}.attention.recurrent_layers")
    if recurrent is None:
        every = count("full_attention_interval", 4)
        recurrent = [(n + 1) % every != 0 for n in range(layers)]
    if not (isinstance(recurrent, list) and len(recurrent) >= layers and all(isinstance(r, bool) for r in recurrent)):
        raise StrataError(f"{where}: metadata key '{a}.attention.recurrent_layers' must list a bool for each of the "
                          f"{layers} layers")
    cfg.linear = LinearAttentionConfig([n for n in range(layers) if recurrent[n]], k_heads, v_heads, k_dim,
                                       inner // v_heads, count("ssm.conv_kernel"),
                                       tiled=fam.gguf_tiled and k_heads != v_heads)
    if moe:
        shared = count("expert_shared_feed_forward_length") if f"blk.{layers - 1}.ffn_up_shexp.weight" in main else 0
        cfg.moe = moe_gguf_config(a, kv, main, where, layers, shared)
    return cfg


class Qwen3_5(DenseFamily):
    name = "qwen3_5"
    architectures = ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration")
    model_types = ("qwen3_5_text",)
    gguf_arch = "qwen35"
    gguf_tiled = True  # its converter reorders the value heads to tiled order (GatedDeltaNet's tiled)
    qk_norm = True
    rope_scalings = ()

    def config(self, hf, where):
        """A text model's config.json, or a vision-language one's text_config (its decoder runs alone)."""
        prefix = "model."
        if isinstance(hf.get("text_config"), dict):
            hf = {"tie_word_embeddings": hf.get("tie_word_embeddings", False), **hf["text_config"]}
            prefix = "model.language_model."
        cfg = super().config(hf, where)
        cfg.checkpoint_prefix = prefix
        cfg.mtp_layers = optional(hf, "mtp_num_hidden_layers", where, 0, int) if hf.get("mtp_num_hidden_layers") else 0
        types = hf.get("layer_types")
        if not isinstance(types, list) or len(types) != cfg.num_layers or \
                set(types) - {"linear_attention", "full_attention"}:
            raise StrataError(f"{where}: field 'layer_types' must list 'linear_attention' or 'full_attention' "
                              f"for each of the {cfg.num_layers} layers")
        factor = optional(hf.get("rope_parameters") or {}, "partial_rotary_factor", where,
                          optional(hf, "partial_rotary_factor", where, 1.0, float), float)
        rotary = int(cfg.head_dim * factor)
        if rotary % 2 or not 0 < rotary <= cfg.head_dim:
            raise StrataError(f"{where}: partial_rotary_factor {factor} gives {rotary} rotary dims of a head of "
                              f"{cfg.head_dim}")
        cfg.rope.rotary_dim = rotary
        k_heads, v_heads = (require(hf, f"linear_num_{x}_heads", where) for x in ("key", "value"))
        if v_heads % k_heads:
            raise StrataError(f"{where}: linear_num_value_heads {v_heads} is not a multiple of "
                              f"linear_num_key_heads {k_heads}")
        cfg.linear = LinearAttentionConfig([n for n, t in enumerate(types) if t == "linear_attention"], k_heads,
                                           v_heads, require(hf, "linear_key_head_dim", where),
                                           require(hf, "linear_value_head_dim", where),
                                           require(hf, "linear_conv_kernel_dim", where))
        return cfg

    def build(self, cfg):
        """The decoder, and with cfg.load_mtp its MTP block (models/mtp.py)."""
        model = super().build(cfg)
        if cfg.load_mtp:
            model.mtp = MTPHead(cfg, attention(cfg, 0, gated=True))
        return model

    def mixer(self, cfg, index):
        """Gated DeltaNet in the linear-attention layers, gated attention in the others."""
        lin = cfg.linear
        if index in lin.layers:
            return GatedDeltaNet(index, cfg.hidden_size, lin.k_heads, lin.v_heads, lin.k_dim, lin.v_dim, lin.kernel,
                                 cfg.rms_norm_eps, lin.tiled)
        return attention(cfg, index, gated=True)

    def hf_layout(self, cfg):
        h, lin, d = cfg.hidden_size, cfg.linear, cfg.head_dim
        out = dense_hf_layout(cfg)
        for n in range(cfg.num_layers):
            hf, param = f"model.layers.{n}.", f"layers.{n}."
            if n not in lin.layers:
                out[param + "self_attn.qkv_proj.weight"][0] = (hf + "self_attn.q_proj.weight", (2 * cfg.num_heads * d, h))
                continue
            for key in [k for k in out if k.startswith(param + "self_attn.")]:
                del out[key]
            a, src = param + "linear_attn.", hf + "linear_attn."
            channels = 2 * lin.k_heads * lin.k_dim + lin.v_heads * lin.v_dim
            out[a + "in_proj.weight"] = [(src + "in_proj_qkv.weight", (channels, h)),
                                         (src + "in_proj_z.weight", (lin.v_heads * lin.v_dim, h)),
                                         (src + "in_proj_b.weight", (lin.v_heads, h)),
                                         (src + "in_proj_a.weight", (lin.v_heads, h))]
            out[a + "conv_weight"] = [(src + "conv1d.weight", (channels, 1, lin.kernel))]
            out[a + "dt_bias"] = [(src + "dt_bias", (lin.v_heads,))]
            out[a + "A_log"] = [(src + "A_log", (lin.v_heads,))]
            out[a + "norm.weight"] = [(src + "norm.weight", (lin.v_dim,))]
            out[a + "out_proj.weight"] = [(src + "out_proj.weight", (h, lin.v_heads * lin.v_dim))]
        return in_checkpoint(out, cfg)

    def gguf_config(self, kv, tensors, where):
        return hybrid_gguf_config(self, kv, tensors, where)

    def gguf_layout(self, cfg):
        """llama.cpp's tensors, which its converter stored with the norms as 1 + w (as the modules keep them),
        A as -exp(A_log), the convolution squeezed and (qwen35) the value heads tiled, which the modules
        take as they are (GatedDeltaNet's tiled). Left to undo: partial RoPE's order of a head's dims (rows)
        and qwen3next's b and a of each key head's group together (rows)."""
        out, lin, h, d = super().gguf_layout(cfg), cfg.linear, cfg.hidden_size, cfg.head_dim
        order = rope_order(d, cfg.rope.rotary_dim)
        heads, kv = torch.arange(2 * cfg.num_heads * d).view(cfg.num_heads, 2, d), torch.arange(cfg.num_kv_heads * d)
        q_rows = torch.stack([heads[:, 0][:, order], heads[:, 1]], dim=1).flatten()
        k_rows = kv.view(cfg.num_kv_heads, d)[:, order].flatten()
        channels, vd = 2 * lin.k_heads * lin.k_dim + lin.v_heads * lin.v_dim, lin.v_heads * lin.v_dim
        for n in range(cfg.num_layers):
            blk, param = f"blk.{n}.", f"layers.{n}."
            out[param + "post_attention_layernorm.weight"] = [(blk + HYBRID["post_attention_layernorm.weight"],
                                                               (h,), None)]
            if n not in lin.layers:
                (q, _, _), k, v = out[param + "self_attn.qkv_proj.weight"]
                out[param + "self_attn.qkv_proj.weight"] = [(q, (2 * cfg.num_heads * d, h), rows(q_rows)),
                                                            (k[0], k[1], rows(k_rows)), v]
                for norm in ("q_norm", "k_norm"):
                    (name, shape, _), = out[param + f"self_attn.{norm}.weight"]
                    out[param + f"self_attn.{norm}.weight"] = [(name, shape, rows(order))]
                continue
            for key in [k for k in out if k.startswith(param + "self_attn.")]:
                del out[key]
            a = param + "linear_attn."
            out[a + "in_proj.weight"] = [(blk + HYBRID["in_proj_qkv"], (channels, h), None),
                                         (blk + HYBRID["in_proj_z"], (vd, h), None)] + self.gguf_ba(blk, lin, h)
            out[a + "conv_weight"] = [(blk + HYBRID["conv1d"], (channels, lin.kernel), None)]
            out[a + "dt_bias"] = [(blk + HYBRID["dt_bias"], (lin.v_heads,), None)]
            out[a + "A_log"] = [(blk + HYBRID["A"], (lin.v_heads,), lambda t: torch.log(-t))]
            out[a + "norm.weight"] = [(blk + HYBRID["norm"], (lin.v_dim,), None)]
            out[a + "out_proj.weight"] = [(blk + HYBRID["out_proj"], (h, vd), None)]
        return out

    def gguf_ba(self, blk: str, lin, hidden: int) -> list[tuple]:
        """The input projection's b rows then its a rows."""
        return [(blk + HYBRID["in_proj_b"], (lin.v_heads, hidden), None),
                (blk + HYBRID["in_proj_a"], (lin.v_heads, hidden), None)]

    def finish(self, state, cfg):
        """Zero-centred norms (the checkpoint stores w, the model scales by 1 + w) and partial RoPE's dims
        moved where the shared rotate-half kernel rotates them."""
        out = dict(state)
        for name, t in state.items():
            if name.endswith("norm.weight") and "linear_attn" not in name:
                out[name] = (1.0 + t.float()).to(t.dtype)
        order = rope_order(cfg.head_dim, cfg.rope.rotary_dim)
        h, kv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        attending = [f"layers.{n}." for n in range(cfg.num_layers) if n not in cfg.linear.layers]
        for layer in attending + (["mtp.layer."] if "mtp.layer.self_attn.qkv_proj.weight" in state else []):
            p = layer + "self_attn."
            w = out[p + "qkv_proj.weight"]
            q = w[:2 * h * d].unflatten(0, (h, 2, d))
            q = torch.stack([q[:, 0][:, order], q[:, 1]], dim=1).flatten(0, 2)
            k = w[2 * h * d:(2 * h + kv) * d].unflatten(0, (kv, d))[:, order].flatten(0, 1)
            out[p + "qkv_proj.weight"] = torch.cat([q, k, w[(2 * h + kv) * d:]])
            for norm in ("q_norm.weight", "k_norm.weight"):
                out[p + norm] = out[p + norm][order]
        return out


class Qwen3_5Moe(Qwen3_5):
    """Qwen3.5's hybrid layers with a mixture-of-experts MLP in every layer: a renormalised top-k of routed
    experts plus a sigmoid-gated shared expert."""

    name = "qwen3_5_moe"
    architectures = ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")
    model_types = ("qwen3_5_moe_text",)
    gguf_arch = "qwen35moe"

    sparse_by_config = False  # every layer sparse (Qwen3-Next: as decoder_sparse_step / mlp_only_layers say)

    def renormalizes(self, text: dict) -> bool:
        """Qwen3.5-MoE's router always rescales its top-k weights to sum to 1."""
        return True

    def config(self, hf, where):
        text = hf.get("text_config") if isinstance(hf.get("text_config"), dict) else hf
        inter = require(text, "moe_intermediate_size", where)  # the dense MLP size fields it may lack
        if text is hf:
            hf = {"intermediate_size": inter, **hf}
        else:
            hf = {**hf, "text_config": {"intermediate_size": inter, **text}}
        cfg = super().config(hf, where)
        cfg.moe = moe_from_hf(text, where, cfg.num_layers, self.renormalizes(text), shared=True,
                              sparse_by_config=self.sparse_by_config)
        return cfg

    def hf_layout(self, cfg):
        from .qwen3_moe import sparse_layout

        out, h, moe, top = super().hf_layout(cfg), cfg.hidden_size, cfg.moe, cfg.checkpoint_prefix
        for n in moe.layers:
            hf, param = f"{top}layers.{n}.mlp.", f"layers.{n}.mlp."
            del out[param + "gate_up_proj.weight"], out[param + "down_proj.weight"]
            out.update(sparse_layout(hf, param, moe, h))
            out[param + "shared_expert.gate_up_proj.weight"] = [(hf + "shared_expert.gate_proj.weight", (moe.shared, h)),
                                                                (hf + "shared_expert.up_proj.weight", (moe.shared, h))]
            out[param + "shared_expert.down_proj.weight"] = [(hf + "shared_expert.down_proj.weight", (h, moe.shared))]
            out[param + "shared_expert_gate.weight"] = [(hf + "shared_expert_gate.weight", (1, h))]
        return out

    def gguf_layout(self, cfg):
        out, h, moe = super().gguf_layout(cfg), cfg.hidden_size, cfg.moe
        for n in moe.layers:
            blk, param = f"blk.{n}.", f"layers.{n}.mlp."
            del out[param + "gate_up_proj.weight"], out[param + "down_proj.weight"]
            out.update(sparse_gguf_layout(blk, param, moe, h))
            if moe.shared:
                out[param + "shared_expert.gate_up_proj.weight"] = [
                    (blk + HYBRID["shared_gate"], (moe.shared, h), None),
                    (blk + HYBRID["shared_up"], (moe.shared, h), None)]
                out[param + "shared_expert.down_proj.weight"] = [(blk + HYBRID["shared_down"], (h, moe.shared), None)]
                out[param + "shared_expert_gate.weight"] = [(blk + HYBRID["shared_router"], (1, h), None)]
        return out


class Qwen3Next(Qwen3_5Moe):
    """Qwen3-Next: Qwen3.5-MoE's layers with the DeltaNet input projections grouped per key head (q, k, v,
    z of a group together; b, a likewise), regrouped at load; sparse layers as decoder_sparse_step and
    mlp_only_layers say, the top-k renormalised when norm_topk_prob."""

    name = "qwen3_next"
    architectures = ("Qwen3NextForCausalLM",)
    model_types = ("qwen3_next",)
    gguf_arch = "qwen3next"
    gguf_tiled = False  # its converter keeps the value heads grouped, q/k/v/z regrouped as finish does

    sparse_by_config = True

    def renormalizes(self, text):
        return bool(text.get("norm_topk_prob", True))

    def config(self, hf, where):
        require(hf, "intermediate_size", where)  # its dense layers' MLP
        return super().config(hf, where)

    def hf_layout(self, cfg):
        out, lin, h = super().hf_layout(cfg), cfg.linear, cfg.hidden_size
        rep = lin.v_heads // lin.k_heads
        for n in lin.layers:
            src = f"model.layers.{n}.linear_attn."
            out[f"layers.{n}.linear_attn.in_proj.weight"] = [
                (src + "in_proj_qkvz.weight", (lin.k_heads * (2 * lin.k_dim + 2 * rep * lin.v_dim), h)),
                (src + "in_proj_ba.weight", (lin.k_heads * 2 * rep, h))]
        return out

    def gguf_ba(self, blk, lin, hidden):
        """ssm_ba: each key head's group's b rows, then its a rows."""
        rep = lin.v_heads // lin.k_heads
        groups = torch.arange(2 * lin.v_heads).view(lin.k_heads, 2, rep)
        return [(blk + HYBRID["in_proj_ba"], (2 * lin.v_heads, hidden), rows(groups[:, i].flatten())) for i in (0, 1)]

    def finish(self, state, cfg):
        lin, out = cfg.linear, dict(state)
        rep, kd, vd = lin.v_heads // lin.k_heads, lin.k_dim, lin.v_dim
        split = lin.k_heads * (2 * kd + 2 * rep * vd)
        for n in lin.layers:
            name = f"layers.{n}.linear_attn.in_proj.weight"
            w = state[name]
            groups = w[:split].unflatten(0, (lin.k_heads, -1))
            qkvz = [groups[:, a:b].flatten(0, 1) for a, b in ((0, kd), (kd, 2 * kd), (2 * kd, 2 * kd + rep * vd),
                                                              (2 * kd + rep * vd, 2 * kd + 2 * rep * vd))]
            ba = w[split:].unflatten(0, (lin.k_heads, 2 * rep))
            out[name] = torch.cat(qkvz + [ba[:, :rep].flatten(0, 1), ba[:, rep:].flatten(0, 1)])
        return super().finish(out, cfg)


register(Qwen3_5())
register(Qwen3_5Moe())
register(Qwen3Next())
