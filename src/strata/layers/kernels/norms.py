"""RMSNorm (after a residual add) of a few rows in one launch, each row held in registers (inductor's group
for the 8B and 30B rows is a looped reduction that reads the row twice), quantizing its output for the
int8-x product after it where asked; and the per-head q/k RMSNorm with NeoX RoPE, q written out and k, v
stored in the cache, in one launch (inductor makes it three)."""

from __future__ import annotations

import torch

from . import pdl
from .common import pow2
from .options import KernelOptions
from .tuning import NORM_MAX_DIM
from .x8 import x8_buffers, x8_result


def norm_fits(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, max_rows: int) -> bool:
    """rms_norm's shapes: up to max_rows rows (KernelOptions.norm_max_rows) of at most NORM_MAX_DIM, a
    residual of x's shape and type."""
    h = x.shape[-1]
    return (0 < x.numel() // max(h, 1) <= max_rows and h <= NORM_MAX_DIM and weight.shape == (h,)
            and (residual is None or (residual.shape == x.shape and residual.dtype == x.dtype)))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             quantize: bool = False, options: KernelOptions = KernelOptions()):
    """ops.rms_norm (residual None) or ops.add_rms_norm (x + residual first) in one launch, norm_chunk columns
    of a row a program. Returns (normed, its quantize_x or None, x + residual or None). quantize: the normed
    rows also quantized for the int8-x product that reads them next (one launch fewer)."""
    from .jit_norm import rms_norm_kernel

    h = x.shape[-1]
    flat, r = (t.reshape(-1, h) if t.stride(-1) == 1 else t.reshape(-1, h).contiguous()
               for t in (x, x if residual is None else residual))
    rows = flat.shape[0]
    out = torch.empty(x.shape, device=x.device, dtype=torch.promote_types(x.dtype, weight.dtype))
    total = torch.empty(x.shape, device=x.device, dtype=x.dtype) if residual is not None else out
    buffers, programs, sums = x8_buffers(rows, h, x.device) if quantize else ((out, out, out), rows, 16)
    block = pow2(h)
    chunk = min(block, max(32, options.norm_chunk)) if options.norm_chunk else block
    rms_norm_kernel[(programs, block // chunk)](
        flat, r, weight, total.view(-1, h), out.view(-1, h), *buffers, rows, h, h // 32, programs, eps,
        flat.stride(0), r.stride(0), h, h, ADD=residual is not None, QUANT=quantize, SUMS=sums, BLOCK=block,
        CHUNK=chunk, PREWAIT=options.pre_wait_loads, num_warps=max(1, min(8, block // 512)), **pdl.options(x.device))
    return out, x8_result(buffers) if quantize else None, total if residual is not None else None


def norm_rotate_store_fits(qk: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """norm_rotate_store's layout: heads contiguous within a row, a power-of-two head dim, caches alike."""
    d = qk.shape[-1]
    return (qk.stride(-1) == 1 and qk.stride(-2) == d and v.stride(-1) == 1 and v.stride(-2) == d
            and d & (d - 1) == 0 and k_cache.stride() == v_cache.stride())


def norm_rotate_store(qk: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                      cos: torch.Tensor, sin: torch.Tensor, eps: float, heads: int, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, cells: torch.Tensor, prewait: bool = True) -> torch.Tensor:
    """ops.norm_rotate_store in one launch: qk [T, H + Hkv, D], v [T, Hkv, D], q_weight/k_weight [D],
    cos/sin [T, 1, D]; k_cache/v_cache [cells, Hkv, D]. qk and v may be row slices of one projection
    output (heads contiguous within a row). Returns q [T, H, D]. prewait: KernelOptions.pre_wait_loads."""
    from .jit_norm import norm_rotate_store_kernel

    t, heads_total, d = qk.shape
    assert norm_rotate_store_fits(qk, v, k_cache, v_cache)
    q = torch.empty(t, heads, d, device=qk.device, dtype=qk.dtype)
    norm_rotate_store_kernel[(t, heads_total)](
        qk, v, q_weight.contiguous(), k_weight.contiguous(), cos.contiguous(), sin.contiguous(), cells, q, k_cache,
        v_cache, eps, qk.stride(0), v.stride(0), k_cache.stride(0), H=heads, HK=heads_total - heads, HALF=d // 2,
        PREWAIT=prewait, num_warps=1, **pdl.options(qk.device))
    return q
