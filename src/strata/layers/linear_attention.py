"""Gated DeltaNet (Qwen3.5 / Qwen3-Next linear attention) and its per-sequence state, rolled back for free.

A linear-attention layer carries a convolution window (the last K-1 inputs) and a recurrent state instead
of K/V cells. Speculation needs the state after the last accepted token for any acceptance length, so
each forward keeps the states at the last `slots` positions it passed, and the next forward starts from
the one at its first position: a verify of W rows followed by a round at pos + a + 1 resumes from the
state after the a-th row, with no host read (all indices are device tensors: graph-safe), and target-only
decoding, chunked prefill and rollback are the same case."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import ops
from .kernels import Kernels
from .modules import Linear, RMSNorm, Step


class LinearState:
    """Slot j holds the layer's state at position end - slots + j (the inputs before it, folded in)."""

    def __init__(self, slots: int, channels: int, kernel: int, heads: int, k_dim: int, v_dim: int, device, dtype):
        self.slots = slots
        self.conv = torch.zeros(slots + 1, kernel - 1, channels, device=device, dtype=dtype)
        self.rec = torch.zeros(slots + 1, heads, k_dim, v_dim, device=device, dtype=torch.float32)
        self.end = torch.zeros((), dtype=torch.long, device=device)

    def start(self, first: torch.Tensor):
        """(conv window, recurrent state) at position `first`: zero at 0, else a kept slot."""
        j = (first - self.end + self.slots).clamp(0, self.slots)
        fresh = first == 0
        conv = torch.where(fresh, 0.0, self.conv.index_select(0, j.view(1))[0])
        rec = torch.where(fresh, 0.0, self.rec.index_select(0, j.view(1))[0])
        return conv, rec

    def keep(self, first: torch.Tensor, x_full: torch.Tensor, states: torch.Tensor, rec0: torch.Tensor) -> None:
        """After a forward of T rows from `first`: the windows and states at its last `slots` + 1 positions."""
        t, kernel = states.shape[0], self.conv.shape[1] + 1
        m = (torch.arange(self.slots + 1, device=states.device) + t - self.slots).clamp(0, t)  # 0: before row 0
        windows = x_full.unfold(0, kernel - 1, 1).transpose(1, 2)  # [T+1, K-1, C]: inputs before each position
        self.conv.copy_(windows.index_select(0, m))
        self.rec.copy_(torch.cat([rec0[None], states]).index_select(0, m))
        self.end.copy_(first + t)


class GatedDeltaNet(nn.Module):
    """Qwen3.5's linear-attention mixer: one input projection (q, k, v for the convolution, then z, b, a),
    a causal depthwise convolution, the gated delta rule over value heads, a gated RMSNorm, out_proj."""

    def __init__(self, index: int, hidden: int, k_heads: int, v_heads: int, k_dim: int, v_dim: int, kernel: int,
                 eps: float):
        super().__init__()
        self.index, self.k_heads, self.v_heads, self.k_dim, self.v_dim, self.eps = \
            index, k_heads, v_heads, k_dim, v_dim, eps
        self.channels = 2 * k_heads * k_dim + v_heads * v_dim
        self.kernel = kernel
        self.in_proj = Linear(hidden, self.channels + v_heads * v_dim + 2 * v_heads)
        self.conv_weight = nn.Parameter(torch.empty(self.channels, kernel))
        self.dt_bias = nn.Parameter(torch.empty(v_heads))
        self.A_log = nn.Parameter(torch.empty(v_heads))
        self.norm = RMSNorm(v_dim, eps)
        self.out_proj = Linear(v_heads * v_dim, hidden)

    def make_state(self, slots: int, device, dtype) -> LinearState:
        return LinearState(slots, self.channels, self.kernel, self.v_heads, self.k_dim, self.v_dim, device, dtype)

    def forward(self, h: torch.Tensor, step: Step, state: LinearState, kernels: Kernels) -> torch.Tensor:
        """h [T, hidden] at consecutive positions from step.positions[0] -> the mixer's output [T, hidden]."""
        if h.dim() != 2:
            raise NotImplementedError("linear-attention layers run one sequence at a time")
        t, c = h.shape[0], self.channels
        vd = self.v_heads * self.v_dim
        z_end = c + vd
        proj = self.in_proj(h, kernels)
        first = step.positions.reshape(-1)[0]
        conv0, rec0 = state.start(first)
        x_full = torch.cat([conv0, proj[:, :c]])
        mixed = ops.causal_conv(x_full, self.conv_weight)
        kd = self.k_heads * self.k_dim
        rep = self.v_heads // self.k_heads
        q = mixed[:, :kd].unflatten(-1, (self.k_heads, self.k_dim)).repeat_interleave(rep, dim=1)
        k = mixed[:, kd:2 * kd].unflatten(-1, (self.k_heads, self.k_dim)).repeat_interleave(rep, dim=1)
        v = mixed[:, 2 * kd:].unflatten(-1, (self.v_heads, self.v_dim))
        b, a = proj[:, z_end:z_end + self.v_heads], proj[:, z_end + self.v_heads:]
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        out, states = ops.gated_delta_rule(q, k, v, g, b.sigmoid(), rec0)
        state.keep(first, x_full, states, rec0)
        z = proj[:, c:z_end].unflatten(-1, (self.v_heads, self.v_dim))
        y = ops.gated_rms_norm(out.to(h.dtype), z, self.norm.weight, self.eps)
        return self.out_proj(y.flatten(-2), kernels)
