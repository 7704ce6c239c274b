"""The float-tile kernels over GGUF blocks: _halves decodes a [rows, 256] tile in the same float32
operations, in the same order, as gguf's reference (gguf.quants.dequantize), so the dequantization kernel
matches it bit for bit; over it an embedding gather, and the byte GEMV and few-row GEMM on float x."""

from __future__ import annotations

import triton
import triton.language as tl

from .jit_common import IQ3_XXS, IQ4_XS, Q3_K, Q4_0, Q4_K, Q5_K, Q6_K, Q8_0, _silu_mul, settle


@triton.jit
def _half_cols(QTYPE: tl.constexpr):
    """Columns (within a 256-column tile) of the two halves _halves returns, in their order."""
    if QTYPE == Q8_0 or QTYPE == Q3_K or QTYPE == IQ3_XXS:  # Q8_0: blocks 0..3, then 4..7; Q3_K, IQ3_XXS: halves
        c = tl.arange(0, 128)
        lo, hi = c, c + 128
    elif QTYPE == Q4_0 or QTYPE == IQ4_XS:  # Q4_0, IQ4_XS: per 32 weights, low nibbles first (16), high after
        b = tl.arange(0, 8)[:, None]
        t = tl.arange(0, 16)[None, :]
        lo = tl.reshape(b * 32 + t, (128,))
        hi = lo + 16
    elif QTYPE == Q6_K:  # Q6_K: low nibbles are the first and second quarter of each half of the block
        h2 = tl.arange(0, 2)[:, None, None]
        part = tl.arange(0, 2)[None, :, None]
        l = tl.arange(0, 32)[None, None, :]
        lo = tl.reshape(h2 * 128 + part * 32 + l, (128,))
        hi = lo + 64
    else:  # Q4_K, Q5_K: per 64 weights, the 32 low nibbles first
        p = tl.arange(0, 4)[:, None]
        l = tl.arange(0, 32)[None, :]
        lo = tl.reshape(p * 64 + l, (128,))
        hi = lo + 32
    return lo, hi


