"""Qwen3-MoE: Qwen3's attention with a mixture-of-experts MLP (a softmax router, top-k SwiGLU experts) in
the layers that decoder_sparse_step and mlp_only_layers name; transformers' Qwen3MoeForCausalLM and
llama.cpp's qwen3moe layout."""

from __future__ import annotations

from ..errors import StrataError
from .config import MoeConfig, moe_from_hf
from .decoder import DenseFamily, dense_gguf_config, gguf_count
from .registry import register


def sparse_layout(hf: str, param: str, moe: MoeConfig, hidden: int) -> dict[str, list[tuple[str, tuple]]]:
    """A sparse MLP's router and experts (transformers' per-expert names under `hf`, e.g.
    model.layers.N.mlp.) packed into SparseMoE's parameters under `param`: every expert's gate, then
    every expert's up; every expert's down."""
    e, i = range(moe.experts), moe.intermediate
    return {param + "gate.weight": [(hf + "gate.weight", (moe.experts, hidden))],
            param + "gate_up_proj": [(f"{hf}experts.{n}.{part}.weight", (i, hidden))
                                     for part in ("gate_proj", "up_proj") for n in e],
            param + "down_proj": [(f"{hf}experts.{n}.down_proj.weight", (hidden, i)) for n in e]}


def sparse_gguf_layout(blk: str, param: str, moe: MoeConfig, hidden: int) -> dict[str, list[tuple]]:
    """sparse_layout's parameters from llama.cpp's tensors under `blk` (blk.N.): its router and 3-D experts."""
    from ..gguf_names import EXPERTS

    e, i, h = moe.experts, moe.intermediate, hidden
    return {param + "gate.weight": [(blk + "ffn_gate_inp.weight", (e, h), None)],
            param + "gate_up_proj": [(blk + EXPERTS["gate"], (e, i, h), None), (blk + EXPERTS["up"], (e, i, h), None)],
            param + "down_proj": [(blk + EXPERTS["down"], (e, h, i), None)]}


def moe_gguf_config(a: str, kv: dict, tensors: dict, where: str, layers: int, shared: int = 0) -> MoeConfig:
    """The experts of llama.cpp's `{a}.expert_*` keys, sparse in the layers that have a router. Its qwen3moe,
    qwen35moe and qwen3next graphs always renormalise the top-k weights (Qwen3-MoE's norm_topk_prob)."""
    experts, top_k, inter = (gguf_count(kv, f"{a}.{k}", where) for k in ("expert_count", "expert_used_count",
                                                                            "expert_feed_forward_length"))
    if top_k > experts:
        raise StrataError(f"{where}: metadata key '{a}.expert_used_count' {top_k} exceeds {a}.expert_count {experts}")
    scale = kv.get(f"{a}.expert_weights_scale", 0.0)
    if scale not in (0, 0.0, 1, 1.0):
        raise StrataError(f"{where}: metadata key '{a}.expert_weights_scale' = {scale!r} scales the experts' "
                          f"weights, which is not supported")
    sparse = [n for n in range(layers) if f"blk.{n}.ffn_gate_inp.weight" in tensors]
    return MoeConfig(experts, top_k, inter, True, sparse, shared)


class Qwen3Moe(DenseFamily):
    name = "qwen3_moe"
    architectures = ("Qwen3MoeForCausalLM",)
    model_types = ("qwen3_moe",)
    gguf_arch = "qwen3moe"
    qk_norm = True

    def config(self, hf, where):
        cfg = super().config(hf, where)
        cfg.moe = moe_from_hf(hf, where, cfg.num_layers, bool(hf.get("norm_topk_prob", False)))
        return cfg

    def gguf_config(self, kv, tensors, where):
        plain = {k: v for k, v in kv.items() if k != f"{self.gguf_arch}.expert_count"}
        cfg = dense_gguf_config(self, plain, tensors, where)
        cfg.moe = moe_gguf_config(self.gguf_arch, kv, tensors, where, cfg.num_layers)
        return cfg

    def hf_layout(self, cfg):
        out = super().hf_layout(cfg)
        for n in cfg.moe.layers:
            param = f"layers.{n}.mlp."
            del out[param + "gate_up_proj.weight"], out[param + "down_proj.weight"]
            out.update(sparse_layout(f"model.layers.{n}.mlp.", param, cfg.moe, cfg.hidden_size))
        return out

    def gguf_layout(self, cfg):
        out = {param: sources for param, sources in super().gguf_layout(cfg).items()
               if not any(param == f"layers.{n}.mlp.{m}" for n in cfg.moe.layers
                          for m in ("gate_up_proj.weight", "down_proj.weight"))}
        for n in cfg.moe.layers:
            out.update(sparse_gguf_layout(f"blk.{n}.", f"layers.{n}.mlp.", cfg.moe, cfg.hidden_size))
        return out


register(Qwen3Moe())
