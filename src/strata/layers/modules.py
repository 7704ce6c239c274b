"""The blocks models are built from, written once: RMSNorm, attention with fused q/k/v, the gated MLP
with fused gate/up, the pre-norm decoder layer, and the Step every layer of a forward reads.

Fused matrices (qkv_proj, gate_up_proj) are the real parameters: the loaders pack checkpoint tensors
into them (models/loader.py). A layer writes its window's K/V into its cache cells and attends over
the first `kv_len` cells under the step's mask: nothing else is read."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable, ClassVar, NamedTuple, Protocol

import torch
from torch import nn

from . import graph_breaks, ops
from .kernels import EAGER, Activation, Kernels, unwrap
from .quant import QuantExperts
from .rotary import Rope

#: probe(layer, stage, tensor) -> tensor: sees (and may replace) an intermediate; layer -1 is outside the layers
Probe = Callable[[int, str, torch.Tensor], torch.Tensor]


class LayerKV(NamedTuple):
    """One layer's cache: [..., cells, kv_heads, head_dim] each; cell t holds position t's key/value."""
    k: torch.Tensor
    v: torch.Tensor


@dataclass
class Step:
    """One forward over a window of rows, as the model runner sets it up; read by every layer.

    `cells` default to the positions (a cache addressed by position); only training packs rows at
    other cells. `rope` and `masks` are filled in by the model (Step.for_layers)."""

    positions: torch.Tensor  # [..., T] int64 RoPE positions of the rows
    kv_len: int  # attention reads cache cells [0, kv_len)
    kernels: Kernels = EAGER
    cells: torch.Tensor | None = None  # [T] cache cells the rows' K/V are written to
    probe: Probe | None = None
    rope: Rope | None = None
    masks: dict | None = None  # a layer's attention window (None: unbounded) -> [..., T, kv_len] bool

    def for_layers(self, rope: Rope, masks: dict | None = None) -> "Step":
        """This step with the model's RoPE rows (and masks, unless the caller set them)."""
        cells = self.cells if self.cells is not None else self.positions
        return replace(self, rope=rope, masks=self.masks if masks is None else masks, cells=cells)

    def probed(self, layer: int, stage: str, t: torch.Tensor) -> torch.Tensor:
        return t if self.probe is None else self.probe(layer, stage, t)

    def probe_cells(self, layer: int, stage: str, buf: torch.Tensor) -> None:
        """Probe the rows this step wrote into a cache buffer; a replaced tensor is written back."""
        if self.probe is not None:
            rows = buf.index_select(-3, self.cells)
            new = self.probe(layer, stage, rows)
            if new is not rows:
                buf.index_copy_(-3, self.cells, new)


def causal_masks(step: Step) -> dict:
    """A target's visibility: every row sees the cells up to its own position."""
    cells = torch.arange(step.kv_len, device=step.positions.device)
    return {None: cells <= step.positions.unsqueeze(-1)}


