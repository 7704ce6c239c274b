"""Building blocks shared by the target decoder and the DFlash drafter.

Everything works on one sequence at a time: activations are [tokens, features].
"""

from __future__ import annotations

import warnings

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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise in float32, cast back, then scale (the Hugging Face order of rounding)."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """The residual add and the next norm: one fused group of elementwise work."""
    x = x + residual
    return x, rms_norm(x, weight, eps)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX (rotate-half) RoPE with the cos/sin rows of x's positions."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def norm_rotate(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float):
    """Per-head q/k norm, then RoPE: q and k heads together when their projections are fused."""
    return rotate(rms_norm(x, weight, eps), cos, sin)


def norm_rotate_store(qk: torch.Tensor, v: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      eps: float, heads: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      positions: torch.Tensor) -> torch.Tensor:
    """norm_rotate of a fused q/k, with the new keys and values scattered straight into the cache rows
    of `positions`: compiled, the step's cache writes ride in the same kernel group. Returns q."""
    q, k = norm_rotate(qk, weight, cos, sin, eps).split([heads, qk.shape[-2] - heads], dim=-2)
    k_cache.index_copy_(0, positions, k)
    v_cache.index_copy_(0, positions, v)
    return q


def norm_rotate_store_kv(k: torch.Tensor, v: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor, eps: float, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         positions: torch.Tensor) -> None:
    """The key side alone (a drafter's context K/V): k norm, RoPE and both cache writes in one group."""
    k_cache.index_copy_(0, positions, norm_rotate(k, weight, cos, sin, eps))
    v_cache.index_copy_(0, positions, v)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


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

    def at(self, positions: torch.Tensor) -> "Rope":
        """The rows of `positions` ([T] or [..., T] int64), gathered once for every layer of a pass."""
        return Rope(self.cos[positions].unsqueeze(-2), self.sin[positions].unsqueeze(-2))


class Rope:
    """cos/sin of one pass's positions, broadcast over heads: [..., T, 1, head_dim]."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor):
        self.cos, self.sin = cos, sin

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., T, heads, head_dim]."""
        return rotate(x, self.cos, self.sin)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, kernels=None) -> torch.Tensor:
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


def masked_softmax(scores: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """scores [Hkv, T, G, S] (the matmul's dtype) -> probabilities in that dtype, softmax in float32."""
    t, s = mask.shape
    x = scores.float().mul(scale).masked_fill(~mask.view(1, t, 1, s), float("-inf"))
    return torch.softmax(x, dim=-1).to(scores.dtype)


def attend_grouped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, kernels=None) -> torch.Tensor:
    """The same attention for one sequence as two batched matmuls per K/V head: the query heads of a
    group become extra rows, so no K/V is copied and no general kernel is chosen for a few queries
    over a long cache. q: [T, H, D]; k, v: [S, Hkv, D]; mask: [T, S] bool. Returns [T, H*D]."""
    t, h, d = q.shape
    s, hk, _ = k.shape
    g = h // hk
    qg = q.reshape(t, hk, g, d).permute(1, 0, 2, 3).reshape(hk, t * g, d)
    scores = torch.bmm(qg, k.permute(1, 2, 0)).view(hk, t, g, s)
    probs = (kernels or EAGER).masked_softmax(scores, mask, d ** -0.5).view(hk, t * g, s)
    out = torch.bmm(probs, v.permute(1, 0, 2))  # [Hkv, T*G, D]
    return out.view(hk, t, g, d).permute(1, 0, 2, 3).reshape(t, h * d)


