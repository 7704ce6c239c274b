"""The decoder-only causal LM every target family builds: embedding, decoder layers, final norm, LM
head, and taps of the residual stream. One forward serves prefill, a 1-token decode, a verify window
and training batches; the model runner decides shapes, cells and kernels (engine/runner.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..cache import KVCache
from ..layers.kernels import EAGER, Kernels
from ..layers.modules import Linear, RMSNorm, Step, causal_masks, run_layers
from ..layers.rotary import RotaryTable
from .config import ModelConfig, dense_config
from .registry import Family


@dataclass
class ForwardOut:
    logits: torch.Tensor | None  # [..., T, vocab] float32 ([..., 1, vocab] for "last", None for "none")
    taps: torch.Tensor | None  # [..., T, len(taps) * hidden]


class DecoderLM(nn.Module):
    def __init__(self, cfg: ModelConfig, layers: list[nn.Module]):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)
        self.rotary: RotaryTable | None = None

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def tie_weights_(self) -> "DecoderLM":
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        return self

    def make_cache(self, cells: int, batch: int | None = None) -> KVCache:
        """A cache of `cells` positions (and the rotary table to cover them)."""
        cfg = self.cfg
        if self.rotary is None:
            self.rotary = RotaryTable(cfg.head_dim, cfg.rope, self.device, self.dtype, cfg.max_position_embeddings)
        self.rotary.ensure(cells)
        return KVCache(cfg.num_layers, cells, cfg.num_kv_heads, cfg.head_dim, self.device, self.dtype, batch)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(tokens)

    def head(self, h: torch.Tensor, kernels: Kernels = EAGER) -> torch.Tensor:
        """Normed hidden states -> float32 logits; the drafter's head too (it has none of its own)."""
        return self.lm_head(h, kernels).float()

    def forward(self, tokens: torch.Tensor, step: Step, cache: KVCache, taps=(), logits: str = "all") -> ForwardOut:
        """tokens [..., T] at step.positions: their K/V are written to the cache, every row attends over
        the cells up to its position, and `taps` (HF layer ids: feature l is the residual stream after
        decoder layer l) come back concatenated. logits: "all" rows, the "last" row, or "none"."""
        step = step.for_layers(self.rotary.at(step.positions), causal_masks(step))
        wanted = {layer: slot for slot, layer in enumerate(taps or ())}
        x, pending, tapped = run_layers(self.layers, self.embed(tokens), step, cache, wanted)
        out = None
        if logits != "none":
            norm = self.norm
            h = step.kernels.rms_norm(x, norm.weight, norm.eps) if pending is None else \
                step.kernels.add_rms_norm(x, pending, norm.weight, norm.eps)[1]
            out = self.head(h[..., -1:, :] if logits == "last" else h, step.kernels)
        return ForwardOut(out, torch.cat(tapped, dim=-1) if tapped else None)

    def forward_batch(self, tokens: torch.Tensor, taps=(), logits: bool = True) -> ForwardOut:
        """A causal pass over a batch [B, T] from position 0 (training, batched feature tables)."""
        b, t = tokens.shape
        positions = torch.arange(t, device=tokens.device)
        return self(tokens, Step(positions, t), self.make_cache(t, batch=b), taps, "all" if logits else "none")


def layer_layout(hf: str, param: str, hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int,
                 bias: bool, qk_norm: bool) -> dict[str, list[tuple[str, tuple]]]:
    """A Llama-lineage decoder layer's checkpoint tensors (names under `hf`) packed into a DecoderLayer's
    parameters (names under `param`)."""
    q, kv = heads * head_dim, kv_heads * head_dim
    out = {
        param + "input_layernorm.weight": [(hf + "input_layernorm.weight", (hidden,))],
        param + "self_attn.qkv_proj.weight": [(hf + "self_attn.q_proj.weight", (q, hidden)),
                                              (hf + "self_attn.k_proj.weight", (kv, hidden)),
                                              (hf + "self_attn.v_proj.weight", (kv, hidden))],
        param + "self_attn.o_proj.weight": [(hf + "self_attn.o_proj.weight", (hidden, q))],
        param + "post_attention_layernorm.weight": [(hf + "post_attention_layernorm.weight", (hidden,))],
        param + "mlp.gate_up_proj.weight": [(hf + "mlp.gate_proj.weight", (intermediate, hidden)),
                                            (hf + "mlp.up_proj.weight", (intermediate, hidden))],
        param + "mlp.down_proj.weight": [(hf + "mlp.down_proj.weight", (hidden, intermediate))],
    }
    if bias:
        out[param + "self_attn.qkv_proj.bias"] = [(hf + "self_attn.q_proj.bias", (q,)),
                                                  (hf + "self_attn.k_proj.bias", (kv,)),
                                                  (hf + "self_attn.v_proj.bias", (kv,))]
        out[param + "self_attn.o_proj.bias"] = [(hf + "self_attn.o_proj.bias", (hidden,))]
    if qk_norm:
        out[param + "self_attn.q_norm.weight"] = [(hf + "self_attn.q_norm.weight", (head_dim,))]
        out[param + "self_attn.k_norm.weight"] = [(hf + "self_attn.k_norm.weight", (head_dim,))]
    return out


def dense_hf_layout(cfg: ModelConfig) -> dict[str, list[tuple[str, tuple]]]:
    """A dense decoder's Hugging Face checkpoint (model.* names, lm_head unless tied)."""
    h = cfg.hidden_size
    out = {"embed_tokens.weight": [("model.embed_tokens.weight", (cfg.vocab_size, h))],
           "norm.weight": [("model.norm.weight", (h,))]}
    for n in range(cfg.num_layers):
        out.update(layer_layout(f"model.layers.{n}.", f"layers.{n}.", h, cfg.intermediate_size, cfg.num_heads,
                                cfg.num_kv_heads, cfg.head_dim, cfg.attention_bias, cfg.qk_norm))
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = [("lm_head.weight", (cfg.vocab_size, h))]
    return out


def build_dense(cfg: ModelConfig) -> DecoderLM:
    from ..layers.modules import DecoderLayer

    return DecoderLM(cfg, [DecoderLayer(i, cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
                                        cfg.head_dim, cfg.rms_norm_eps, cfg.attention_bias, cfg.qk_norm)
                           for i in range(cfg.num_layers)])


class DenseFamily(Family):
    """A dense decoder of the Llama lineage, in transformers' checkpoint layout; subclasses name it and
    say whether it has q/k norms and which RoPE scalings it reads."""

    qk_norm = False
    rope_scalings: tuple[str, ...] = ("llama3",)

    def config(self, hf, where):
        return dense_config(hf, where, self.name, qk_norm=self.qk_norm, rope_scalings=self.rope_scalings)

    def build(self, cfg):
        return build_dense(cfg)

    def hf_layout(self, cfg):
        return dense_hf_layout(cfg)
