"""Grouped-query attention of a few query rows over a cache in two launches: per K/V head and chunk of cells
an online-softmax partial, then per query row their combination, any visibility mask (attention in
inductor is two batched matmuls around a softmax)."""

from __future__ import annotations

import torch

from . import pdl
from .common import cdiv, pow2, precision
from .tuning import ATTENTION_TARGET_SPLITS, attention_tiles
from .x8 import x8_buffers, x8_result


def attention_fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> bool:
    """attention's layout: a power-of-two head dim, plain cache rows shared by k and v, contiguous mask
    rows, and a query group within a program's rows."""
    _, h, d = q.shape
    return (d >= 16 and d & (d - 1) == 0 and k.stride(-1) == 1 and k.stride(-2) == d and v.stride() == k.stride()
            and h // k.shape[-2] <= attention_tiles(d)[0] and mask.stride(-1) == 1)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, quantize_rows: int = 0,
              prewait: bool = True) -> tuple[torch.Tensor, tuple | None]:
    """ops.attend_grouped's contract: q [T, H, D]; k, v [S, Hkv, D] (rows of a cache layer); mask [T, S]
    bool (True = visible). Returns ([T, H*D], its quantize_x or None). Every query must see at least one
    cell. More query rows than a program holds (a tree's verify) are split over programs too, in the same
    launch. quantize_rows: up to this many rows (and 32 | D) the output is also quantized for the int8-x
    product that reads it next. prewait: KernelOptions.pre_wait_loads."""
    from .jit_attention import attention_combine_kernel, attention_partial_kernel

    t, h, d = q.shape
    s, hk, _ = k.shape
    g = h // hk
    max_rows, block = attention_tiles(d)
    rows = min(max_rows, max(16, pow2(t * g)))
    row_blocks = cdiv(t * g, rows)
    blocks = cdiv(s, block)
    # the programs' count, and their float32 partials, stay near a decode's when row blocks multiply them
    chunk = block * cdiv(blocks, max(1, ATTENTION_TARGET_SPLITS // row_blocks))
    splits = cdiv(s, chunk)
    o = torch.empty(hk, splits, row_blocks * rows, d, device=q.device, dtype=torch.float32)
    m = torch.empty(hk, splits, row_blocks * rows, device=q.device, dtype=torch.float32)
    l = torch.empty_like(m)
    q = q.contiguous()
    attention_partial_kernel[(hk, splits, row_blocks)](
        q, k, v, mask, o, m, l, s, k.stride(0), mask.stride(0), chunk, d ** -0.5, T=t, G=g, HK=hk, D=d, R=rows,
        RT=row_blocks * rows, BLOCK_S=block, PRECISION=precision(q), PREWAIT=prewait, num_warps=4,
        **pdl.options(q.device))
    out = torch.empty(t, h * d, device=q.device, dtype=q.dtype)
    quantize = t <= quantize_rows and d % 32 == 0
    buffers, mp, sums = x8_buffers(t, h * d, q.device) if quantize else ((out, out, out), t, 16)
    attention_combine_kernel[(hk, mp * g)](o, m, l, out, *buffers, splits, t, mp, G=g, HK=hk, D=d,
                                           RT=row_blocks * rows, SPLITS=max(2, pow2(splits)), QUANT=quantize,
                                           SUMS=sums, num_warps=2, **pdl.options(q.device))
    return out, x8_result(buffers) if quantize else None
