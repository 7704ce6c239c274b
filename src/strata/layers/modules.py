"""The blocks models are built from, written once: RMSNorm, attention with fused q/k/v, the gated MLP
with fused gate/up, the pre-norm decoder layer, and the Step every layer of a forward reads.

Fused matrices (qkv_proj, gate_up_proj) are the real parameters: the loaders pack checkpoint tensors
into them (models/loader.py). A layer writes its window's K/V into its cache cells and attends over
the first `kv_len` cells under the step's mask: nothing else is read."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, ClassVar, NamedTuple, Protocol

import torch
from torch import nn

from .kernels import EAGER, Kernels
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
    block: int | None = None  # a drafter's rows per block where a step packs several (training); None: one

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
