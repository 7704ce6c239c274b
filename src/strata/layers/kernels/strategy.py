"""The kernel strategy: how a step's projections, attention and elementwise groups run.

`Kernels()` runs the reference ops (ops.py) as they are: the CPU path and prefill. With `compiled=True`
each elementwise group becomes one fused kernel through torch.compile, for the CUDA-graph path (a
batch-1 decode step is otherwise hundreds of tiny kernels). `TritonKernels` also replaces the
projections of up to 16 rows, attention, the norms of a few rows and the q/k group with Strata's
Triton kernels (dense.py, attention.py, norms.py, quantized.py), a gated DeltaNet layer between its
projections with two or three launches of its own (delta.py), and the gated delta rule elsewhere with
fla-core's (fla.py). Modules call these methods and never choose a kernel themselves: they may say which
matrix a norm's or attention's rows go into next (`into`), and the kernel set decides what to make of it:
where it made their int8 copy for a quantized product, it hands the rows on as an Activation. Its switches
are one KernelOptions value."""

from __future__ import annotations

import warnings
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .. import ops
from ..quant import QuantExperts, QuantWeight
from . import attention as attn
from . import delta, dense, fla, norms, pdl
from .common import available
from .options import KernelOptions


class Activation(NamedTuple):
    """Rows a norm or attention kernel wrote together with their quantize_x (x8.py), made in the same launch for
    the quantized product that reads them next (the `into` it was told of). Any other reader takes `x`."""

    x: torch.Tensor
    x8: tuple


def unwrap(x) -> tuple[torch.Tensor, tuple | None]:
    """(the rows, their int8 copy or None) of a Tensor or an Activation."""
    return (x.x, x.x8) if isinstance(x, Activation) else (x, None)


#: the elementwise groups a compiled set fuses, each one kernel
GROUPS = ("rms_norm", "add_rms_norm", "norm_rotate_store", "norm_rotate_store_kv", "silu_mul", "masked_softmax",
          "delta_inputs", "gated_rms_norm", "sum_slots")
ATTENTION_KINDS = ("grouped", "sdpa")


class Kernels:
    def __init__(self, compiled: bool = False, attention: str = "sdpa", static: bool = False,
                 options: KernelOptions = KernelOptions()):
        """attention: "sdpa" (PyTorch's kernel, any batch) or "grouped" (two matmuls per K/V head for one
        sequence: 1.4x faster decode than SDPA on the H200 for an 8B shape). static: the steps may be
        captured in CUDA graphs, so nothing may read a device value on the host (MoE routing). options:
        the kernels' switches (those of the quantized products apply to every set)."""
        self.attention = attention
        self.static = static
        self.options = options
        self.groups = {name: _compiled_or_eager(getattr(ops, name)) if compiled else getattr(ops, name)
                       for name in GROUPS}
        for name, fn in self.groups.items():
            if not hasattr(type(self), name):  # a subclass's own kernel stays; it falls back to self.groups
                setattr(self, name, fn)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, into=None) -> torch.Tensor:
        """ops.rms_norm; into: the matrix the normed rows go into next (a kernel set may prepare them for it)."""
        return self.groups["rms_norm"](x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, into=None):
        """ops.add_rms_norm; into as in rms_norm."""
        return self.groups["add_rms_norm"](x, residual, weight, eps)

    def linear(self, x, w, b: torch.Tensor | None = None) -> torch.Tensor:
        """x @ w^T (+ b); x a tensor or an Activation, w a tensor or a QuantWeight (GGUF blocks, dequantized
        in the kernels' registers)."""
        x, x8 = unwrap(x)
        if isinstance(w, QuantWeight):
            return w.matmul(x, b, x8, self.options)
        return F.linear(x, w, b)

    def experts(self, h: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                experts: torch.Tensor, reduce=None, repeats: bool = False) -> torch.Tensor:
        """Routed rows h [N, H] through their experts (ops.experts_routed's contract): over each expert's rows
        (eager), or in static shapes as a grouped GEMM (gathered per row where torch has none for the type).
        Static sets only: reduce sums the outputs [N, k, H] in place of sum_slots; repeats, a row may name
        an expert more than once (stand-ins for experts run elsewhere). Quantized experts (QuantExperts):
        eager, each expert hit dequantized for its rows; static, one quantized GEMV per assignment."""
        h, x8 = unwrap(h)
        if not self.static:
            return ops.experts_routed(h, gate_up, down, weights, experts)
        if isinstance(gate_up, QuantExperts):  # one quantized GEMV per assignment, whatever the window
            n, k = experts.shape
            ids = experts.reshape(-1)
            act = gate_up.assignments(h, ids, share=k, glu=True, x8=x8, options=self.options)
            y = down.assignments(act, ids, options=self.options)
            return (reduce or self.sum_slots)(y.view(n, k, -1), weights, h.dtype)
        run = ops.experts_grouped if ops.grouped_gemm_fits(h) else ops.experts_gathered
        return run(h, gate_up, down, weights, experts, reduce=reduce or ops.sum_slots)

    def route(self, h: torch.Tensor, router, top_k: int, renormalize: bool):
        """A MoE layer's routing (ops.route's contract)."""
        return ops.route(h, router, top_k, renormalize)

    def delta_rule(self, q, k, v, g, beta, state, rows: torch.Tensor | None = None, tiled: bool = False):
        """The gated delta rule (ops.gated_delta_rule's contract). Eager on a GPU (prefill) through
        fla-core's kernels, its chunked one for long chunks; elsewhere token by token in torch."""
        if q.is_cuda and not self.static and fla.available(q.device):
            return fla.gated_delta_rule(q, k, v, g, beta, state, rows, chunked=q.shape[0] > fla.CHUNKED_MIN_ROWS,
                                        tiled=tiled)
        return ops.gated_delta_rule(q, k, v, g, beta, state, rows, tiled)

    def gated_delta_net(self, layer, proj: torch.Tensor, first: torch.Tensor, state) -> torch.Tensor:
        """A gated DeltaNet layer between its projections (GatedDeltaNet.mix's contract): its composition of
        these methods."""
        return layer.mix(proj, first, state, self)

    def gate_up_silu(self, x, gate_up) -> torch.Tensor:
        """silu(gate) * up of a stacked gate/up matrix ([2I, K]); x as in linear."""
        if isinstance(gate_up, QuantWeight):
            x, x8 = unwrap(x)
            fused = gate_up.gate_up_silu(x, x8, self.options)
            return fused if fused is not None else self.silu_mul(gate_up.matmul(x, None, x8, self.options))
        return self.silu_mul(self.linear(x, gate_up))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
               into=None) -> torch.Tensor:
        """q's rows over k/v under mask; into as in rms_norm."""
        if self.attention == "grouped" and q.dim() == 3:
            return ops.attend_grouped(q, k, v, mask, self.masked_softmax)
        return ops.attend_sdpa(q, k, v, mask)