@triton.jit
def _halves(w_ptr, row_off, k0, tab_ptr, QTYPE: tl.constexpr):
    """float32 values of columns k0..k0+255 of the rows at byte offsets row_off [R, 1], as two [R, 128]
    halves in _half_cols' column order: each byte read once gives a value in each half, and every
    scale is decoded once per group of weights that shares it."""
    R: tl.constexpr = row_off.shape[0]
    u8 = w_ptr
    i8 = w_ptr.to(tl.pointer_type(tl.int8))
    f16 = w_ptr.to(tl.pointer_type(tl.float16))
    u16 = w_ptr.to(tl.pointer_type(tl.uint16))
    ro = row_off[:, :, None]
    if QTYPE == Q8_0:  # Q8_0: d, then 32 int8
        b = tl.arange(0, 4)[None, :, None]
        l = tl.arange(0, 32)[None, None, :]
        base_lo = ro + (k0 // 32 + b) * 34
        base_hi = base_lo + 4 * 34
        lo = tl.load(i8 + base_lo + 2 + l).to(tl.float32) * tl.load(f16 + base_lo // 2).to(tl.float32)
        hi = tl.load(i8 + base_hi + 2 + l).to(tl.float32) * tl.load(f16 + base_hi // 2).to(tl.float32)
    elif QTYPE == Q4_0:  # Q4_0: d, then 16 bytes whose low nibbles are weights 0..15, high ones 16..31
        base = ro + (k0 // 32 + tl.arange(0, 8)[None, :, None]) * 18
        d = tl.load(f16 + base // 2).to(tl.float32)
        byte = tl.load(u8 + base + 2 + tl.arange(0, 16)[None, None, :]).to(tl.int32)
        lo = d * ((byte & 15) - 8).to(tl.float32)
        hi = d * ((byte >> 4) - 8).to(tl.float32)
    elif QTYPE == Q4_K or QTYPE == Q5_K:  # Q4_K / Q5_K: d, dmin, 12 bytes of 6-bit scales and mins, ...
        base = ro + (k0 // 256) * (144 + 32 * (QTYPE - Q4_K))  # Q4_K 144 bytes, Q5_K 176
        p = tl.arange(0, 4)[None, :, None]  # the pair of sub-blocks 2p (low nibbles), 2p+1 (high ones)
        lo_first = p < 2  # sub-blocks 0..3 keep their 6 bits plainly; 4..7 are split over two bytes
        a2 = tl.load(u8 + base + 4 + (2 * p + 1) % 4).to(tl.int32)
        b2 = tl.load(u8 + base + 8 + (2 * p + 1) % 4).to(tl.int32)
        c2 = tl.load(u8 + base + 12 + (2 * p + 1) % 4).to(tl.int32)
        a1 = tl.load(u8 + base + 4 + (2 * p) % 4).to(tl.int32)
        b1 = tl.load(u8 + base + 8 + (2 * p) % 4).to(tl.int32)
        c1 = tl.load(u8 + base + 12 + (2 * p) % 4).to(tl.int32)
        sc_lo = tl.where(lo_first, a1 & 63, (c1 & 15) | ((a1 >> 2) & 48))
        m_lo = tl.where(lo_first, b1 & 63, (c1 >> 4) | ((b1 >> 2) & 48))
        sc_hi = tl.where(lo_first, a2 & 63, (c2 & 15) | ((a2 >> 2) & 48))
        m_hi = tl.where(lo_first, b2 & 63, (c2 >> 4) | ((b2 >> 2) & 48))
        d = tl.load(f16 + base // 2).to(tl.float32)
        dmin = tl.load(f16 + base // 2 + 1).to(tl.float32)
        qs = 16 + 32 * (QTYPE - Q4_K)  # Q5_K: 32 bytes of fifth bits first
        l = tl.arange(0, 32)[None, None, :]
        byte = tl.load(u8 + base + qs + p * 32 + l).to(tl.int32)
        q_lo = byte & 15
        q_hi = byte >> 4
        if QTYPE == Q5_K:
            fifth = tl.load(u8 + base + 16 + l).to(tl.int32)
            q_lo = q_lo | (((fifth >> (2 * p)) & 1) << 4)
            q_hi = q_hi | (((fifth >> (2 * p + 1)) & 1) << 4)
        lo = (d * sc_lo.to(tl.float32)) * q_lo.to(tl.float32) - dmin * m_lo.to(tl.float32)
        hi = (d * sc_hi.to(tl.float32)) * q_hi.to(tl.float32) - dmin * m_hi.to(tl.float32)
    elif QTYPE == Q6_K:  # Q6_K: 128 bytes low 4 bits, 64 bytes high 2 bits, 16 int8 scales, d
        base = ro[:, :, :, None] + (k0 // 256) * 210
        h2 = tl.arange(0, 2)[None, :, None, None]
        part = tl.arange(0, 2)[None, None, :, None]
        l = tl.arange(0, 32)[None, None, None, :]
        low = tl.load(u8 + base + h2 * 64 + part * 32 + l).to(tl.int32)
        high = tl.load(u8 + base + 128 + h2 * 32 + l).to(tl.int32)
        d = tl.load(f16 + (base + 208) // 2).to(tl.float32)
        first = h2 * 8 + part * 2 + l // 16  # the 16-weight group's scale, low-nibble half
        q_lo = ((low & 15) | (((high >> (2 * part)) & 3) << 4)) - 32
        q_hi = ((low >> 4) | (((high >> (2 * part + 4)) & 3) << 4)) - 32
        lo = (d * tl.load(i8 + base + 192 + first).to(tl.float32)) * q_lo.to(tl.float32)
        hi = (d * tl.load(i8 + base + 196 + first).to(tl.float32)) * q_hi.to(tl.float32)
    elif QTYPE == Q3_K:  # Q3_K: 32 bytes of third bits, 64 of low 2 bits, 12 of 6-bit scales, d
        base = ro + (k0 // 256) * 110
        s = tl.arange(0, 4)[None, :, None]  # the shift of a weight's 2 bits in its byte
        l = tl.arange(0, 32)[None, None, :]  # the byte (weights 32 s + l of a half)
        d = tl.load(f16 + (base + 108) // 2).to(tl.float32)
        third = tl.load(u8 + base + l).to(tl.int32)  # bit 4 h + s: weight 128 h + 32 s + l's
        halves = ()
        for h in tl.static_range(2):
            j = 8 * h + 2 * s + l // 16  # the 16-weight group's scale: 4 bits of byte j % 8, 2 of byte 8 + j % 4
            sc = ((tl.load(u8 + base + 96 + j % 8).to(tl.int32) >> (4 * (j // 8))) & 15) | \
                (((tl.load(u8 + base + 104 + j % 4).to(tl.int32) >> (2 * (j // 4))) & 3) << 4)
            two = (tl.load(u8 + base + 32 + 32 * h + l).to(tl.int32) >> (2 * s)) & 3
            q = two - 4 * (1 - ((third >> (4 * h + s)) & 1))  # a set third bit: no offset
            halves += ((d * (sc - 32).to(tl.float32)) * q.to(tl.float32),)
        lo, hi = halves
    elif QTYPE == IQ3_XXS:  # IQ3_XXS: d, 64 grid indices of 4 values, 8 words of a 4-bit scale and 4 x 7 sign bits
        base = ro + (k0 // 256) * 98
        g = tl.arange(0, 4)[None, :, None]  # the group of 32 weights within a half
        w = tl.arange(0, 32)[None, None, :]
        d = tl.load(f16 + base // 2).to(tl.float32)
        halves = ()
        for h in tl.static_range(2):
            at = base + 66 + 4 * (g + 4 * h)  # the group's word, from bytes (98-byte blocks: 2-byte aligned)
            aux = tl.load(u8 + at).to(tl.uint32) | (tl.load(u8 + at + 1).to(tl.uint32) << 8) | \
                (tl.load(u8 + at + 2).to(tl.uint32) << 16) | (tl.load(u8 + at + 3).to(tl.uint32) << 24)
            db = d * (0.5 + (aux >> 28).to(tl.float32)) * 0.5
            signs = tl.load(tab_ptr + 1024 + ((aux >> (7 * (w // 8))) & 127).to(tl.int32)).to(tl.int32)
            index = tl.load(u8 + base + 2 + 8 * (g + 4 * h) + w // 4).to(tl.int32)
            grid = tl.load(tab_ptr + 4 * index + w % 4).to(tl.float32)
            halves += ((db * grid) * tl.where(((signs >> (w % 8)) & 1) == 0, 1.0, -1.0),)
        lo, hi = halves
    else:  # IQ4_XS: d, 16 bits of scale highs, 4 bytes of scale lows, 128 bytes of 4-bit table indices
        base = ro + (k0 // 256) * 136
        j = tl.arange(0, 8)[None, :, None]
        d = tl.load(f16 + base // 2).to(tl.float32)
        sh = (tl.load(u16 + base // 2 + 1).to(tl.int32) >> (2 * j)) & 3
        sl = (tl.load(u8 + base + 4 + j // 2).to(tl.int32) >> (4 * (j % 2))) & 15
        dl = d * ((sl | (sh << 4)) - 32).to(tl.float32)
        byte = tl.load(u8 + base + 8 + 16 * j + tl.arange(0, 16)[None, None, :]).to(tl.int32)
        lo = dl * tl.load(tab_ptr + (byte & 15)).to(tl.float32)
        hi = dl * tl.load(tab_ptr + (byte >> 4)).to(tl.float32)
    return tl.reshape(lo, (R, 128)), tl.reshape(hi, (R, 128))


@triton.jit
def dequant_kernel(w_ptr, tab_ptr, out_ptr, N, K, row_bytes, QTYPE: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rmask = rows[:, None] < N
    row_off = tl.where(rmask, rows[:, None] * row_bytes, 0)
    k0 = tl.program_id(1) * 256
    lo, hi = _halves(w_ptr, row_off, k0, tab_ptr, QTYPE)
    cols_lo, cols_hi = _half_cols(QTYPE)
    tl.store(out_ptr + rows[:, None] * K + k0 + cols_lo[None, :], lo, mask=rmask)
    tl.store(out_ptr + rows[:, None] * K + k0 + cols_hi[None, :], hi, mask=rmask)


@triton.jit
def gather_kernel(tok_ptr, w_ptr, tab_ptr, out_ptr, K, row_bytes, QTYPE: tl.constexpr):
    """One token's embedding row, dequantized and written in out's dtype."""
    t = tl.program_id(0)
    row_off = tl.load(tok_ptr + t).to(tl.int64) * row_bytes + tl.zeros([1, 1], dtype=tl.int64)
    cols_lo, cols_hi = _half_cols(QTYPE)
    for k0 in range(0, K, 256):
        lo, hi = _halves(w_ptr, row_off, k0, tab_ptr, QTYPE)
        tl.store(out_ptr + t * K + k0 + cols_lo[None, :], lo.to(out_ptr.dtype.element_ty))
        tl.store(out_ptr + t * K + k0 + cols_hi[None, :], hi.to(out_ptr.dtype.element_ty))


@triton.jit
def gemv_kernel(x_ptr, w_ptr, tab_ptr, y_ptr, N, K, row_bytes, ids_ptr, expert_bytes, stride_x, stride_y,
                QTYPE: tl.constexpr, GLU: tl.constexpr, BLOCK_N: tl.constexpr, UNROLL: tl.constexpr,
                PDL: tl.constexpr = False, EXPERTS: tl.constexpr = False, SHARE: tl.constexpr = 1):
    """UNROLL 256-column tiles per step, their loads independent of each other: a program keeps that
    many tiles of bytes in flight. A tile past K re-reads the last one (its x is 0) and adds nothing.
    EXPERTS: axis 1 runs a window's (row, expert) assignments, assignment a over expert ids[a]'s
    matrix (expert_bytes apart) with x row a // SHARE, into y row a."""
    settle(PDL)
    if EXPERTS:
        a = tl.program_id(1)
        w_ptr += tl.load(ids_ptr + a).to(tl.int64) * expert_bytes
        x_ptr += (a // SHARE).to(tl.int64) * stride_x
        y_ptr += a.to(tl.int64) * stride_y
    rows = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rmask = rows < N
    row_off = tl.where(rmask, rows * row_bytes, 0)[:, None]
    up_off = tl.where(rmask, (rows + N) * row_bytes, 0)[:, None]
    cols_lo, cols_hi = _half_cols(QTYPE)
    acc = tl.zeros([BLOCK_N, 128], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, 128], dtype=tl.float32)
    for k_step in range(0, K, 256 * UNROLL):
        for u in tl.static_range(UNROLL):
            k0 = k_step + 256 * u
            kw = tl.minimum(k0, K - 256)
            x_lo = tl.load(x_ptr + kw + cols_lo, mask=k0 + cols_lo < K, other=0.0).to(tl.float32)[None, :]
            x_hi = tl.load(x_ptr + kw + cols_hi, mask=k0 + cols_hi < K, other=0.0).to(tl.float32)[None, :]
            lo, hi = _halves(w_ptr, row_off, kw, tab_ptr, QTYPE)
            acc += lo * x_lo + hi * x_hi
            if GLU:
                lo, hi = _halves(w_ptr, up_off, kw, tab_ptr, QTYPE)
                acc_up += lo * x_lo + hi * x_hi
    out_ty = y_ptr.dtype.element_ty
    y = tl.sum(acc, axis=1)
    if GLU:
        y = _silu_mul(y, tl.sum(acc_up, axis=1), out_ty)
    tl.store(y_ptr + rows, y.to(out_ty), mask=rmask)


@triton.jit
def skinny_kernel(x_ptr, w_ptr, tab_ptr, y_ptr, M, N, K, row_bytes, stride_x, stride_y, QTYPE: tl.constexpr,
                  GLU: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                  UNROLL: tl.constexpr):
    """y [M, N] = x [M, K] @ W^T for a few rows: each weight tile dequantized once, then on tensor cores."""
    cols = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    nmask = cols < N
    row_off = tl.where(nmask, cols * row_bytes, 0)[:, None]
    up_off = tl.where(nmask, (cols + N) * row_bytes, 0)[:, None]
    m = tl.arange(0, BLOCK_M)
    mmask = m < M
    cols_lo, cols_hi = _half_cols(QTYPE)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_step in range(0, K, 256 * UNROLL):  # tiles in flight together, as in gemv_kernel
        for u in tl.static_range(UNROLL):
            k0 = k_step + 256 * u
            kw = tl.minimum(k0, K - 256)
            xrow = x_ptr + m[:, None] * stride_x + kw
            x_lo = tl.load(xrow + cols_lo[None, :], mask=mmask[:, None] & (k0 + cols_lo < K)[None, :], other=0.0)
            x_hi = tl.load(xrow + cols_hi[None, :], mask=mmask[:, None] & (k0 + cols_hi < K)[None, :], other=0.0)
            lo, hi = _halves(w_ptr, row_off, kw, tab_ptr, QTYPE)
            acc = tl.dot(x_lo, tl.trans(lo.to(x_lo.dtype)), acc, input_precision=PRECISION)
            acc = tl.dot(x_hi, tl.trans(hi.to(x_hi.dtype)), acc, input_precision=PRECISION)
            if GLU:
                lo, hi = _halves(w_ptr, up_off, kw, tab_ptr, QTYPE)
                acc_up = tl.dot(x_lo, tl.trans(lo.to(x_lo.dtype)), acc_up, input_precision=PRECISION)
                acc_up = tl.dot(x_hi, tl.trans(hi.to(x_hi.dtype)), acc_up, input_precision=PRECISION)
    out_ty = y_ptr.dtype.element_ty
    y = acc
    if GLU:
        y = _silu_mul(y, acc_up, out_ty)
    tl.store(y_ptr + m[:, None] * stride_y + cols[None, :], y.to(out_ty), mask=mmask[:, None] & nmask[None, :])