class Kernels:
    """The projections and elementwise groups of a layer step. `Kernels(compiled=True)` (see
    compiled_kernels) turns each elementwise group into one fused kernel with torch.compile, for the
    CUDA-graph path (the decode step is otherwise hundreds of tiny kernels); TritonKernels replaces
    the few-row projections, attention and the q/k group with kernels of its own. The plain functions
    above stay the reference and the CPU path."""

    rms_norm = staticmethod(rms_norm)
    add_rms_norm = staticmethod(add_rms_norm)
    norm_rotate = staticmethod(norm_rotate)
    norm_rotate_store = staticmethod(norm_rotate_store)
    norm_rotate_store_kv = staticmethod(norm_rotate_store_kv)
    silu_mul = staticmethod(silu_mul)
    masked_softmax = staticmethod(masked_softmax)
    linear = staticmethod(F.linear)

    def __init__(self, compiled: bool = False):
        if compiled:
            for name in ("rms_norm", "add_rms_norm", "norm_rotate", "norm_rotate_store", "norm_rotate_store_kv",
                         "silu_mul", "masked_softmax"):
                if getattr(type(self), name) is getattr(Kernels, name):  # a subclass's own kernel stays
                    setattr(self, name, _compiled_or_eager(getattr(Kernels, name)))

    def gate_up_silu(self, x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of a stacked gate/up matrix ([2I, K])."""
        return self.silu_mul(self.linear(x, gate_up))

    def attend_grouped(self, q, k, v, mask):
        return attend_grouped(q, k, v, mask, self)


class TritonKernels(Kernels):
    """The compiled set, with Strata's Triton kernels (models/triton_kernels.py) where their shapes
    allow: projections of up to 16 rows (the 1-token decode, a verify window, a drafter block),
    attention and the fused q/k norm + RoPE + cache write. Larger shapes keep cuBLAS. A kernel that
    fails to build or launch (an older GPU, a Triton that rejects it) warns once and leaves its torch
    path. compiled=False leaves the other groups eager (the tests' interpreter runs)."""

    def __init__(self, compiled: bool = True):
        super().__init__(compiled=compiled)
        from . import triton_kernels

        self._tk = triton_kernels
        self._failed: set[str] = set()

    def _either(self, name: str, fast, slow):
        """fast() unless the kernel `name` already failed here; slow() after a failure. The first call of
        each step happens outside CUDA-graph capture (StepGraphs warms up first), so a failure shows there."""
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
        name = self._tk.projection_kernel(x, w)
        if name is None:
            return F.linear(x, w, b)
        return self._either(name, lambda: getattr(self._tk, name)(x, w, b), lambda: F.linear(x, w, b))

    def gate_up_silu(self, x, gate_up):
        name = self._tk.projection_kernel(x, gate_up)
        slow = lambda: super(TritonKernels, self).gate_up_silu(x, gate_up)
        if name is None:
            return slow()
        return self._either(name, lambda: getattr(self._tk, name)(x, gate_up, glu=True), slow)

    def attend_grouped(self, q, k, v, mask):
        slow = lambda: super(TritonKernels, self).attend_grouped(q, k, v, mask)
        if self._tk.attention_fits(q, k, v, mask):
            return self._either("attention", lambda: self._tk.attention(q, k, v, mask), slow)
        return slow()

    def norm_rotate_store(self, qk, v, weight, cos, sin, eps, heads, k_cache, v_cache, positions):
        args = (qk, v, weight, cos, sin, eps, heads, k_cache, v_cache, positions)
        slow = lambda: super(TritonKernels, self).norm_rotate_store(*args)
        if self._tk.norm_rotate_store_fits(qk, v, k_cache, v_cache):
            return self._either("norm_rotate_store", lambda: self._tk.norm_rotate_store(*args), slow)
        return slow()


def _compiled_or_eager(fn):
    """fn through torch.compile; where compiling fails (no Triton, no compiler) it warns once and runs
    eagerly. The first call happens outside any CUDA-graph capture (StepGraphs warms up first)."""
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

    return call


EAGER = Kernels()
_SHARED: dict[str, Kernels] = {}


def compiled_kernels(triton: bool = False) -> Kernels:
    """The one compiled set (with Strata's Triton kernels or without), shared by every engine of the process."""
    key = "triton" if triton else "compiled"
    if key not in _SHARED:
        _SHARED[key] = TritonKernels() if triton else Kernels(compiled=True)
    return _SHARED[key]


def _attend_grouped(q, k, v, mask, kernels=None):
    return (kernels or EAGER).attend_grouped(q, k, v, mask)


ATTENTION = {"sdpa": attend, "grouped": _attend_grouped}


class CacheSlot:
    """keys_fn of a static step: one layer of a preallocated cache, the window's positions (a device
    tensor) and the cells its queries read. Called with the new K/V it stores them and returns the
    readable cells; a fused layer stores them itself (norm_rotate_store) and only reads."""

    def __init__(self, cache, layer: int, positions: torch.Tensor, kv_len: int):
        self.cache, self.layer, self.positions, self.kv_len = cache, layer, positions, kv_len
        self.k, self.v = cache.k[layer], cache.v[layer]

    def __call__(self, k_new: torch.Tensor, v_new: torch.Tensor):
        self.cache.scatter(self.layer, self.positions, k_new, v_new)
        return self.read()

    def read(self):
        return self.k[: self.kv_len], self.v[: self.kv_len]


def stack_rows(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One matrix (and bias) holding the linears' weights as row blocks; each linear's parameters
    become views into it, so one GEMV streams them all and state dicts keep their names."""
    w = torch.cat([m.weight.detach() for m in linears])
    b = torch.cat([m.bias.detach() for m in linears]) if linears[0].bias is not None else None
    offset = 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight = nn.Parameter(w[offset:offset + n], requires_grad=False)
        if b is not None:
            m.bias = nn.Parameter(b[offset:offset + n], requires_grad=False)
        offset += n
    return w, b


class Attention(nn.Module):
    """Projections of one attention layer; the caller decides which keys a query sees."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, eps: float, bias: bool, qk_norm: bool):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.eps = heads, kv_heads, head_dim, eps
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=bias)
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, eps)
            self.k_norm = RMSNorm(head_dim, eps)
        else:
            self.q_norm = self.k_norm = None
        self.fused = None

    def fuse_(self) -> None:
        """Inference: q/k/v projections become row blocks of one matrix (one GEMV streams them all) and
        the q/k norm weights one [heads + kv_heads, head_dim] table. The parameters stay, as views."""
        w, b = stack_rows([self.q_proj, self.k_proj, self.v_proj])
        q = self.heads * self.head_dim
        norm = None
        if self.q_norm is not None:
            norm = torch.cat([self.q_norm.weight.detach().expand(self.heads, -1),
                              self.k_norm.weight.detach().expand(self.kv_heads, -1)])
        self.fused = {"w": w, "b": b, "kv_w": w[q:], "kv_b": None if b is None else b[q:], "qk_norm": norm}

    def qkv(self, x: torch.Tensor, rope: Rope, trace=None, kernels: Kernels = EAGER):
        """Roped q [.., T, H, D], roped k and v [.., T, Hkv, D]."""
        h, hk, d = self.heads, self.kv_heads, self.head_dim
        lead = x.shape[:-1]
        if self.fused is not None and not trace:
            qk, v = self._fused_qk_v(x, kernels)
            if self.q_norm is not None:
                qk = kernels.norm_rotate(qk, self.fused["qk_norm"], rope.cos, rope.sin, self.eps)
            else:
                qk = rope.apply(qk)
            q, k = qk.split([h, hk], dim=-2)
            return q, k, v
        q = self.q_proj(x).view(*lead, h, d)
        if trace:
            q = trace("q_raw", q)
        if self.q_norm is not None:
            q = self.q_norm(q)
            if trace:
                q = trace("q_normed", q)
        q = rope.apply(q)
        if trace:
            q = trace("q_roped", q)
        k, v = self.key_value(x, rope, trace)
        return q, k, v

    def _fused_qk_v(self, x: torch.Tensor, kernels: Kernels = EAGER) -> tuple[torch.Tensor, torch.Tensor]:
        """One GEMV over the fused q/k/v rows: q and k heads together [.., T, H + Hkv, D], v [.., T, Hkv, D]."""
        hk, d = self.kv_heads, self.head_dim
        out = kernels.linear(x, self.fused["w"], self.fused["b"])
        qk_width = (self.heads + hk) * d
        return out[..., :qk_width].view(*x.shape[:-1], -1, d), out[..., qk_width:].view(*x.shape[:-1], hk, d)

    def q_storing(self, x: torch.Tensor, rope: Rope, slot: CacheSlot, kernels: Kernels = EAGER) -> torch.Tensor:
        """Fused layers with q/k norm: roped q [T, H, D], the window's K/V written into the slot."""
        qk, v = self._fused_qk_v(x, kernels)
        return kernels.norm_rotate_store(qk, v, self.fused["qk_norm"], rope.cos, rope.sin, self.eps, self.heads,
                                         slot.k, slot.v, slot.positions)

    def key_value(self, x: torch.Tensor, rope: Rope, trace=None):
        k, v = self._raw_key_value(x, trace)
        if self.k_norm is not None:
            k = self.k_norm(k)
        k = rope.apply(k)
        if trace:
            k, v = trace("k", k), trace("v", v)
        return k, v

    def _raw_key_value(self, x: torch.Tensor, trace=None, kernels: Kernels = EAGER) -> tuple[torch.Tensor, torch.Tensor]:
        lead = x.shape[:-1]
        if self.fused is not None and not trace:
            return kernels.linear(x, self.fused["kv_w"], self.fused["kv_b"]).view(*lead, 2, self.kv_heads,
                                                                                 self.head_dim).unbind(-3)
        return (self.k_proj(x).view(*lead, self.kv_heads, self.head_dim),
                self.v_proj(x).view(*lead, self.kv_heads, self.head_dim))

    def store_key_value(self, x: torch.Tensor, rope: Rope, slot: CacheSlot, kernels: Kernels = EAGER) -> None:
        """K/V of x written into the slot's positions (no queries): a drafter's context features."""
        if self.k_norm is None:
            slot(*self.key_value(x, rope))
            return
        k, v = self._raw_key_value(x, kernels=kernels)
        kernels.norm_rotate_store_kv(k, v, self.k_norm.weight, rope.cos, rope.sin, self.eps, slot.k, slot.v,
                                     slot.positions)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.gate_up = None

    def fuse_(self) -> None:
        """Inference: gate and up projections as row blocks of one matrix (parameters stay, as views)."""
        self.gate_up, _ = stack_rows([self.gate_proj, self.up_proj])

    def forward(self, x: torch.Tensor, kernels: Kernels = EAGER) -> torch.Tensor:
        if self.gate_up is not None:
            return kernels.linear(kernels.gate_up_silu(x, self.gate_up), self.down_proj.weight)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm transformer layer (Qwen3/Llama layout, also the DFlash drafter's)."""

    def __init__(self, hidden, intermediate, heads, kv_heads, head_dim, eps, bias=False, qk_norm=True):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = Attention(hidden, heads, kv_heads, head_dim, eps, bias, qk_norm)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = MLP(hidden, intermediate)

    def fuse_(self) -> None:
        self.self_attn.fuse_()
        self.mlp.fuse_()

    def forward(self, x, rope: Rope, keys_fn, mask, trace=None, attention=attend, kernels: Kernels = EAGER,
                pending: torch.Tensor | None = None, defer: bool = False):
        """keys_fn(k_new, v_new) -> (k_all, v_all) lets the caller splice in cached keys.

        trace(stage, tensor) -> tensor, when given, sees (and may replace) every intermediate: the
        parity tool records them and its self-test plants bugs through it. With defer the layer returns
        (x, mlp_out) unsummed and the next layer takes mlp_out as `pending`, adding it inside its
        input norm's kernel group."""
        norm = self.input_layernorm
        if pending is None:
            h = kernels.rms_norm(x, norm.weight, norm.eps)
        else:
            x, h = kernels.add_rms_norm(x, pending, norm.weight, norm.eps)
        if trace:
            h = trace("attn_in", h)
        attn = self.self_attn
        if isinstance(keys_fn, CacheSlot) and attn.fused is not None and attn.q_norm is not None and not trace:
            q = attn.q_storing(h, rope, keys_fn, kernels)
            k_all, v_all = keys_fn.read()
        else:
            q, k, v = attn.qkv(h, rope, trace, kernels)
            k_all, v_all = keys_fn(k, v)
        a = attention(q, k_all, v_all, mask, kernels)
        if trace:
            a = trace("attn", a)
        norm = self.post_attention_layernorm
        if trace:
            x = trace("o_residual", x + self.self_attn.o_proj(a))
            h = norm(x)
        else:
            o = self.self_attn.o_proj
            x, h = kernels.add_rms_norm(x, kernels.linear(a, o.weight, o.bias), norm.weight, norm.eps)
        m = self.mlp(h, kernels)
        if trace:
            m = trace("mlp", m)
        return (x, m) if defer else x + m