class TritonKernels(Kernels):
    """The compiled set, with Strata's Triton kernels where their shapes allow: projections of up to 16
    rows (the 1-token decode, a verify window, a drafter block), the experts of up to 256 (row, expert)
    assignments, attention, the norms of up to 64 rows (a 1-row norm or attention into a quantized product
    quantizing its row for it), the q/k norm + RoPE + cache write, and a gated DeltaNet layer between its
    projections (delta.py: three launches in place of ~40). Larger shapes keep cuBLAS (and the
    grouped GEMM for experts). A kernel that fails to build or launch (an older GPU, a
    Triton that rejects it) warns once and leaves its torch path. compiled=False leaves the other
    groups eager (the tests' interpreter runs)."""

    def __init__(self, compiled: bool = True, attention: str = "grouped", options: KernelOptions = KernelOptions()):
        super().__init__(compiled=compiled, attention=attention, static=True, options=options)
        self._failed: set[str] = set()

    def _either(self, name: str, fast, slow):
        """fast() unless the kernel `name` already failed here; slow() after a failure. The first call of
        each step happens outside CUDA-graph capture (the runner warms up first), so a failure shows there."""
        if name not in self._failed:
            try:
                return fast()
            except Exception as e:  # noqa: BLE001 - any Triton failure leaves the torch path
                if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                    raise
                warnings.warn(f"Triton kernel {name} failed ({type(e).__name__}: {e}); using the torch path")
                self._failed.add(name)
        return slow()

    def linear(self, x, w, b=None):
        if isinstance(w, QuantWeight):
            return super().linear(x, w, b)
        x = unwrap(x)[0]
        name = dense.projection_kernel(x, w)
        if name is None:
            return F.linear(x, w, b)
        return self._either(name, lambda: getattr(dense, name)(x, w, b), lambda: F.linear(x, w, b))

    def gate_up_silu(self, x, gate_up):
        if isinstance(gate_up, QuantWeight):
            return super().gate_up_silu(x, gate_up)
        x = unwrap(x)[0]
        name = dense.projection_kernel(x, gate_up)
        slow = lambda: self.silu_mul(F.linear(x, gate_up))  # noqa: E731
        if name is None:
            return slow()
        return self._either(name, lambda: getattr(dense, name)(x, gate_up, glu=True), slow)

    def experts(self, h, gate_up, down, weights, experts, reduce=None, repeats=False):
        slow = lambda: super(TritonKernels, self).experts(h, gate_up, down, weights, experts, reduce=reduce)  # noqa: E731
        if isinstance(gate_up, QuantExperts) or not dense.experts_fit(gate_up, down, experts):
            return slow()
        grouped = False if repeats else None  # the grouped kernel serves an expert at most once a row
        args = (unwrap(h)[0], gate_up, down, weights, experts)
        return self._either("experts", lambda: dense.experts(*args, reduce=reduce, grouped=grouped,
                                                             sum_slots=self.sum_slots,
                                                             down_sums=self.options.expert_down_sums), slow)

    def route(self, h, router, top_k, renormalize):
        slow = lambda: ops.route(h, router, top_k, renormalize)  # noqa: E731
        if isinstance(router, QuantWeight):
            return slow()
        return self._either("route", lambda: dense.route_topk(self.linear(h, router), top_k, renormalize), slow)

    def delta_rule(self, q, k, v, g, beta, state, rows=None, tiled=False):
        slow = lambda: ops.gated_delta_rule(q, k, v, g, beta, state, rows, tiled)  # noqa: E731
        if not fla.available(q.device):
            return slow()
        return self._either("delta_rule", lambda: fla.gated_delta_rule(q, k, v, g, beta, state, rows, tiled=tiled),
                            slow)

    def gated_delta_net(self, layer, proj, first, state):
        slow = lambda: layer.mix(proj, first, state, self)  # noqa: E731
        if not (available(proj.device) and delta.fits(layer, proj, state)):
            return slow()
        return self._either("gated_delta_net",
                            lambda: delta.gated_delta_net(layer, proj, first, state, self.gated_rms_norm), slow)

    def attend(self, q, k, v, mask, into=None):
        slow = lambda: super(TritonKernels, self).attend(q, k, v, mask)  # noqa: E731
        if self.attention == "grouped" and q.dim() == 3 and attn.attention_fits(q, k, v, mask):
            rows = self.options.attention_quantize_rows if self._int8_into(into, q.shape[0]) else 0

            def fast():
                out, x8 = attn.attention(q, k, v, mask, rows, self.options.pre_wait_loads)
                return out if x8 is None else Activation(out, x8)

            return self._either("attention", fast, slow)
        return slow()

    def rms_norm(self, x, weight, eps, into=None):
        return self._norm(x, None, weight, eps, into, lambda: self.groups["rms_norm"](x, weight, eps))

    def add_rms_norm(self, x, residual, weight, eps, into=None):
        return self._norm(x, residual, weight, eps, into,
                          lambda: self.groups["add_rms_norm"](x, residual, weight, eps))

    def _norm(self, x, residual, weight, eps, into, slow):
        """rms_norm and add_rms_norm (residual given) on the Triton kernel where it fits, else slow()."""
        if not norms.norm_fits(x, residual, weight, self.options.norm_max_rows):
            return slow()
        quantize = self._int8_into(into, x.numel() // x.shape[-1])

        def fast():
            out, x8, total = norms.rms_norm(x, weight, eps, residual, quantize, self.options)
            out = out if x8 is None else Activation(out, x8)
            return out if residual is None else (total, out)

        return self._either("rms_norm", fast, slow)

    def _int8_into(self, into, rows: int) -> bool:
        """Whether a kernel quantizes its `rows` rows of output for `into` (a quantized matrix taking int8 x)."""
        return rows <= self.options.quantize_rows and isinstance(into, (QuantWeight, QuantExperts)) and \
            into.takes_int8(rows, self.options)

    def norm_rotate_store(self, qk, v, q_weight, k_weight, cos, sin, eps, heads, k_cache, v_cache, cells):
        args = (qk, v, q_weight, k_weight, cos, sin, eps, heads, k_cache, v_cache, cells)
        slow = lambda: self.groups["norm_rotate_store"](*args)  # noqa: E731
        if q_weight is not None and norms.norm_rotate_store_fits(qk, v, k_cache, v_cache):
            return self._either("norm_rotate_store",
                                lambda: norms.norm_rotate_store(*args, prewait=self.options.pre_wait_loads), slow)
        return slow()


def _compiled_or_eager(fn):
    """fn through torch.compile; where compiling fails (no Triton, no compiler) it warns once and runs
    eagerly. The first call happens outside any CUDA-graph capture (the runner warms up first)."""
    state = {"fn": torch.compile(fn, dynamic=False, fullgraph=True)}

    def call(*args):
        try:
            return state["fn"](*args)
        except Exception as e:  # noqa: BLE001 - any compiler failure leaves the eager path
            if state["fn"] is fn:
                raise
            warnings.warn(f"torch.compile of {fn.__name__} failed ({type(e).__name__}: {e}); running it eagerly")
            state["fn"] = fn
            return fn(*args)

    call.__name__ = fn.__name__
    return call


EAGER = Kernels()
_SHARED: dict[tuple, Kernels] = {}


def select_kernels(device, backend: str, attention: str, options: KernelOptions = KernelOptions()) -> Kernels:
    """The kernel set of an engine's steps for its backend (engine/config.py's BACKENDS). Fused kernels only
    pay inside CUDA graphs; each compiled set is built once per process and shared (torch.compile caches per
    function)."""
    if backend == "eager":
        return EAGER if options == KernelOptions() else Kernels(options=options)
    on_gpu = torch.device(device).type == "cuda"
    if not (on_gpu and backend in ("graphs+compile", "graphs+triton")):
        return Kernels(attention=attention, static=True, options=options)
    use_triton = backend == "graphs+triton" and available(device)
    key = (use_triton, attention, options)
    if key not in _SHARED:
        if use_triton:
            pdl.compiled(device)
        _SHARED[key] = TritonKernels(attention=attention, options=options) if use_triton else \
            Kernels(compiled=True, attention=attention, static=True, options=options)
    return _SHARED[key]
