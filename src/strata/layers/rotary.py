"""Rotary position embedding tables (NeoX rotate-half layout), with Llama 3's frequency rescaling."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class RopeConfig:
    theta: float = 10000.0
    scaling: dict | None = None  # {"rope_type": "llama3", "factor": ...} or None
    factors: list[float] | None = None  # per-frequency divisors, as llama.cpp's rope_freqs tensor stores them
    rotary_dim: int | None = None  # partial RoPE: only this many dims of a head rotate (see RotaryTable)


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict, orig_max_pos_default: int = 8192) -> torch.Tensor:
    """Llama 3.1 frequency-dependent rope rescaling (published formula)."""
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_ctx = float(scaling.get("original_max_position_embeddings", orig_max_pos_default))
    low_wavelen = old_ctx / low
    high_wavelen = old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class Rope:
    """cos/sin of one pass's positions, broadcast over heads: [..., T, 1, head_dim]."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor):
        self.cos, self.sin = cos, sin


class RotaryTable:
    """cos/sin for every position below `positions`, grown when a cache is allocated (never inside a
    captured step). Outgrown tables stay alive: graphs captured earlier still read them."""

    def __init__(self, head_dim: int, rope: RopeConfig, device, dtype, positions: int = 0):
        self.head_dim, self.rope, self.device, self.dtype = head_dim, rope, device, dtype
        self.positions = 0
        self.cos = self.sin = None
        self._outgrown: list[torch.Tensor] = []
        self.ensure(positions)

    def ensure(self, positions: int) -> None:
        if positions <= self.positions:
            return
        d = self.rope.rotary_dim or self.head_dim
        inv_freq = 1.0 / (self.rope.theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        if self.rope.scaling is not None:
            inv_freq = llama3_inv_freq(inv_freq, self.rope.scaling,
                                       self.rope.scaling.get("original_max_position_embeddings", 8192))
        if self.rope.factors is not None:
            inv_freq = inv_freq / torch.tensor(self.rope.factors, dtype=torch.float32)
        if self.cos is not None:
            self._outgrown += [self.cos, self.sin]
        freqs = torch.outer(torch.arange(positions, dtype=torch.float32), inv_freq)
        if d < self.head_dim:  # partial RoPE: the other dims get angle 0 (the loader moved them there)
            freqs = torch.cat([freqs, freqs.new_zeros(positions, (self.head_dim - d) // 2)], dim=-1)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = emb.cos().to(device=self.device, dtype=self.dtype)
        self.sin = emb.sin().to(device=self.device, dtype=self.dtype)
        self.positions = positions

    def at(self, positions: torch.Tensor) -> Rope:
        """The rows of `positions` ([T] or [..., T] int64), gathered once for every layer of a pass."""
        return Rope(self.cos[positions].unsqueeze(-2), self.sin[positions].unsqueeze(-2))