class Linear(nn.Module):
    """A projection's weight [out, in] (and bias); the kernel set decides how it runs."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor, kernels: Kernels = EAGER) -> torch.Tensor:
        return kernels.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, kernels: Kernels = EAGER) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self.eps)


class Mixer(Protocol):
    """What mixes a layer's rows across positions (attention, gated DeltaNet): a DecoderLayer holds one under
    its `prefix` (the checkpoint's name for it). A forward may start at any position within the last `rows`
    of the one before (a rejected draft's rows are written again): attention's cache is cut by its length,
    a recurrent state replays from the states it kept."""

    prefix: ClassVar[str]  # "self_attn", "linear_attn"
    recurrent: ClassVar[bool]  # its state follows one sequence: no trees, batches or adaptive windows
    index: int

    def new_state(self, cache, rows: int, batch: int | None):
        """What forward gets as `state`: its part of a new cache whose forwards verify up to `rows` rows."""

    @property
    def input_matrix(self):
        """The matrix its input rows go into first (a fused norm may hand it int8 rows), or None."""

    def forward(self, h: torch.Tensor, step: Step, state) -> torch.Tensor:
        """h [..., T, hidden] -> [..., T, hidden], the output projection included."""


class FeedForward(Protocol):
    """A layer's MLP (the dense SwiGLU, the mixture of experts)."""

    host_experts: int  # experts an expert cache keeps in host memory (0: all on the device)

    @property
    def input_matrix(self):
        """As Mixer's."""

    def forward(self, h: torch.Tensor, kernels: Kernels) -> torch.Tensor:
        ...


class Attention(nn.Module):
    """Grouped-query attention with one q/k/v projection, optional per-head q/k norms (Qwen3) and NeoX
    RoPE. Which cells a query sees is the step's mask for its window."""

    prefix = "self_attn"
    recurrent = False

    def __init__(self, index: int, hidden: int, heads: int, kv_heads: int, head_dim: int, eps: float, bias: bool,
                 qk_norm: bool, gated: bool = False, window: int | None = None):
        """gated (Qwen3.5): each head's query rows are followed by as many gate rows, and the output is
        scaled by sigmoid(gate) before o_proj. window: the cells before a query it sees (None: all; the
        step's masks are keyed by it)."""
        super().__init__()
        self.index, self.heads, self.kv_heads, self.head_dim, self.eps = index, heads, kv_heads, head_dim, eps
        self.gated, self.window = gated, window
        self.qkv_proj = Linear(hidden, ((2 if gated else 1) * heads + 2 * kv_heads) * head_dim, bias)
        self.o_proj = Linear(heads * head_dim, hidden, bias)
        self.q_norm = RMSNorm(head_dim, eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps) if qk_norm else None

    @property
    def input_matrix(self):
        return self.qkv_proj.weight

    def new_state(self, cache, rows: int, batch: int | None) -> LayerKV:
        return cache.layers[self.index]

    def forward(self, h: torch.Tensor, step: Step, kv: LayerKV) -> torch.Tensor:
        a = step.probed(self.index, "attn", self.attend(h, step, kv, step.masks[self.window]))
        return self.o_proj(a, step.kernels)

    def attend(self, h: torch.Tensor, step: Step, kv: LayerKV, mask: torch.Tensor) -> torch.Tensor:
        """h [..., T, hidden] -> attention output [..., T, heads * head_dim]; the rows' K/V are stored first."""
        kernels, heads, d = step.kernels, self.heads, self.head_dim
        out = self.qkv_proj(h, kernels)
        gate = None
        if self.gated:
            qg = out[..., :2 * heads * d].unflatten(-1, (heads, 2 * d))
            gate = qg[..., d:].flatten(-2)
            out = torch.cat([qg[..., :d].flatten(-2), out[..., 2 * heads * d:]], dim=-1)
        qk_width = (heads + self.kv_heads) * d
        qk = out[..., :qk_width].unflatten(-1, (heads + self.kv_heads, d))
        v = out[..., qk_width:].unflatten(-1, (self.kv_heads, d))
        if step.probe is not None:
            qk = torch.cat([step.probed(self.index, "q_raw", qk[..., :heads, :]), qk[..., heads:, :]], dim=-2)
        q_w, k_w = (self.q_norm.weight, self.k_norm.weight) if self.q_norm is not None else (None, None)
        q = kernels.norm_rotate_store(qk, v, q_w, k_w, step.rope.cos, step.rope.sin, self.eps, heads, kv.k, kv.v,
                                      step.cells)
        if step.probe is not None:
            q = step.probed(self.index, "q_roped", q)
            step.probe_cells(self.index, "k", kv.k)
            step.probe_cells(self.index, "v", kv.v)
        into = self.o_proj.weight if gate is None and step.probe is None else None
        a = kernels.attend(q, kv.k.narrow(-3, 0, step.kv_len), kv.v.narrow(-3, 0, step.kv_len), mask, into)
        return a if gate is None else a * torch.sigmoid(gate)

    def store_context(self, c: torch.Tensor, step: Step, kv: LayerKV) -> None:
        """K/V of rows that ask no queries (a drafter's context features) into the step's cells."""
        kernels, q_rows = step.kernels, self.heads * self.head_dim
        bias = None if self.qkv_proj.bias is None else self.qkv_proj.bias[q_rows:]
        kv_rows = kernels.linear(c, self.qkv_proj.weight[q_rows:], bias).unflatten(-1, (2, self.kv_heads,
                                                                                        self.head_dim))
        kernels.norm_rotate_store_kv(kv_rows[..., 0, :, :], kv_rows[..., 1, :, :], self.k_norm.weight,
                                     step.rope.cos, step.rope.sin, self.eps, kv.k, kv.v, step.cells)


class MLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up stacked in one matrix."""

    host_experts = 0

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * intermediate)
        self.down_proj = Linear(intermediate, hidden)

    @property
    def input_matrix(self):
        return self.gate_up_proj.weight

    def forward(self, h: torch.Tensor, kernels: Kernels = EAGER) -> torch.Tensor:
        return self.down_proj(kernels.gate_up_silu(h, self.gate_up_proj.weight), kernels)


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
    def host_expert_bytes(self) -> int:
        """Bytes of one expert's three matrices as values in the activations' dtype (how host memory keeps it)."""
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
        stay in their blocks (QuantExperts), the host's are values, dequantized one expert at a time on
        dequantize_on (default: where they are) into the host's stacks; keep_blocks: the host also keeps
        their blocks (when the device has slots), for replace to move them onto the device. count: eager
        forwards count the rows routed to each expert (counts), until placement.place_by_routing has used
        them."""
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
        if self.quantized:
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
        on swaps weights with one moving off, in place, so captured steps keep their addresses (quantized
        experts: blocks move on from the host's copy of them, the leaving expert's values are made where
        it was). Returns how many moved on; quantized experts' host blocks are let go after it."""
        want = set(resident)
        if len(want) != self.device_experts:
            raise ValueError(f"{len(want)} experts for {self.device_experts} device slots")
        if self.quantized and getattr(self, "host_blocks", None) is None:
            raise ValueError("quantized experts move onto the device from their blocks: place(keep_blocks=True)")
        off = [e for e in range(self.experts) if self.slot[e] >= 0 and e not in want]
        on = [e for e in sorted(want) if self.slot[e] < 0]
        for a, b in zip(off, on):
            i, j = self.slot[a], -1 - self.slot[b]
            if self.quantized:
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


class DecoderLayer(nn.Module):
    """Pre-norm transformer layer: input norm, a mixer (Mixer: attention, gated DeltaNet), post norm, an MLP
    (FeedForward); the Qwen3/Llama layout, the hybrids' and the DFlash drafter's.

    forward returns (x, mlp_out) unsummed: the next layer adds mlp_out inside its input norm's kernel
    group (`pending`), and the model adds the last one inside its final norm's."""

    def __init__(self, cfg, index: int, mixer: Mixer, mlp: FeedForward):
        """cfg: hidden_size and rms_norm_eps (a target's ModelConfig, a drafter's DFlashConfig)."""
        super().__init__()
        self.index = index
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self._mixer = mixer.prefix
        self.add_module(mixer.prefix, mixer)  # layers.N.self_attn.* / linear_attn.*, as checkpoints name them
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp

    @property
    def mixer(self) -> Mixer:
        return self._modules[self._mixer]

    def forward(self, x: torch.Tensor, pending: torch.Tensor | None, step: Step, state):
        kernels, i, mixer = step.kernels, self.index, self.mixer
        norm = self.input_layernorm
        into = mixer.input_matrix if step.probe is None else None
        if pending is None:
            h = kernels.rms_norm(x, norm.weight, norm.eps, into)
        else:
            x, h = kernels.add_rms_norm(x, pending, norm.weight, norm.eps, into)
        h = step.probed(i, "attn_in", h)
        mixed = mixer(h, step, state)
        norm = self.post_attention_layernorm
        into = self.mlp.input_matrix if step.probe is None else None
        x, h = kernels.add_rms_norm(x, mixed, norm.weight, norm.eps, into)
        if step.probe is not None:
            x = step.probed(i, "o_residual", x)
            h = kernels.rms_norm(x, norm.weight, norm.eps)
        return x, step.probed(i, "mlp", self.mlp(h, kernels))


def run_layers(layers, x: torch.Tensor, step: Step, cache, taps: dict[int, int] | None = None):
    """x through the layers; returns (x, pending mlp output of the last layer, tapped layer outputs in
    the order of `taps` {layer id: slot})."""
    tapped = [None] * len(taps or {})
    pending = None
    for layer in layers:
        x, pending = layer(x, pending, step, cache.layers[layer.index])
        if step.probe is not None:
            x, pending = step.probed(layer.index, "out", x + pending), None
        if taps and layer.index in taps:
            tapped[taps[layer.index]] = x if pending is None else x + pending
    return x, pending, tapped


def init_weights_(model: nn.Module, std: float = 0.02) -> nn.Module:
    """Training from scratch: norms at one, every other weight N(0, std) (torch's global RNG)."""
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            nn.init.ones_(p)
        else:
            nn.init.normal_(p, 0.0, std)
    return model
