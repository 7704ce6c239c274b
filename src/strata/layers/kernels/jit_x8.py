"""Activations quantized to int8 per 32 values (x ~ d * q) for the int8-x products: a launch of its own
(quantize_x_kernel), or the tail of a norm or attention kernel (quantize_blocks)."""

from __future__ import annotations

import triton
import triton.language as tl

from .jit_common import settle


@triton.jit
def quantize_blocks(x, row, kb, ok, KB, MP, q_ptr, d_ptr, s_ptr, SUMS: tl.constexpr):
    """Blocks x [B, 32] (float32), block kb [B] of row `row` [B], quantized and stored (where ok [B]) in
    quantize_x_kernel's layouts; also the tail of a norm whose rows go into an int8-x product."""
    B: tl.constexpr = x.shape[0]
    j = tl.arange(0, 32)[None, :]
    amax = tl.max(tl.abs(x), axis=1)
    inv = tl.where(amax > 0, 127.0 / amax, 0.0)
    q = (x * inv[:, None] + 12582912.0) - 12582912.0
    d = amax / 127.0
    tl.store(q_ptr + (row * KB + kb)[:, None] * 32 + j, q.to(tl.int8), mask=ok[:, None])
    if SUMS == 32:  # the few-row GEMMs': d and the sum side by side, one 8-byte load
        tl.store(d_ptr + 2 * (kb * MP + row), d, mask=ok)
        tl.store(d_ptr + 2 * (kb * MP + row) + 1, tl.sum(q, axis=1) * d, mask=ok)
    else:
        tl.store(d_ptr + kb * MP + row, d, mask=ok)
        sums = tl.sum(tl.reshape(q, (B, 2, 16)), axis=2) * d[:, None]
        tl.store(s_ptr + (2 * kb[:, None] + tl.arange(0, 2)[None, :]) * MP + row[:, None], sums,
                 mask=ok[:, None])
    # after the MP rows of q, q again in Q8_0's row layout (gemv_q8_0c_kernel's and skinny_q8_0w_kernel's
    # x): each block's 32 values 2 bytes into its 34, zeros where a Q8_0 row holds the block's d
    xr = q_ptr + MP * KB * 32 + (row * KB + kb)[:, None] * 34
    tl.store(xr + 2 + j, q.to(tl.int8), mask=ok[:, None])
    tl.store(xr + tl.arange(0, 2)[None, :], tl.zeros([B, 2], dtype=tl.int8), mask=ok[:, None])


@triton.jit
def quantize_x_kernel(x_ptr, q_ptr, d_ptr, s_ptr, M, KB, MP, NB, BLOCK: tl.constexpr, SUMS: tl.constexpr,
                      PDL: tl.constexpr = False):
    """x [M, KB * 32] -> int8 q [MP, KB * 32] with x ~ d * q per 32 values (d = max |x| / 127, q rounded
    to nearest even), and d with the sums of d * q: the integer products' x, which compute with d * q in
    place of x exactly but for float32 rounding; after q's MP rows, q again in Q8_0's row layout
    (quantize_blocks). SUMS 16 (the GEMVs'): d [KB, MP], the sums per 16 in s [2 KB, MP]; SUMS 32 (the
    few-row GEMMs'): d and the sum per 32 side by side in d [KB, MP, 2], one 8-byte load (s unused). Rows M ..
    MP (the few-row GEMMs' padding) are zeros; the scales are stored K-major, so that a program reads its
    rows' at one K together."""
    settle(PDL)
    b = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = b < NB
    row = b // KB
    x = tl.load(x_ptr + b[:, None] * 32 + tl.arange(0, 32)[None, :], mask=(ok & (row < M))[:, None],
                other=0.0).to(tl.float32)
    quantize_blocks(x, row, b % KB, ok, KB, MP, q_ptr, d_ptr, s_ptr, SUMS)
