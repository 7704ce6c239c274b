"""The sparse mixture-of-experts MLP and where its experts live: on the device (parameters, or GGUF blocks
in QuantExperts), or, under an expert cache, partly in host memory where the CPU runs them (in their GGUF
blocks when the host kernels take the type: kernels/host_blocks.py)."""

from __future__ import annotations

import time
from typing import Callable

import torch
from torch import nn

from . import graph_breaks, ops
from .kernels import EAGER, Activation, Kernels, host_blocks, unwrap
from .modules import MLP, Linear
from .quant import QuantExperts


class SparseMoE(nn.Module):
    """Qwen3-MoE's MLP: a router over `experts` SwiGLU experts, each row's top_k of them weighted and summed.
    The experts' matrices are stacked: [2, E, I, H] every expert's gate, then every expert's up (as a
    dense MLP's gate_up_proj keeps up at a fixed row offset), and [E, H, I] down; or, from a GGUF file on a
    GPU, QuantExperts of [E, 2I, H] (each expert's gate rows, then its up rows) and [E, H, I]. The kernels
    decide how they run (Kernels.experts)."""

    def __init__(self, hidden: int, intermediate: int, experts: int, top_k: int, renormalize: bool,
                 shared: int = 0):
        """shared: the intermediate size of a shared expert every row also runs, scaled by a sigmoid gate."""
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize
        self.gate = Linear(hidden, experts)
        self.gate_up_proj = nn.Parameter(torch.empty(2, experts, intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, intermediate))
        if shared:
            self.shared_expert = MLP(hidden, shared)
            self.shared_expert_gate = Linear(hidden, 1)

    @property
    def experts(self) -> int:
        return self.gate.weight.shape[0]

    @property
    def quantized(self) -> bool:
        """Whether the experts are kept in GGUF blocks (QuantExperts) rather than as parameters."""
        return isinstance(self.down_proj, QuantExperts)

    @property
    def input_matrix(self):
        """Quantized experts take int8 rows from a fused norm (QuantExperts.takes_int8); stacked parameters
        take none."""
        return self.gate_up_proj if self.quantized else None

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert's three matrices on the device (in their GGUF blocks when quantized)."""
        if self.quantized:
            return sum(q.data.shape[1] * q.data.shape[2] for q in (self.gate_up_proj, self.down_proj))
        return self.host_expert_bytes

    @property
    def host_in_blocks(self) -> bool:
        """Whether experts placed in host memory stay in their GGUF blocks there (the CPU's kernels take both
        types: kernels/host_blocks.py); else they are kept as values."""
        return self.quantized and all(host_blocks.takes(q.qtype) for q in (self.gate_up_proj, self.down_proj))

    @property
    def host_expert_bytes(self) -> int:
        """Bytes of one expert's three matrices as host memory keeps them: blocks (host_in_blocks), else values
        in the activations' dtype."""
        if self.host_in_blocks:
            return self.expert_bytes
        _, hidden, inter = self.down_proj.shape
        return 3 * inter * hidden * torch.tensor([], dtype=self.down_proj.dtype).element_size()

    @property
    def device_experts(self) -> int:
        """Experts whose weights are on the device (all of them until place moves some to host memory)."""
        return self.down_proj.shape[0]

    def dequantize_experts(self, values: Callable | None = None) -> None:
        """Quantized experts (QuantExperts) replaced by parameters of their values, in the stacked layout.
        values(QuantExperts) -> [E, rows, cols]: how (default: its own kernels, where it is)."""
        if self.quantized:
            values = values or (lambda q: q.dequantize())
            e, rows, cols = self.gate_up_proj.shape
            gate_up = values(self.gate_up_proj).view(e, 2, rows // 2, cols).transpose(0, 1).contiguous()
            down = values(self.down_proj)
            del self.gate_up_proj, self.down_proj
            self.gate_up_proj = nn.Parameter(gate_up, requires_grad=False)
            self.down_proj = nn.Parameter(down, requires_grad=False)

    @property
    def host_experts(self) -> int:
        """Experts kept in host memory and run by the CPU (place)."""
        return self.host_down.shape[0] if hasattr(self, "host_down") else 0

    def place(self, resident: list[int], pin: bool = False, dequantize_on=None, keep_blocks: bool = False,
              count: bool = False) -> None:
        """Keep the experts `resident` in the parameters (they go wherever the model goes) and move the
        others to host memory (pinned for fast copies when pin), where the CPU runs them; called before
        the model moves to its device, so the host experts never occupy it. Each forward then reads its
        routing on the host (ops.experts_placed; placed in static shapes). Quantized experts: the device's
        stay in their blocks (QuantExperts), and so do the host's where the CPU's kernels take their types
        (host_in_blocks); else the host's are values, dequantized one expert at a time on dequantize_on
        (default: where they are) into the host's stacks, and keep_blocks keeps their blocks too (when the
        device has slots), for replace to move them onto the device. count: eager forwards count the rows
        routed to each expert (counts), until placement.place_by_routing has used them."""
        stay = sorted(set(resident))
        away = sorted(set(range(self.experts)) - set(stay))
        if not away:
            return
        slot = [0] * self.experts
        for i, e in enumerate(stay):
            slot[e] = i
        for i, e in enumerate(away):
            slot[e] = -1 - i
        gate_up, down = self.gate_up_proj, self.down_proj
        if self.host_in_blocks:
            self.host_gate_up, self.host_down = (QuantExperts(q.qtype, q.data[away].cpu().contiguous(), q.cols, q.dtype)
                                                 for q in (gate_up, down))
            self.gate_up_proj, self.down_proj = (QuantExperts(q.qtype, q.data[stay].contiguous(), q.cols, q.dtype)
                                                 for q in (gate_up, down))
            self.host_blocks = None  # the host's stacks are the blocks
        elif self.quantized:
            _, hidden, inter = down.shape
            self.host_gate_up = torch.empty(2, len(away), inter, hidden, dtype=down.dtype, pin_memory=pin)
            self.host_down = torch.empty(len(away), hidden, inter, dtype=down.dtype, pin_memory=pin)
            for i, e in enumerate(away):
                self.host_gate_up[:, i].copy_(gate_up.values(e, dequantize_on).view(2, inter, hidden))
                self.host_down[i].copy_(down.values(e, dequantize_on))
            blocks = [q.data[away].cpu() for q in (gate_up, down)] if keep_blocks and stay else None
            self.host_blocks = [t.pin_memory() for t in blocks] if blocks and pin else blocks
            self.gate_up_proj, self.down_proj = (QuantExperts(q.qtype, q.data[stay].contiguous(), q.cols, q.dtype)
                                                 for q in (gate_up, down))
        else:
            gate_up, down = gate_up.data, down.data
            host = [gate_up[:, away].cpu().contiguous(), down[away].cpu().contiguous()]
            self.gate_up_proj = nn.Parameter(gate_up[:, stay].contiguous(), requires_grad=False)
            self.down_proj = nn.Parameter(down[stay].contiguous(), requires_grad=False)
            self.host_gate_up, self.host_down = [t.pin_memory() for t in host] if pin else host
        self.slot = slot
        self.register_buffer("stand_in", self._stand_ins(), persistent=False)
        self.counts = torch.zeros(self.experts, dtype=torch.long)  # rows routed to each expert (eager forwards)
        self.counting = count
        self.timing: dict[str, float] = {}

    def _stand_ins(self) -> torch.Tensor:
        """Each expert's device slot, a host expert's being slot 0 (its output is replaced afterwards)."""
        return torch.tensor([max(i, 0) for i in self.slot], device=self.gate.weight.device)

    def replace(self, resident: list[int]) -> int:
        """Make `resident` (as many experts as the device holds) the experts on the device: each one moving
        on swaps weights (or blocks) with one moving off, in place, so captured steps keep their addresses
        (quantized experts the host keeps as values: blocks move on from the host's copy of them, the
        leaving expert's values are made where it was). Returns how many moved on; that copy of the
        blocks is let go after it."""
        want = set(resident)
        if len(want) != self.device_experts:
            raise ValueError(f"{len(want)} experts for {self.device_experts} device slots")
        values = self.quantized and not isinstance(self.host_down, QuantExperts)  # the host keeps values
        if values and getattr(self, "host_blocks", None) is None:
            raise ValueError("quantized experts move onto the device from their blocks: place(keep_blocks=True)")
        off = [e for e in range(self.experts) if self.slot[e] >= 0 and e not in want]
        on = [e for e in sorted(want) if self.slot[e] < 0]
        for a, b in zip(off, on):
            i, j = self.slot[a], -1 - self.slot[b]
            if isinstance(self.host_down, QuantExperts):
                pairs = ((self.gate_up_proj.data[i], self.host_gate_up.data[j]),
                         (self.down_proj.data[i], self.host_down.data[j]))
            elif values:
                gate_up, down = self.gate_up_proj, self.down_proj
                self.host_gate_up[:, j].copy_(gate_up.values(i).view(self.host_gate_up[:, j].shape))
                self.host_down[j].copy_(down.values(i))
                pairs = ((gate_up.data[i], self.host_blocks[0][j]), (down.data[i], self.host_blocks[1][j]))
            else:
                pairs = ((self.gate_up_proj.data[:, i], self.host_gate_up[:, j]),
                         (self.down_proj.data[i], self.host_down[j]))
            for dev, host in pairs:
                leaving = dev.to("cpu", copy=True)
                dev.copy_(host)
                host.copy_(leaving)
            self.slot[a], self.slot[b] = -1 - j, i
        self.stand_in.copy_(self._stand_ins())
        self.host_blocks = None
        return len(on)

    def forward(self, h, kernels: Kernels = EAGER) -> torch.Tensor:
        """h: rows, or an Activation whose int8 copy the experts' products take (Kernels.experts)."""
        h, x8 = unwrap(h)
        flat = h.reshape(-1, h.shape[-1])
        rows = flat if x8 is None else Activation(flat, x8)
        weights, experts = kernels.route(flat, self.gate.weight, self.top_k, self.renormalize)
        if self.host_experts and kernels.static:
            out = self.placed(rows, weights, experts, kernels)
        elif self.host_experts:
            out = ops.experts_placed(flat, self.gate_up_proj, self.down_proj, self.host_gate_up, self.host_down,
                                     self.slot, weights, experts, self.timing,
                                     self.counts if self.counting else None)
        else:
            out = kernels.experts(rows, self.gate_up_proj, self.down_proj, weights, experts)
        out = out.view(h.shape)
        if hasattr(self, "shared_expert"):
            out = out + torch.sigmoid(self.shared_expert_gate(h, kernels)) * self.shared_expert(h, kernels)
        return out

    def placed(self, rows, weights: torch.Tensor, experts: torch.Tensor, kernels: Kernels) -> torch.Tensor:
        """ops.experts_placed in static shapes, no host read among the device's work (a CUDA graph captures
        it in two segments): the device's experts run every (row, expert) pair, a pair whose expert is in
        host memory through a stand-in (stand_in: its resident expert 0), and the host's outputs replace
        the stand-ins' before each row's outputs are summed. The host's pairs run at graph_breaks.on_host,
        once the device's work up to them (its experts included) is done. rows: as forward's h, flat."""
        h = unwrap(rows)[0]
        host_y = torch.empty(*experts.shape, h.shape[-1], dtype=h.dtype, device=h.device)
        host = torch.empty(experts.shape, dtype=torch.bool, device=h.device)
        fill = HostExperts(self, h, experts, host_y, host)
        if not self.device_experts:
            graph_breaks.on_host(fill)
            return kernels.sum_slots(host_y, weights, h.dtype)

        def reduce(y, weights, dtype):
            graph_breaks.on_host(fill)
            return kernels.sum_slots(torch.where(host[..., None], host_y, y), weights, dtype)

        return kernels.experts(rows, self.gate_up_proj, self.down_proj, weights, self.stand_in[experts],
                               reduce=reduce, repeats=True)


class HostExperts:
    """A sparse layer's host work in static shapes (SparseMoE.placed): its rows and routing copied to the
    host (pinned buffers on a GPU), the experts in host memory run there (ops.host_expert_outputs), their
    outputs and where they go copied into device tensors that the rest of the step reads. Timed into the
    layer's timing as experts_placed is."""

    def __init__(self, moe: SparseMoE, h: torch.Tensor, experts: torch.Tensor, y: torch.Tensor,
                 host: torch.Tensor):
        self.moe, self.h, self.experts, self.y, self.host = moe, h, experts, y, host
        self.buffers = None  # the host's side, made at the first call: never while a graph is captured

    def __call__(self) -> None:
        t0 = time.perf_counter()
        if self.buffers is None:
            pin = self.h.is_cuda
            self.buffers = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
                            for t in (self.h, self.experts, self.y, self.host)]
            self.ready = torch.cuda.Event() if pin else None
        h, experts, y, host = self.buffers
        h.copy_(self.h, non_blocking=True)
        experts.copy_(self.experts, non_blocking=True)
        if self.ready is not None:
            self.ready.record()
            self.ready.synchronize()
        t1 = time.perf_counter()
        moe = self.moe
        outputs = ops.host_expert_outputs(h, experts, moe.host_gate_up, moe.host_down, moe.slot)
        for buf, t, out in zip((y, host), outputs, (self.y, self.host)):
            buf.copy_(t)
            out.copy_(buf, non_blocking=True)  # the next call's wait on ready comes after this copy
        timing = moe.timing
        timing["routing_read"] = timing.get("routing_read", 0.0) + t1 - t0
        timing["host_experts"] = timing.get("host_experts", 0.0) + time.perf_counter() - t1
