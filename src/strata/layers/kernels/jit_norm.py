"""RMSNorm (after a residual add) of a few rows, quantizing its output for an int8-x product where asked;
per-head q/k RMSNorm and NeoX RoPE with q written out and k, v stored in the cache."""

from __future__ import annotations

import triton
import triton.language as tl

from .jit_common import settle
from .jit_x8 import quantize_blocks


@triton.jit
def _norm_columns(x_ptr, r_ptr, row, M, H, stride_x, stride_r, start, WIDTH: tl.constexpr, ADD: tl.constexpr):
    """Columns start .. start + WIDTH of a norm's row (ADD: of x + r, rounded to x's type): their indices,
    mask (past H, or the row past M) and values."""
    c = start + tl.arange(0, WIDTH)
    m = (c < H) & (c * 0 + row < M)
    x = tl.load(x_ptr + row * stride_x + c, mask=m, other=0.0)
    if ADD:
        x = (x.to(tl.float32) + tl.load(r_ptr + row * stride_r + c, mask=m, other=0.0).to(tl.float32)).to(x.dtype)
    return c, m, x


@triton.jit
def rms_norm_kernel(x_ptr, r_ptr, w_ptr, sum_ptr, h_ptr, q_ptr, d_ptr, s_ptr, M, H, KB, MP, eps, stride_x,
                    stride_r, stride_s, stride_h, ADD: tl.constexpr, QUANT: tl.constexpr, SUMS: tl.constexpr,
                    BLOCK: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr = False,
                    PREWAIT: tl.constexpr = False):
    """One row's RMSNorm (ADD: of x + r, the sum written out too) in registers, rounding as ops.rms_norm:
    normalised in float32, cast to x's type, then scaled by the weight. QUANT: the normed row also
    quantized as quantize_x would (quant_kernels.quantize_blocks), the programs past the M rows writing
    the zero rows of its padding (MP rows). A row's CHUNK columns a program
    (program_id(1)): each reads the whole row for its sum of squares, then its own columns again (from
    cache) to write and quantize, so that a row's work is spread over several multiprocessors. PREWAIT: its
    weights read before the wait for the kernel ahead (pre_wait_loads)."""
    mine = (tl.program_id(1) * CHUNK if CHUNK < BLOCK else 0) + tl.arange(0, CHUNK if CHUNK < BLOCK else BLOCK)
    if PREWAIT:
        w = tl.load(w_ptr + mine, mask=mine < H, other=0.0).to(tl.float32)
    settle(PDL)
    row = tl.program_id(0).to(tl.int64)
    c, m, x = _norm_columns(x_ptr, r_ptr, row, M, H, stride_x, stride_r, 0, BLOCK, ADD)
    x32 = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(x32 * x32, axis=0) / H + eps)
    if CHUNK < BLOCK:
        c, m, x = _norm_columns(x_ptr, r_ptr, row, M, H, stride_x, stride_r, tl.program_id(1) * CHUNK, CHUNK, ADD)
        x32 = x.to(tl.float32)
    if ADD:
        tl.store(sum_ptr + row * stride_s + c, x, mask=m)
    n = (x32 * inv).to(x.dtype).to(tl.float32)
    if not PREWAIT:
        w = tl.load(w_ptr + c, mask=c < H, other=0.0).to(tl.float32)
    h = (n * w).to(h_ptr.dtype.element_ty)
    tl.store(h_ptr + row * stride_h + c, h, mask=m)
    if QUANT:
        kb = tl.program_id(1) * (CHUNK // 32) + tl.arange(0, CHUNK // 32)
        quantize_blocks(tl.reshape(h.to(tl.float32), (CHUNK // 32, 32)), kb * 0 + row, kb, kb < KB, KB, MP,
                        q_ptr, d_ptr, s_ptr, SUMS)


@triton.jit
def _rotate_inputs(qw_ptr, kw_ptr, cos_ptr, sin_ptr, t, head, H: tl.constexpr, HALF: tl.constexpr):
    """norm_rotate_store's inputs no kernel of the layer writes: its head's norm weights (q's or k's),
    halves apart, and its row's cos and sin halves, as float32."""
    D: tl.constexpr = 2 * HALF
    i = tl.arange(0, HALF)
    if head < H:
        w1 = tl.load(qw_ptr + i).to(tl.float32)
        w2 = tl.load(qw_ptr + HALF + i).to(tl.float32)
    else:
        w1 = tl.load(kw_ptr + i).to(tl.float32)
        w2 = tl.load(kw_ptr + HALF + i).to(tl.float32)
    return (w1, w2, tl.load(cos_ptr + t * D + i).to(tl.float32), tl.load(cos_ptr + t * D + HALF + i).to(tl.float32),
            tl.load(sin_ptr + t * D + i).to(tl.float32), tl.load(sin_ptr + t * D + HALF + i).to(tl.float32))


@triton.jit
def norm_rotate_store_kernel(qk_ptr, v_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, pos_ptr, q_out_ptr, k_cache_ptr,
                             v_cache_ptr, eps, stride_qk, stride_v, stride_cell, H: tl.constexpr, HK: tl.constexpr,
                             HALF: tl.constexpr, PDL: tl.constexpr = False, PREWAIT: tl.constexpr = False):
    t = tl.program_id(0)
    head = tl.program_id(1)
    if PREWAIT:
        w1, w2, cos1, cos2, sin1, sin2 = _rotate_inputs(qw_ptr, kw_ptr, cos_ptr, sin_ptr, t, head, H, HALF)
    settle(PDL)
    D: tl.constexpr = 2 * HALF
    i = tl.arange(0, HALF)
    src = qk_ptr + t * stride_qk + head * D
    x1 = tl.load(src + i).to(tl.float32)
    x2 = tl.load(src + HALF + i).to(tl.float32)
    ty = qk_ptr.dtype.element_ty
    inv = tl.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / D + eps)
    if not PREWAIT:
        w1, w2, cos1, cos2, sin1, sin2 = _rotate_inputs(qw_ptr, kw_ptr, cos_ptr, sin_ptr, t, head, H, HALF)
    n1 = (x1 * inv).to(ty).to(tl.float32) * w1
    n2 = (x2 * inv).to(ty).to(tl.float32) * w2
    n1 = n1.to(ty).to(tl.float32)
    n2 = n2.to(ty).to(tl.float32)
    r1 = (n1 * cos1 - n2 * sin1).to(ty)
    r2 = (n2 * cos2 + n1 * sin2).to(ty)
    if head < H:
        dst = q_out_ptr + (t * H + head) * D
        tl.store(dst + i, r1)
        tl.store(dst + HALF + i, r2)
    else:
        cell = tl.load(pos_ptr + t).to(tl.int64) * stride_cell + (head - H) * D
        tl.store(k_cache_ptr + cell + i, r1)
        tl.store(k_cache_ptr + cell + HALF + i, r2)
        vsrc = v_ptr + t * stride_v + (head - H) * D
        tl.store(v_cache_ptr + cell + i, tl.load(vsrc + i))
        tl.store(v_cache_ptr + cell + HALF + i, tl.load(vsrc + HALF + i))
