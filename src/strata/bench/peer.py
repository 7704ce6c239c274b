"""transformers' own model of a Strata target, built on the very same weights: the bench's peer. One entry a
family, or the reason it has none; how a family's config and packed weights read as transformers' config and
in-memory state dict (its loader converts some checkpoint tensors on from_pretrained; here they are converted
the same way from the checkpoint's names)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ..models.qwen3_5 import rope_order


def moe_config(cfg) -> dict:
    m = cfg.moe
    return dict(num_experts=m.experts, num_local_experts=m.experts, num_experts_per_tok=m.top_k,
                moe_intermediate_size=m.intermediate, norm_topk_prob=m.renormalize, decoder_sparse_step=1,
                mlp_only_layers=[n for n in range(cfg.num_layers) if n not in m.layers],
                shared_expert_intermediate_size=m.shared)


def stacked_experts(checkpoint: dict, cfg) -> dict:
    """transformers 5 holds each sparse layer's experts as two stacked parameters."""
    out = dict(checkpoint)
    for n in cfg.moe.layers:
        hf, e = f"model.layers.{n}.mlp.experts.", range(cfg.moe.experts)
        gate, up, down = ([out.pop(f"{hf}{x}.{part}.weight") for x in e] for part in ("gate_proj", "up_proj",
                                                                                       "down_proj"))
        out[hf + "gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(gate, up)])
        out[hf + "down_proj"] = torch.stack(down)
    return out


def hybrid_config(cfg) -> dict:
    lin = cfg.linear
    types = ["linear_attention" if n in lin.layers else "full_attention" for n in range(cfg.num_layers)]
    return dict(layer_types=types,
                linear_num_key_heads=lin.k_heads, linear_num_value_heads=lin.v_heads, linear_key_head_dim=lin.k_dim,
                linear_value_head_dim=lin.v_dim, linear_conv_kernel_dim=lin.kernel,
                rope_parameters={"rope_type": "default", "rope_theta": cfg.rope.theta,
                                 "partial_rotary_factor": cfg.rope.rotary_dim / cfg.head_dim})


def hybrid_state(checkpoint: dict, cfg) -> dict:
    """The checkpoint as stored: Qwen3.5's finish (its norm offset and RoPE dim order) undone, exactly."""
    order = torch.argsort(rope_order(cfg.head_dim, cfg.rope.rotary_dim))
    h, kv, d, out = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, dict(checkpoint)
    for name, t in checkpoint.items():
        if name.endswith("norm.weight") and "linear_attn" not in name:
            out[name] = (t.float() - 1.0).to(t.dtype)
        if name.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight")):
            out[name] = out[name][order]
        elif name.endswith("self_attn.q_proj.weight"):
            q = t.unflatten(0, (h, 2, d))
            out[name] = torch.stack([q[:, 0][:, order], q[:, 1]], dim=1).flatten(0, 2)
        elif name.endswith("self_attn.k_proj.weight"):
            out[name] = t.unflatten(0, (kv, d))[:, order].flatten(0, 1)
        elif name.endswith("linear_attn.conv1d.weight"):
            out[name] = t.reshape(t.shape[0], 1, -1)
    return out


@dataclass(frozen=True)
class Peer:
    cls: str  # transformers' model class
    model_type: str  # its config's model_type
    config: Callable = field(default=lambda cfg: {})  # its config fields beyond the dense decoder's
    state: Callable = field(default=lambda checkpoint, cfg: checkpoint)  # the checkpoint as its modules hold it


#: every family's peer, or why it has none
PEERS: dict[str, Peer | str] = {
    "qwen3": Peer("Qwen3ForCausalLM", "qwen3"),
    "llama": Peer("LlamaForCausalLM", "llama"),
    "qwen3_moe": Peer("Qwen3MoeForCausalLM", "qwen3_moe", moe_config, stacked_experts),
    "qwen3_5": Peer("Qwen3_5ForCausalLM", "qwen3_5_text", hybrid_config, hybrid_state),
    "qwen3_5_moe": Peer("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text",
                        lambda cfg: {**hybrid_config(cfg), **moe_config(cfg)},
                        lambda checkpoint, cfg: stacked_experts(hybrid_state(checkpoint, cfg), cfg)),
    "qwen3_next": "Qwen3-Next's grouped projections are not regrouped back",
}
