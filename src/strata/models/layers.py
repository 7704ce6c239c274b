"""Building blocks shared by the target decoder and the DFlash drafter.

Everything works on one sequence at a time: activations are [tokens, features].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import RopeConfig, llama3_inv_freq


def init_weights_(model: nn.Module, std: float = 0.02) -> nn.Module:
    """Training from scratch: norms at one, every other weight N(0, std) (torch's global RNG)."""
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            nn.init.ones_(p)
        else:
            nn.init.normal_(p, 0.0, std)
    return model


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class RotaryTable:
    """cos/sin of NeoX (rotate-half) RoPE for every position up to max_positions."""

    def __init__(self, head_dim: int, rope: RopeConfig, max_positions: int, device, dtype, orig_max_pos: int = 8192):
        inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        if rope.scaling is not None:
            inv_freq = llama3_inv_freq(inv_freq, rope.scaling, orig_max_pos)
        pos = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = emb.cos().to(device=device, dtype=dtype)
        self.sin = emb.sin().to(device=device, dtype=dtype)
        self.max_positions = max_positions

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [..., T, heads, head_dim]; positions: [T] or [..., T] int64."""
        cos = self.cos[positions].unsqueeze(-2)
        sin = self.sin[positions].unsqueeze(-2)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Grouped-query attention. q: [..., T, H, D]; k, v: [..., S, Hkv, D]; mask: [..., T, S] bool
    (True = visible), or None for full visibility. Returns [..., T, H*D]."""
    *lead, t, h, d = q.shape
    if mask is not None and mask.dim() > 2:
        mask = mask.unsqueeze(-3)  # broadcast over heads
    out = F.scaled_dot_product_attention(
        q.transpose(-3, -2), k.transpose(-3, -2), v.transpose(-3, -2), attn_mask=mask, scale=d ** -0.5,
        enable_gqa=h != k.shape[-2],  # K/V heads are shared by groups of query heads without copies
    )
    return out.transpose(-3, -2).reshape(*lead, t, h * d)


class Attention(nn.Module):
    """Projections of one attention layer; the caller decides which keys a query sees."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, eps: float, bias: bool, qk_norm: bool):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=bias)
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, eps)
            self.k_norm = RMSNorm(head_dim, eps)
        else:
            self.q_norm = self.k_norm = None

    def query(self, x: torch.Tensor, rope: RotaryTable, positions: torch.Tensor, trace=None) -> torch.Tensor:
        q = self.q_proj(x).view(*x.shape[:-1], self.heads, self.head_dim)
        if trace:
            q = trace("q_raw", q)
        if self.q_norm is not None:
            q = self.q_norm(q)
            if trace:
                q = trace("q_normed", q)
        q = rope.apply(q, positions)
        return trace("q_roped", q) if trace else q

    def key_value(self, x: torch.Tensor, rope: RotaryTable, positions: torch.Tensor, trace=None):
        k = self.k_proj(x).view(*x.shape[:-1], self.kv_heads, self.head_dim)
        if self.k_norm is not None:
            k = self.k_norm(k)
        v = self.v_proj(x).view(*x.shape[:-1], self.kv_heads, self.head_dim)
        k = rope.apply(k, positions)
        if trace:
            k, v = trace("k", k), trace("v", v)
        return k, v


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm transformer layer (Qwen3/Llama layout, also the DFlash drafter's)."""

    def __init__(self, hidden, intermediate, heads, kv_heads, head_dim, eps, bias=False, qk_norm=True):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = Attention(hidden, heads, kv_heads, head_dim, eps, bias, qk_norm)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = MLP(hidden, intermediate)

    def forward(self, x, rope, positions, keys_fn, mask, trace=None):
        """keys_fn(k_new, v_new) -> (k_all, v_all) lets the caller splice in cached keys.

        trace(stage, tensor) -> tensor, when given, sees (and may replace) every intermediate: the
        parity tool records them and its self-test plants bugs through it."""
        h = self.input_layernorm(x)
        if trace:
            h = trace("attn_in", h)
        q = self.self_attn.query(h, rope, positions, trace)
        k, v = self.self_attn.key_value(h, rope, positions, trace)
        k_all, v_all = keys_fn(k, v)
        a = attend(q, k_all, v_all, mask)
        if trace:
            a = trace("attn", a)
        x = x + self.self_attn.o_proj(a)
        if trace:
            x = trace("o_residual", x)
        m = self.mlp(self.post_attention_layernorm(x))
        if trace:
            m = trace("mlp", m)
        return x + m
