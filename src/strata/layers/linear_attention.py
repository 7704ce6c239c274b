"""Gated DeltaNet (Qwen3.5 / Qwen3-Next linear attention) and its per-sequence state, with lossless rollback.

A linear-attention layer carries a convolution window (the last K-1 inputs) and a recurrent state instead
of K/V cells. Speculation needs the state after the last accepted token for any acceptance length. The
convolution windows are small: each forward keeps those at its last `slots` positions. The recurrent state
is not (heads x Dk x Dv floats a position), so each forward keeps its start state, its end state and its
rows' inputs (q, k, v, decay, beta), and the next forward starting inside them replays the accepted rows
from the start state: the same arithmetic the forward did, so the same bits. All indices are device
tensors (no host read, graph-safe); target-only decoding, chunked prefill and rollback are the same case."""

from __future__ import annotations

import torch
from torch import nn

from ..errors import StrataError
from .kernels import Kernels
from .modules import Linear, RMSNorm, Step


class LinearState:
    """A layer's state: conv window slot j at position end - slots + j; the recurrent state at `begin` (the
    last forward's first position) and at `end`, and the inputs of that forward's first `slots` rows."""

    def __init__(self, slots: int, channels: int, kernel: int, k_heads: int, v_heads: int, k_dim: int, v_dim: int,
                 device, dtype, tiled: bool = False):
        self.slots, self.tiled = slots, tiled
        self.conv = torch.zeros(slots + 1, kernel - 1, channels, device=device, dtype=dtype)
        self.rec = torch.zeros(2, v_heads, k_dim, v_dim, device=device, dtype=torch.float32)  # at begin, at end
        self.qk = torch.zeros(2, slots, k_heads, k_dim, device=device, dtype=dtype)
        self.v = torch.zeros(slots, v_heads, v_dim, device=device, dtype=dtype)
        self.gb = torch.zeros(2, slots, v_heads, device=device, dtype=torch.float32)  # log decay, beta
        self.begin = torch.zeros((), dtype=torch.long, device=device)
        self.end = torch.zeros((), dtype=torch.long, device=device)

    def start(self, first: torch.Tensor, kernels: Kernels):
        """(conv window, recurrent state) at position `first`: zero at 0, the end state at the end, else
        the start state with the rows before `first` replayed (a rollback into the last forward)."""
        j = (first - self.end + self.slots).clamp(0, self.slots)
        fresh, at_end = first == 0, first == self.end
        conv = torch.where(fresh, 0.0, self.conv.index_select(0, j.view(1))[0])
        if not kernels.static and (fresh | at_end).item():  # eager steps may read the host: no replay needed
            return conv, torch.where(fresh, 0.0, self.rec[1])
        rows = torch.where(at_end | fresh, 0, (first - self.begin).clamp(0, self.slots))  # replay only a rollback
        _, replayed = kernels.delta_rule(self.qk[0], self.qk[1], self.v, self.gb[0], self.gb[1], self.rec[0], rows,
                                         self.tiled)
        return conv, torch.where(fresh, 0.0, torch.where(at_end, self.rec[1], replayed))

    def keep(self, first: torch.Tensor, x_full: torch.Tensor, inputs: tuple, rec0: torch.Tensor,
             rec1: torch.Tensor) -> None:
        """After a forward of T rows from `first`: the conv windows at its last `slots` + 1 positions, the
        states before and after it, and its first `slots` rows' inputs (qk, v, gb as delta_inputs gives)."""
        t, kernel = x_full.shape[0] - self.conv.shape[1], self.conv.shape[1] + 1
        m = (torch.arange(self.slots + 1, device=x_full.device) + t - self.slots).clamp(0, t)  # 0: before row 0
        windows = x_full.unfold(0, kernel - 1, 1).transpose(1, 2)  # [T+1, K-1, C]: inputs before each position
        torch.index_select(windows, 0, m, out=self.conv)
        self.rec[0].copy_(rec0)
        self.rec[1].copy_(rec1)
        n = min(t, self.slots)
        qk, v, gb = inputs
        self.qk[:, :n].copy_(qk[:, :n])
        self.v[:n].copy_(v[:n])
        self.gb[:, :n].copy_(gb[:, :n])
        self.begin.copy_(first)
        self.end.copy_(first + t)


class GatedDeltaNet(nn.Module):
    """Qwen3.5's linear-attention mixer: one input projection (q, k, v for the convolution, then z, b, a),
    a causal depthwise convolution, the gated delta rule over value heads, a gated RMSNorm, out_proj. A
    Mixer (layers/modules.py) whose state is recurrent."""

    prefix = "linear_attn"
    recurrent = True
    input_matrix = None  # its input projection takes float rows

    def __init__(self, index: int, hidden: int, k_heads: int, v_heads: int, k_dim: int, v_dim: int, kernel: int,
                 eps: float, tiled: bool = False):
        """tiled: the value heads in llama.cpp's qwen35 order (value head j reads key head j % k_heads), not
        transformers' (j // (v_heads / k_heads)): its files are loaded as they are, quantized rows and
        columns never moved."""
        super().__init__()
        self.index, self.k_heads, self.v_heads, self.k_dim, self.v_dim, self.eps = \
            index, k_heads, v_heads, k_dim, v_dim, eps
        self.tiled = tiled
        self.channels = 2 * k_heads * k_dim + v_heads * v_dim
        self.kernel = kernel
        self.in_proj = Linear(hidden, self.channels + v_heads * v_dim + 2 * v_heads)
        self.conv_weight = nn.Parameter(torch.empty(self.channels, kernel))
        self.dt_bias = nn.Parameter(torch.empty(v_heads))
        self.A_log = nn.Parameter(torch.empty(v_heads))
        self.norm = RMSNorm(v_dim, eps)
        self.out_proj = Linear(v_heads * v_dim, hidden)

    def new_state(self, cache, rows: int, batch: int | None) -> LinearState:
        if batch is not None:
            raise StrataError("linear-attention targets decode one sequence at a time (no batches)")
        return self.make_state(rows, cache.kv.device, cache.kv.dtype)

    def make_state(self, slots: int, device, dtype) -> LinearState:
        return LinearState(slots, self.channels, self.kernel, self.k_heads, self.v_heads, self.k_dim, self.v_dim,
                           device, dtype, self.tiled)

    def forward(self, h: torch.Tensor, step: Step, state: LinearState) -> torch.Tensor:
        """h [T, hidden] at consecutive positions from step.positions[0] -> the mixer's output [T, hidden]."""
        if h.dim() != 2:
            raise NotImplementedError("linear-attention layers run one sequence at a time")
        kernels = step.kernels
        proj = self.in_proj(h, kernels)
        y = kernels.gated_delta_net(self, proj, step.positions.reshape(-1)[0], state)
        return self.out_proj(y, kernels)

    def mix(self, proj: torch.Tensor, first: torch.Tensor, state: LinearState, kernels: Kernels) -> torch.Tensor:
        """What runs between the projections, in the reference ops and the kernel set's groups: the input
        projection proj [T, C + Hv*Dv + 2Hv] of rows from position `first` -> the gated RMSNorm's output
        [T, Hv*Dv] in the model's type, the state advanced past the rows."""
        c = self.channels
        z_end = c + self.v_heads * self.v_dim
        conv0, rec0 = state.start(first, kernels)
        x_full, qk, v, gb = kernels.delta_inputs(conv0, proj, self.conv_weight, self.A_log, self.dt_bias,
                                                 self.k_heads, self.v_heads, self.k_dim, self.v_dim)
        out, rec1 = kernels.delta_rule(qk[0], qk[1], v, gb[0], gb[1], rec0, tiled=self.tiled)
        state.keep(first, x_full, (qk, v, gb), rec0, rec1)
        z = proj[:, c:z_end].unflatten(-1, (self.v_heads, self.v_dim))
        return kernels.gated_rms_norm(out.to(self.norm.weight.dtype), z, self.norm.weight, self.eps).flatten(-2)
