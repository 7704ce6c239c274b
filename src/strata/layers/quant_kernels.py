"""Triton kernels over GGUF-quantized weights: the blocks stay as llama.cpp wrote them, in GPU memory,
and each kernel dequantizes the tiles it needs in registers.

The kernels but two are built on one function, `_halves`: the float32 values of a [rows, 256] tile of a
quantized matrix (as two halves: each byte loaded once yields a value in each), computed in the same
float32 operations, in the same order, as gguf's reference
(`gguf.quants.dequantize`), so the dequantization kernel matches it bit for bit (the tests run it in
Triton's interpreter). Over it: a 1-row GEMV and a few-row GEMM (a verify window, a drafter block) on
tensor cores, both with the gate/up silu*up variant, an embedding gather, and a whole-matrix
dequantization. The exceptions read blocks as 32-bit words. The 1-row GEMVs of Q4_K, Q5_K, IQ4_XS,
Q4_0, Q6_K and Q8_0 (gemv_q4k8c_kernel for the first four, gemv_q6k8c_kernel, gemv_q8_0c_kernel) take x
quantized to int8 per 32 values (quantize_x_kernel), as llama.cpp's GPU products do, and sum bytes times
bytes with dp4a before applying the scales. They run their lanes along K, so that a warp's loads are runs of consecutive
bytes of a row: with a thread per (row, block), as Q8_0's GEMV had until 58bdb13, each load touched 32
cache lines, and the L1 and L2 requests, not the instructions, bound the GEMV.
The few-row GEMMs of the same types (a verify window, a drafter block) take the same int8 x and
run on integer tensor cores, their integer sums scaled as the GEMVs scale their dp4a sums: Q4_K's nibbles
(Q5_K's with their fifth bits, IQ4_XS's levels, Q4_0's) as int8 (skinny_q4k8_kernel), Q6_K's 6-bit values
less 32 (skinny_q6k8_kernel), Q8_0's bytes (skinny_q8_0w_kernel, or skinny_q8_0_kernel where 512 does not divide
K). Q4_K's, Q4_0's and Q8_0's read a row's weights in runs of 128 bytes a warp's load can take whole, for the
same reason. Block layouts are the GGML formats' (ggml-common.h); d and other float16 fields sit at even
offsets, so they are read through a float16 view of the same bytes."""

from __future__ import annotations

import functools
import weakref

import torch

from . import pdl
from .triton_kernels import cdiv, pow2, precision

# GGML type ids and their (weights per block, bytes per block)
Q4_0, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_XS = 2, 8, 12, 13, 14, 23
BLOCKS = {Q4_0: (32, 18), Q8_0: (32, 34), Q4_K: (256, 144), Q5_K: (256, 176), Q6_K: (256, 210),
          IQ4_XS: (256, 136)}
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
#: IQ4_VALUES as int8, 4 to a little-endian int32 (the word kernels' prmt table)
IQ4_WORDS = tuple(int.from_bytes(bytes(v & 0xFF for v in IQ4_VALUES[i:i + 4]), "little", signed=True)
                  for i in range(0, 16, 4))
TILE = 256  # columns a kernel step covers: one superblock, or 8 blocks of 32


@functools.cache
def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def _half_cols(QTYPE: tl.constexpr):
        """Columns (within a 256-column tile) of the two halves _halves returns, in their order."""
        if QTYPE == 8:  # Q8_0: blocks 0..3, then 4..7
            c = tl.arange(0, 128)
            lo, hi = c, c + 128
        elif QTYPE == 2 or QTYPE == 23:  # Q4_0, IQ4_XS: per 32 weights, low nibbles first (16), high after
            b = tl.arange(0, 8)[:, None]
            t = tl.arange(0, 16)[None, :]
            lo = tl.reshape(b * 32 + t, (128,))
            hi = lo + 16
        elif QTYPE == 14:  # Q6_K: low nibbles are the first and second quarter of each half of the block
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
        if QTYPE == 8:  # Q8_0: d, then 32 int8
            b = tl.arange(0, 4)[None, :, None]
            l = tl.arange(0, 32)[None, None, :]
            base_lo = ro + (k0 // 32 + b) * 34
            base_hi = base_lo + 4 * 34
            lo = tl.load(i8 + base_lo + 2 + l).to(tl.float32) * tl.load(f16 + base_lo // 2).to(tl.float32)
            hi = tl.load(i8 + base_hi + 2 + l).to(tl.float32) * tl.load(f16 + base_hi // 2).to(tl.float32)
        elif QTYPE == 2:  # Q4_0: d, then 16 bytes whose low nibbles are weights 0..15, high ones 16..31
            base = ro + (k0 // 32 + tl.arange(0, 8)[None, :, None]) * 18
            d = tl.load(f16 + base // 2).to(tl.float32)
            byte = tl.load(u8 + base + 2 + tl.arange(0, 16)[None, None, :]).to(tl.int32)
            lo = d * ((byte & 15) - 8).to(tl.float32)
            hi = d * ((byte >> 4) - 8).to(tl.float32)
        elif QTYPE == 12 or QTYPE == 13:  # Q4_K / Q5_K: d, dmin, 12 bytes of 6-bit scales and mins, ...
            base = ro + (k0 // 256) * (144 + 32 * (QTYPE - 12))  # Q4_K 144 bytes, Q5_K 176
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
            qs = 16 + 32 * (QTYPE - 12)  # Q5_K: 32 bytes of fifth bits first
            l = tl.arange(0, 32)[None, None, :]
            byte = tl.load(u8 + base + qs + p * 32 + l).to(tl.int32)
            q_lo = byte & 15
            q_hi = byte >> 4
            if QTYPE == 13:
                fifth = tl.load(u8 + base + 16 + l).to(tl.int32)
                q_lo = q_lo | (((fifth >> (2 * p)) & 1) << 4)
                q_hi = q_hi | (((fifth >> (2 * p + 1)) & 1) << 4)
            lo = (d * sc_lo.to(tl.float32)) * q_lo.to(tl.float32) - dmin * m_lo.to(tl.float32)
            hi = (d * sc_hi.to(tl.float32)) * q_hi.to(tl.float32) - dmin * m_hi.to(tl.float32)
        elif QTYPE == 14:  # Q6_K: 128 bytes low 4 bits, 64 bytes high 2 bits, 16 int8 scales, d
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
    def _silu_mul(gate, up, out_ty: tl.constexpr):
        """silu(gate) * up of float32 sums, each step rounded to out_ty as the unfused model rounds it."""
        g = gate.to(out_ty).to(tl.float32)
        return (g * tl.sigmoid(g)).to(out_ty).to(tl.float32) * up.to(out_ty).to(tl.float32)

    globals()["settle"] = pdl.jit()
    globals()["prefetch_l2"] = pdl.jit_prefetch()
    globals()["_half_cols"] = _half_cols  # the kernels call these by name: Triton resolves names in
    globals()["_halves"] = _halves  # module globals
    globals()["_silu_mul"] = _silu_mul
    globals()["tl"] = tl  # the interpreter's check when another module's kernel calls one of these first
    for i, word in enumerate(IQ4_WORDS):  # _iq4_table's words, as the constants Triton takes from globals
        globals()[f"IQ4_W{i}"] = tl.constexpr(word)

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

    @triton.jit
    def _f(v):
        """float32 of a small non-negative int32 v (< 2**23): 2**23 + v through the mantissa, less 2**23;
        an integer op and an add in place of a conversion, a quarter-rate instruction on recent GPUs."""
        return (v | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0

    @triton.jit
    def _words(v):
        """[..., 4] (the last dim held by one thread) -> its four [...] slices, in order."""
        a, b = tl.split(tl.reshape(v, v.shape[:-1] + (2, 2)))
        a0, a1 = tl.split(a)
        b0, b1 = tl.split(b)
        return a0, b0, a1, b1

    @triton.jit
    def _columns(v):
        """[R, 32] -> its 32 columns [R], in order: register moves where a thread holds whole rows."""
        R: tl.constexpr = v.shape[0]
        cols = (v,)
        for level in tl.static_range(5):
            nxt = ()
            for i in tl.static_range(1 << level):
                a, b = tl.split(tl.permute(tl.reshape(cols[i], [R, 2, 16 >> level]), (0, 2, 1)))
                nxt += (a, b)
            cols = nxt
        out = ()
        for i in tl.static_range(32):
            out += (tl.reshape(cols[i], [R]),)
        return out

    @triton.jit
    def _joined4(a, b, c, d):
        """Four [R] -> [R, 4] (a, b, c, d as its columns, in order), by selects on each register's column, which
        the compiler resolves; joins cost layout conversions through shared memory (sm_90: 6.70 instructions a
        weight in 7be201f's Q4_0 GEMM against 6.05)."""
        t = tl.arange(0, 4)[None, :]
        return tl.where(t == 0, a[:, None], tl.where(t == 1, b[:, None], tl.where(t == 2, c[:, None], d[:, None])))

    @triton.jit
    def _q40_block(W, j: tl.constexpr):
        """Q4_0 block j of a step's 36 words W (columns [R]): its d (the low half of word 4 j + j // 2 for even
        j, the high half for odd j) and its 16 bytes of qs after it as [R, 4] words (for even j, 2 bytes into
        a word: each a funnel of two)."""
        at: tl.constexpr = 4 * j + j // 2
        q = ()
        for t in tl.static_range(4):
            q += (W[at + 1 + t] if j % 2 else (W[at + t] >> 16) | (W[at + 1 + t] << 16),)
        return _half2(W[at] >> (16 * (j % 2)), True)[0], _joined4(q[0], q[1], q[2], q[3])

    @triton.jit
    def _nibble_dot(lo, hi, xt, ASM: tl.constexpr):
        """The int8 dot of a sub-block's 32 values in rows of 4 words of its low nibbles' values (weights
        0-15), then 4 of its high ones' ([R, 4] each, one byte a value), with its x block xt [32, 16]."""
        nib = tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 1)), [lo.shape[0], 8])
        return tl.dot(_bytes(nib, ASM), xt, out_dtype=tl.int32)

    @triton.jit
    def _bf16x2(u):
        return (u << 16).to(tl.float32, bitcast=True), (u & 0xFFFF0000).to(tl.float32, bitcast=True)

    @triton.jit
    def _half2(u, F16: tl.constexpr):
        """The two float16 (F16) or bfloat16 values of an int32, low half first, as float32."""
        if F16:
            return ((u & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32),
                    (u >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32))
        return _bf16x2(u)

    @triton.jit
    def _dp4a(a, b, c, ASM: tl.constexpr, SIGNED: tl.constexpr = False):
        """c + the dot product of a's four unsigned (SIGNED: signed) bytes with b's four signed ones: one
        instruction on the device (dp4a), its integer arithmetic spelled out for the interpreter."""
        if ASM:
            if SIGNED:
                return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                                 dtype=tl.int32, is_pure=True, pack=1)
            return tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                             dtype=tl.int32, is_pure=True, pack=1)
        up = 24 - 8 * tl.arange(0, 4)  # the bytes as a last axis: few interpreted ops
        a4 = tl.expand_dims(a.to(tl.int32, bitcast=True), -1) << up
        a4 = (a4 >> 24) if SIGNED else ((a4 >> 24) & 0xFF)
        return c + tl.sum(a4 * ((tl.expand_dims(b, -1) << up) >> 24), axis=-1)

    @triton.jit
    def _prmt(a, b, sel, ASM: tl.constexpr):
        """PTX's byte permute (prmt.b32, default mode) of int32 words: byte i of the result is byte s & 7 of
        b:a (a's bytes 0-3, b's 4-7), s the nibble i of sel, or that byte's sign bit spread over 8 bits where
        s & 8; one instruction on the device, spelled out for the interpreter."""
        if ASM:
            return tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, sel], dtype=tl.int32,
                                             is_pure=True, pack=1)
        i = tl.arange(0, 4)
        s = (tl.expand_dims(sel, -1) >> (4 * i)) & 0xF
        at = 8 * (s & 3)
        byte = tl.where((s & 7) < 4, tl.expand_dims(a, -1) >> at, tl.expand_dims(b, -1) >> at) & 0xFF
        byte = tl.where(s >= 8, tl.where(byte >= 128, 0xFF, 0), byte)
        return tl.sum(byte << (8 * i), axis=-1)

    @triton.jit
    def _iq4_table(q):
        """IQ4_WORDS, each word as a tensor shaped as q."""
        return (tl.full(q.shape, IQ4_W0, tl.int32), tl.full(q.shape, IQ4_W1, tl.int32),
                tl.full(q.shape, IQ4_W2, tl.int32), tl.full(q.shape, IQ4_W3, tl.int32))

    @triton.jit
    def _iq4_registers(K):
        """_iq4_table's words as values the compiler cannot fold (K >> 31 is 0: K > 0), made once before a K
        loop: as constants, ptxas copied one into a register before each of its prmts (0.44 instructions a
        weight of the GEMV, sm_90)."""
        zero = K >> 31
        return zero + IQ4_W0, zero + IQ4_W1, zero + IQ4_W2, zero + IQ4_W3

    @triton.jit
    def _iq4_pairs(q, ASM: tl.constexpr, LOOKUP: tl.constexpr = True, table=None):
        """IQ4_XS's levels (as int8) of words q of 8 nibbles, in two words: those of bytes 0 and 1's low,
        high, low, high nibbles, then bytes 2 and 3's. Each table half (levels 0-7, 8-15) is two words that a
        prmt indexes by the nibbles' low 3 bits; a third picks per byte by their fourth. The interpreter
        (not ASM) looks them up in fewer ops unless not LOOKUP (a test's check of the prmts)."""
        q = q.to(tl.int32, bitcast=True)
        if not ASM and LOOKUP:
            return _iq4_bytes(q, 0, 4), _iq4_bytes(q, 16, 4)
        t0, t1, t2, t3 = _iq4_table(q) if table is None else table
        low3 = q & 0x77777777  # a prmt reads its selector's low 16 bits: each half's selectors by one shift
        pick = ((q >> 1) & 0x44444444) | 0x32103210
        out = ()
        for half in tl.static_range(2):
            s = low3 >> (16 * half)
            out += (_prmt(_prmt(t0, t1, s, ASM), _prmt(t2, t3, s, ASM), pick >> (16 * half), ASM),)
        return out

    @triton.jit
    def _iq4_levels(q, ASM: tl.constexpr, LOOKUP: tl.constexpr = True, table=None):
        """_iq4_pairs in weight order: the levels of q's 4 low nibbles (bytes 0-3), then of its 4 high ones."""
        if not ASM and LOOKUP:
            q = q.to(tl.int32, bitcast=True)
            return _iq4_bytes(q, 0, 8), _iq4_bytes(q, 4, 8)
        a, b = _iq4_pairs(q, ASM, LOOKUP, table)
        return _prmt(a, b, a * 0 + 0x6420, ASM), _prmt(a, b, a * 0 + 0x7531, ASM)

    @triton.jit
    def _iq4_bytes(q, first: tl.constexpr, step: tl.constexpr):
        """For the interpreter (fewer ops than the prmts spelled out): a word of the levels of q's nibbles at
        bits first + step i, i = 0..3, looked up in _iq4_table's words as the prmts do."""
        n = (tl.expand_dims(q, -1) >> (first + step * tl.arange(0, 4))) & 0xF
        t0, t1, t2, t3 = _iq4_table(n)
        word = tl.where(n < 8, tl.where(n < 4, t0, t1), tl.where(n < 12, t2, t3))
        return tl.sum(((word >> (8 * (n & 3))) & 0xFF) << (8 * tl.arange(0, 4)), axis=-1)

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
    def _assignment(w_ptr, q_ptr, xd_ptr, xs_ptr, y_ptr, ids_ptr, expert_bytes, K, stride_y, SHARE: tl.constexpr,
                    PDL: tl.constexpr):
        """The word GEMVs over stacked experts (EXPERTS): program_id(1) is a window's (row, expert) assignment
        a, over expert ids[a]'s matrix (expert_bytes apart), with row a // SHARE of an x that quantize_x made
        of the rows laid end to end (each row's blocks, scales and sums K, K / 32 and K / 16 apart), into
        row a of y (stride_y apart). Returns those pointers, having waited for the kernel before (settle:
        the ids are the routing's)."""
        settle(PDL)
        a = tl.program_id(1).to(tl.int64)
        xr = a // SHARE
        return (w_ptr + tl.load(ids_ptr + a).to(tl.int64) * expert_bytes, q_ptr + xr * K, xd_ptr + xr * (K // 32),
                xs_ptr + xr * (K // 16), y_ptr + a * stride_y)

    @triton.jit
    def _lane_rows(N, row_stride, GLU: tl.constexpr, RT: tl.constexpr, WARPS: tl.constexpr, KS: tl.constexpr):
        """The lanes-along-K GEMVs' rows: a program's first, and per warp its RT rows' zeroed partial sums
        [WARPS, 32] and offsets (in row_stride units; 0 past N), with GLU the gate rows' then their up rows',
        and its part of K [WARPS, 1]: KS warps side by side take each row's steps in turns (a long row's
        chain of dependent loads KS times shorter), so a program takes RT * WARPS / KS rows."""
        RW: tl.constexpr = WARPS // KS
        wi = tl.arange(0, WARPS)[:, None]
        first = tl.program_id(0) * (RT * RW)
        acc = ()
        bases = ()
        for r in tl.static_range(2 * RT if GLU else RT):
            acc += (tl.zeros([WARPS, 32], dtype=tl.float32),)
            row = first + (r % RT) * RW + wi // KS
            bases += (tl.where(row < N, (row + (N if r >= RT else 0)) * row_stride, 0),)
        return first, acc, bases, wi % KS

    @triton.jit
    def _lane_superblocks(sb0, blocks, WARPS: tl.constexpr):
        """Lane l's superblock sb0 + l // 8 (sb0 [WARPS, 1]: each warp's step) of a row of `blocks`, whether
        it is one, and its index (0 past the row) [WARPS, 32]: each warp reads x for its own rows."""
        sb = sb0 + tl.arange(0, 32)[None, :] // 8
        live = sb < blocks
        return live, tl.where(live, sb, 0) + 0 * tl.arange(0, WARPS)[:, None]

    @triton.jit
    def _store_lane_rows(y_ptr, acc, first, N, GLU: tl.constexpr, RT: tl.constexpr, WARPS: tl.constexpr,
                         KS: tl.constexpr):
        """Add up the lanes' (and a row's KS warps') partial sums of each row and store them (with GLU
        silu(gate) * up)."""
        RW: tl.constexpr = WARPS // KS
        rows = first + tl.arange(0, RW)
        out_ty = y_ptr.dtype.element_ty
        for r in tl.static_range(RT):
            at_r = rows + r * RW
            y0 = tl.sum(tl.reshape(tl.sum(acc[r], axis=1), (RW, KS)), axis=1)
            if GLU:
                y1 = tl.sum(tl.reshape(tl.sum(acc[RT + r], axis=1), (RW, KS)), axis=1)
                tl.store(y_ptr + at_r, _silu_mul(y0, y1, out_ty).to(out_ty), mask=at_r < N)
            else:
                tl.store(y_ptr + at_r, y0.to(out_ty), mask=at_r < N)

    @triton.jit
    def _prefetch_rows(w_ptr, first, N, row_bytes, GLU: tl.constexpr, RT: tl.constexpr, WARPS: tl.constexpr,
                       KS: tl.constexpr, PREFETCH: tl.constexpr, ON: tl.constexpr):
        """A lanes-along-K GEMV program's rows of W (with GLU their up rows too) asked into L2 (prefetch.global.L2,
        a line a thread at a time) where they start within the first PREFETCH bytes (and ON: on the device; a
        product over experts passes 0): done before the wait for the kernel ahead (PDL), the programs already
        resident stream their weights while that kernel finishes."""
        if PREFETCH and ON:
            if first.to(tl.int64) * row_bytes < PREFETCH:
                COVER: tl.constexpr = RT * (WARPS // KS)
                T: tl.constexpr = 32 * WARPS
                w8 = w_ptr.to(tl.pointer_type(tl.int8))
                span = (tl.minimum(first + COVER, N) - first).to(tl.int64) * row_bytes
                for half in tl.static_range(2 if GLU else 1):
                    start = w8 + (first + half * N).to(tl.int64) * row_bytes
                    for off in range(0, span, 128 * T):
                        at = off + tl.arange(0, T) * 128
                        prefetch_l2(start + at, at < span)

    @triton.jit
    def gemv_q4k8c_kernel(q_ptr, xd_ptr, xs_ptr, w_ptr, y_ptr, N, K, row_words, GLU: tl.constexpr,
                          RT: tl.constexpr, WARPS: tl.constexpr, KU: tl.constexpr, ASM: tl.constexpr,
                          QTYPE: tl.constexpr, PDL: tl.constexpr = False, ids_ptr=None, expert_bytes=0,
                          stride_y=0, EXPERTS: tl.constexpr = False, SHARE: tl.constexpr = 1,
                          KS: tl.constexpr = 1, PREFETCH: tl.constexpr = 0):
        """Q4_K (QTYPE 12), Q5_K (13), IQ4_XS (23) or Q4_0 (2) times an int8 x (quantize_x_kernel) with lanes
        along K (IQ4_XS: lane l's 16 bytes are sub-block l % 8's 32 weights, their levels by _iq4_pairs; Q4_0:
        a superblock is 8 blocks, 144 bytes, lane l taking block l % 8's 18: d (nibble - 8) xd isum); a warp reads
        4 superblocks of a row at once, lane l the 16 qs bytes 16 (l % 8) of superblock l // 8 (its 32
        weights: 16 of sub-block 2g in the low nibbles, 16 of 2g + 1 in the high, g = l % 8 // 2) and, with
        the 7 other lanes of that superblock, its 16-byte header (Q5_K: and the half of qh with their fifth
        bits). So each instruction reads 512 consecutive bytes of qs, where a thread per (row, superblock)
        touched 32 lines (its L1 and L2 requests were the GEMV's bound); each warp's x serves RT rows, KU
        steps of 4 superblocks are loaded before any is used, and the lanes' partial sums add up at the
        end. A program takes RT * WARPS rows (with GLU: as many gate rows and their up rows). EXPERTS: see
        _assignment."""
        if EXPERTS:
            w_ptr, q_ptr, xd_ptr, xs_ptr, y_ptr = _assignment(w_ptr, q_ptr, xd_ptr, xs_ptr, y_ptr, ids_ptr,
                                                               expert_bytes, K, stride_y, SHARE, PDL)
        FIVE: tl.constexpr = QTYPE == 13
        IQ4: tl.constexpr = QTYPE == 23
        Q40: tl.constexpr = QTYPE == 2
        # words a superblock: d and dmin, 12 scale bytes, (qh,) qs; IQ4_XS: d and the scales' high bits, their
        # low bits, qs (8-byte aligned only); Q4_0: 8 blocks of 18 bytes, d then 16 of qs
        SB: tl.constexpr = 34 if IQ4 else 44 if FIVE else 36
        QS: tl.constexpr = 2 if IQ4 else 12 if FIVE else 4
        HI: tl.constexpr = 1.0 if FIVE else 0.0625  # the high sub-block's values: at bit 4, or in place
        w32 = w_ptr.to(tl.pointer_type(tl.uint32))
        q32 = q_ptr.to(tl.pointer_type(tl.int32))
        c = tl.arange(0, 32)[None, :] % 8  # which 16 bytes of its superblock a lane takes
        g = c // 2
        h = c % 2
        i = tl.arange(0, 4)[None, None, :]
        at = 16 * (g % 2)
        NR: tl.constexpr = 2 * RT if GLU else RT
        blocks = K // 256
        first, acc, bases, kpart = _lane_rows(N, row_words, GLU, RT, WARPS, KS)
        tab = _iq4_registers(K) if IQ4 else None
        _prefetch_rows(w_ptr, first, N, 4 * row_words, GLU, RT, WARPS, KS, PREFETCH, ASM)
        settle(PDL)
        for it in range(0, blocks, 4 * KU * KS):
            xs = ()
            for u in tl.static_range(KU):
                live, sbc = _lane_superblocks(it + 4 * (u * KS + kpart), blocks, WARPS)
                if Q40 or IQ4:  # lane c takes block (sub-block) c: x block c, its first 16 values then 16
                    xw = (sbc * 64 + 8 * c)[:, :, None]
                    xlo = _words(tl.load(q32 + xw + i))
                    xhi = _words(tl.load(q32 + xw + 4 + i))
                    xd = tl.load(xd_ptr + sbc * 8 + c)
                    if IQ4:  # in _iq4_pairs' order
                        xa = ()
                        xb = ()
                        for w in tl.static_range(4):
                            xa += (_prmt(xlo[w], xhi[w], xlo[w] * 0 + 0x5140, ASM),)
                            xb += (_prmt(xlo[w], xhi[w], xlo[w] * 0 + 0x7362, ASM),)
                        xs += ((live, sbc * SB, xa, xb, xd),)
                    else:  # and the block's sum
                        xs += ((live, sbc * SB, xlo, xhi, xd,
                                tl.load(xs_ptr + sbc * 16 + 2 * c) + tl.load(xs_ptr + sbc * 16 + 2 * c + 1)),)
                else:
                    xw = (sbc * 64 + 16 * g + 4 * h)[:, :, None]
                    xs += ((live, sbc * SB, _words(tl.load(q32 + xw + i)), _words(tl.load(q32 + xw + 8 + i)),
                            tl.load(xd_ptr + sbc * 8 + 2 * g), tl.load(xd_ptr + sbc * 8 + 2 * g + 1),
                            tl.load(xs_ptr + sbc * 16 + 4 * g + h), tl.load(xs_ptr + sbc * 16 + 4 * g + 2 + h)),)
            nxt = ()
            for r in tl.static_range(NR):
                a = acc[r]
                for u in tl.static_range(KU):
                    if Q40:  # block c's 18 bytes from the word holding its start: d, then qs 2 or 4 bytes in
                        live, off, xlo, xhi, xd, xsum = xs[u]
                        at0 = bases[r] + off + 9 * c // 2
                        w = _words(tl.load(w32 + at0[:, :, None] + i)) + (tl.load(w32 + at0 + 4),)
                        d = tl.where(live, _half2(tl.where(h == 1, w[0] >> 16, w[0]), True)[0], 0.0)
                        isum = tl.zeros([WARPS, 32], dtype=tl.int32)
                        for k in tl.static_range(4):
                            q = tl.where(h == 1, w[k + 1], (w[k] >> 16) | (w[k + 1] << 16))
                            isum = _dp4a((q >> 4) & 0x0F0F0F0F, xhi[k], _dp4a(q & 0x0F0F0F0F, xlo[k], isum, ASM), ASM)
                        a += d * (xd * isum.to(tl.float32) - 8.0 * xsum)
                    elif IQ4:
                        live, off, xa, xb, xd = xs[u]
                        base = tl.multiple_of(bases[r] + off, (2, 2))[:, :, None]
                        h0, h1 = tl.split(tl.load(w32 + base + tl.arange(0, 2)[None, None, :]))
                        qs = _words(tl.load(w32 + base + QS + 4 * c[:, :, None] + i))
                        d = tl.where(live, _half2(h0, True)[0], 0.0)
                        scale = _f(((h1 >> (4 * c)) & 0xF) | (((h0 >> (16 + 2 * c)) & 3) << 4)) - 32.0
                        isum = tl.zeros([WARPS, 32], dtype=tl.int32)
                        for w in tl.static_range(4):
                            pa, pb = _iq4_pairs(qs[w], ASM, True, tab)
                            isum = _dp4a(pb, xb[w], _dp4a(pa, xa[w], isum, ASM, True), ASM, True)
                        a += d * (scale * (xd * isum.to(tl.float32)))
                    else:
                        live, off, xlo, xhi, xdl, xdh, xsl, xsh = xs[u]
                        base = tl.multiple_of(bases[r] + off, (4, 4))[:, :, None]
                        h0, h1, h2, h3 = _words(tl.load(w32 + base + i))
                        qs = _words(tl.load(w32 + base + QS + 4 * c[:, :, None] + i))
                        if FIVE:
                            qh = _words(tl.load(w32 + base + 4 + 4 * h[:, :, None] + i))
                        d, dmin = _half2(h0, True)
                        d = tl.where(live, d, 0.0)
                        dmin = tl.where(live, dmin, 0.0)
                        scw = tl.where(g < 2, h1 & 0x3F3F3F3F, (h3 & 0x0F0F0F0F) | ((h1 >> 2) & 0x30303030)) >> at
                        mnw = tl.where(g < 2, h2 & 0x3F3F3F3F,
                                       ((h3 >> 4) & 0x0F0F0F0F) | ((h2 >> 2) & 0x30303030)) >> at
                        ilo = tl.zeros([WARPS, 32], dtype=tl.int32)
                        ihi = tl.zeros([WARPS, 32], dtype=tl.int32)
                        for w in tl.static_range(4):
                            if FIVE:  # qh's bits 2g and 2g + 1 of each byte rotated to its bits 4 and 5
                                fifth = _funnel(qh[w], qh[w], (2 * g - 4) & 31, ASM)
                                lo = (qs[w] & 0x0F0F0F0F) | (fifth & 0x10101010)
                                hi = ((qs[w] >> 4) & 0x0F0F0F0F) | ((fifth >> 1) & 0x10101010)
                            else:
                                lo = qs[w] & 0x0F0F0F0F
                                hi = qs[w] & 0xF0F0F0F0
                            ilo = _dp4a(lo, xlo[w], ilo, ASM)
                            ihi = _dp4a(hi, xhi[w], ihi, ASM)
                        dot = _f(scw & 0xFF) * (xdl * ilo.to(tl.float32)) \
                            + _f((scw >> 8) & 0xFF) * (xdh * (ihi.to(tl.float32) * HI))
                        mins = _f(mnw & 0xFF) * xsl + _f((mnw >> 8) & 0xFF) * xsh
                        a += d * dot - dmin * mins
                nxt += (a,)
            acc = nxt
        _store_lane_rows(y_ptr, acc, first, N, GLU, RT, WARPS, KS)

    @triton.jit
    def _q6_bits(ql, qh, m):
        """The 6-bit values of quarter m of a Q6_K half-superblock, a byte each: low 4 bits from ql (the low
        nibbles for m < 2, else the high), high 2 from bits 2m of qh."""
        if m == 0:
            hs = qh << 4
        elif m == 1:
            hs = qh << 2
        elif m == 2:
            hs = qh
        else:
            hs = qh >> 2
        return ((ql >> (4 * (m // 2))) & 0x0F0F0F0F) | (hs & 0x30303030)

    @triton.jit
    def _funnel(lo, hi, shift, ASM: tl.constexpr):
        """The 32 bits of hi:lo from bit `shift` (0-31) up (with hi = lo: lo rotated right by shift): one
        instruction on the device."""
        if ASM:
            return tl.inline_asm_elementwise("shf.r.wrap.b32 $0, $1, $2, $3;", "=r,r,r,r", [lo, hi, shift],
                                             dtype=tl.uint32, is_pure=True, pack=1)
        lo = lo.to(tl.uint32, bitcast=True)
        hi = hi.to(tl.uint32, bitcast=True)
        return tl.where(shift == 0, lo, (lo >> shift) | (hi << ((32 - shift) & 31)))

    @triton.jit
    def _window16(w32, at, total, i, ASM: tl.constexpr):
        """The 4 words of the 16 bytes from byte `at` (even) of w32, for lanes whose `at` differ: the two
        aligned 16-byte chunks around them loaded whole (none past byte total), their words rotated by at's
        word within the first and shifted by its half word."""
        chunk = tl.multiple_of((at >> 4) * 4, (4, 4))[:, :, None]
        W = _words(tl.load(w32 + chunk + i)) + \
            _words(tl.load(w32 + chunk + 4 + i, mask=(chunk + 8) * 4 <= total, other=0))  # rows end on 16 bytes
        dw = (at >> 2) & 3
        V = ()
        for k in tl.static_range(7):
            V += (tl.where((dw & 1) != 0, W[k + 1], W[k]),)
        U = ()
        for k in tl.static_range(5):
            U += (tl.where((dw & 2) != 0, V[k + 2], V[k]),)
        shift = (at & 2) * 8
        return (_funnel(U[0], U[1], shift, ASM), _funnel(U[1], U[2], shift, ASM),
                _funnel(U[2], U[3], shift, ASM), _funnel(U[3], U[4], shift, ASM))

    @triton.jit
    def gemv_q6k8c_kernel(q_ptr, xd_ptr, xs_ptr, w_ptr, y_ptr, N, K, row_bytes, GLU: tl.constexpr,
                          RT: tl.constexpr, WARPS: tl.constexpr, KU: tl.constexpr, ASM: tl.constexpr,
                          QTYPE: tl.constexpr, PDL: tl.constexpr = False, ids_ptr=None, expert_bytes=0,
                          stride_y=0, EXPERTS: tl.constexpr = False, SHARE: tl.constexpr = 1,
                          KS: tl.constexpr = 1, PREFETCH: tl.constexpr = 0):
        """Q6_K times an int8 x (quantize_x_kernel) with lanes along K, as gemv_q4k8c_kernel: a warp reads 4
        superblocks of a row at once, lane l the 16 ql bytes 16 c (c = l % 8) of superblock l // 8 (the low
        4 bits of 16 weights of the quarters mq = part and part + 2 of half h2, c = 4 h2 + 2 part + lh) and
        the 16 qh bytes with their high 2 bits. Superblocks are 210 bytes, so those 16 bytes start at any
        even byte: each lane loads the two aligned 16-byte chunks around them (the warp's loads are runs of
        consecutive chunks) and picks its words (_window16); rows (row_bytes apart) may start at any even
        byte too. Then per 16 weights an integer dot product with
        x (4 dp4a) and d * sc * (xd * dot - 32 * sum of x). EXPERTS: see _assignment."""
        if EXPERTS:
            w_ptr, q_ptr, xd_ptr, xs_ptr, y_ptr = _assignment(w_ptr, q_ptr, xd_ptr, xs_ptr, y_ptr, ids_ptr,
                                                               expert_bytes, K, stride_y, SHARE, PDL)
        w32 = w_ptr.to(tl.pointer_type(tl.uint32))
        i8 = w_ptr.to(tl.pointer_type(tl.int8))
        f16 = w_ptr.to(tl.pointer_type(tl.float16))
        q32 = q_ptr.to(tl.pointer_type(tl.int32))
        c = tl.arange(0, 32)[None, :] % 8  # which 16 bytes of its superblock a lane takes
        h2 = c // 4
        part = (c // 2) % 2
        lh = c % 2
        i = tl.arange(0, 4)[None, None, :]
        NR: tl.constexpr = 2 * RT if GLU else RT
        blocks = K // 256
        total = (2 * N if GLU else N) * row_bytes
        first, acc, bases, kpart = _lane_rows(N, row_bytes, GLU, RT, WARPS, KS)
        _prefetch_rows(w_ptr, first, N, row_bytes, GLU, RT, WARPS, KS, PREFETCH, ASM)
        settle(PDL)
        for it in range(0, blocks, 4 * KU * KS):
            xs = ()
            for u in tl.static_range(KU):
                live, sbc = _lane_superblocks(it + 4 * (u * KS + kpart), blocks, WARPS)
                xw = tl.multiple_of(sbc * 64 + 32 * h2 + 8 * part + 4 * lh, (4, 4))[:, :, None]
                blk = sbc * 8 + 4 * h2 + part  # the x block of quarter part; part + 2's is blk + 2
                xs += ((live, sbc * 210, _words(tl.load(q32 + xw + i)), _words(tl.load(q32 + xw + 16 + i)),
                        tl.load(xd_ptr + blk), tl.load(xd_ptr + blk + 2),
                        tl.load(xs_ptr + 2 * blk + lh), tl.load(xs_ptr + 2 * blk + 4 + lh)),)
            nxt = ()
            for r in tl.static_range(NR):
                a = acc[r]
                for u in tl.static_range(KU):
                    live, off, xlo, xhi, xdl, xdh, xsl, xsh = xs[u]
                    at = bases[r] + off
                    ql = _window16(w32, at + 16 * c, total, i, ASM)
                    qh = _window16(w32, at + 128 + 32 * h2 + 16 * lh, total, i, ASM)
                    scl = tl.load(i8 + at + 192 + 8 * h2 + 2 * part + lh).to(tl.float32)
                    sch = tl.load(i8 + at + 196 + 8 * h2 + 2 * part + lh).to(tl.float32)
                    d = tl.where(live, tl.load(f16 + (at + 208) // 2).to(tl.float32), 0.0)
                    ilo = tl.zeros([WARPS, 32], dtype=tl.int32)
                    ihi = tl.zeros([WARPS, 32], dtype=tl.int32)
                    for w in tl.static_range(4):
                        t = qh[w] >> (2 * part)  # bits 4, 5 of quarter part's weights at 0, 1; of part + 2's at 4, 5
                        lo = (ql[w] & 0x0F0F0F0F) | ((t << 4) & 0x30303030)
                        hi = ((ql[w] >> 4) & 0x0F0F0F0F) | (t & 0x30303030)
                        ilo = _dp4a(lo, xlo[w], ilo, ASM)
                        ihi = _dp4a(hi, xhi[w], ihi, ASM)
                    a += d * (scl * (xdl * ilo.to(tl.float32) - 32.0 * xsl)
                              + sch * (xdh * ihi.to(tl.float32) - 32.0 * xsh))
                nxt += (a,)
            acc = nxt
        _store_lane_rows(y_ptr, acc, first, N, GLU, RT, WARPS, KS)

    @triton.jit
    def gemv_q8_0c_kernel(q_ptr, xd_ptr, xs_ptr, w_ptr, y_ptr, N, K, row_words, GLU: tl.constexpr,
                          RT: tl.constexpr, WARPS: tl.constexpr, KU: tl.constexpr, ASM: tl.constexpr,
                          QTYPE: tl.constexpr, PDL: tl.constexpr = False, ids_ptr=None, expert_bytes=0,
                          stride_y=0, EXPERTS: tl.constexpr = False, SHARE: tl.constexpr = 1,
                          KS: tl.constexpr = 1, PREFETCH: tl.constexpr = 0):
        """Q8_0 times an int8 x with lanes along K, as gemv_q4k8c_kernel: lane l takes the row's 16-byte
        chunk 32 s + l at step s, so a warp's load is 512 consecutive bytes (with a thread per 4 blocks, as
        Q8_0's GEMV had until 58bdb13, each load touched 32 lines). 34-byte blocks do not line up with 16-byte chunks,
        so x comes in the row's layout too (quantize_x's tail: each block's values 2 bytes into its 34,
        zeros under its d): a weight word and the x word at the same offset make a dp4a with no shifting.
        A word belongs to the block of its second byte, so a chunk's words are those of block A, which
        ends in it, then of block B, whose d it holds: two integer sums, each scaled by its block's d (a
        2-byte load from lines just read) and xd. xs is that layout (_word_gemv passes it; Q8_0 has no
        offsets to sum x for), K / 32 * 34 bytes a row. EXPERTS: see _assignment."""
        xr = xs_ptr
        if EXPERTS:
            w_ptr, q_ptr, xd_ptr, xs_ptr, y_ptr = _assignment(w_ptr, q_ptr, xd_ptr, xs_ptr, y_ptr, ids_ptr,
                                                               expert_bytes, K, stride_y, SHARE, PDL)
            xr += tl.program_id(1).to(tl.int64) // SHARE * (K // 32 * 34)
        w32 = w_ptr.to(tl.pointer_type(tl.uint32))
        f16 = w_ptr.to(tl.pointer_type(tl.float16))
        xr32 = xr.to(tl.pointer_type(tl.int32))
        lane = tl.arange(0, 32)[None, :] + 0 * tl.arange(0, WARPS)[:, None]
        i = tl.arange(0, 4)[None, None, :]
        NR: tl.constexpr = 2 * RT if GLU else RT
        chunks = K // 256 * 17
        last = K // 32 - 1
        first, acc, bases, kpart = _lane_rows(N, row_words, GLU, RT, WARPS, KS)
        _prefetch_rows(w_ptr, first, N, 4 * row_words, GLU, RT, WARPS, KS, PREFETCH, ASM)
        settle(PDL)
        for it in range(0, chunks, 32 * KU * KS):
            xs = ()
            for u in tl.static_range(KU):
                c = it + 32 * (u * KS + kpart) + lane
                live = c < chunks
                c = tl.where(live, c, 0)
                jb = (16 * c + 33) // 34  # the first block whose d is at or past the chunk's start
                at = 34 * jb - 16 * c  # that d's byte in the chunk (none in it from 16 on)
                xw = _words(tl.load(xr32 + tl.multiple_of(4 * c, (4, 4))[:, :, None] + i))
                xa = ()
                xb = ()
                for e in tl.static_range(4):
                    xa += (tl.where(4 * e < at, xw[e], 0),)
                    xb += (tl.where(4 * e < at, 0, xw[e]),)
                ja = tl.maximum(jb - 1, 0)
                jb = tl.minimum(jb, last)
                xs += ((c, ja, jb, xa, xb, tl.where(live, tl.load(xd_ptr + ja), 0.0),
                        tl.where(live, tl.load(xd_ptr + jb), 0.0)),)
            nxt = ()
            for r in tl.static_range(NR):
                a = acc[r]
                for u in tl.static_range(KU):
                    c, ja, jb, xa, xb, xda, xdb = xs[u]
                    w = _words(tl.load(w32 + tl.multiple_of(bases[r] + 4 * c, (4, 4))[:, :, None] + i))
                    ia = tl.zeros([WARPS, 32], dtype=tl.int32)
                    ib = tl.zeros([WARPS, 32], dtype=tl.int32)
                    for e in tl.static_range(4):
                        ia = _dp4a(w[e], xa[e], ia, ASM, True)
                        ib = _dp4a(w[e], xb[e], ib, ASM, True)
                    da = tl.load(f16 + 2 * bases[r] + 17 * ja).to(tl.float32)
                    db = tl.load(f16 + 2 * bases[r] + 17 * jb).to(tl.float32)
                    a += da * (xda * ia.to(tl.float32)) + db * (xdb * ib.to(tl.float32))
                nxt += (a,)
            acc = nxt
        _store_lane_rows(y_ptr, acc, first, N, GLU, RT, WARPS, KS)

    @triton.jit
    def _k_range(blocks, SPLIT: tl.constexpr):
        """This program's slice of a K loop of `blocks` steps: slice program_id(1) of SPLIT."""
        per = tl.cdiv(blocks, SPLIT)
        lo = tl.program_id(1) * per
        return lo, tl.minimum(lo + per, blocks)

    @triton.jit
    def _finish(y_ptr, ws_ptr, cnt_ptr, acc, rows, M, N, stride_y, GLU: tl.constexpr, SPLIT: tl.constexpr):
        """Store the few-row GEMMs' [BLOCK_M, BLOCK_N] results (acc: (gate or all, up)), with GLU silu(gate) * up.
        With SPLIT > 1 each program holds a K slice's partial sums: it writes them to the workspace, and the
        slice that finishes last (counted by an atomic) adds them all, in slice order, and stores."""
        BLOCK_M: tl.constexpr = acc[0].shape[0]
        BLOCK_N: tl.constexpr = acc[0].shape[1]
        m = tl.arange(0, BLOCK_M)
        a0 = acc[0]
        a1 = acc[1]
        last = True
        if SPLIT > 1:
            width = tl.num_programs(0) * BLOCK_N
            part = ws_ptr + m[:, None] * width + rows[None, :]
            tl.store(part + tl.program_id(1) * (2 * BLOCK_M) * width, a0)
            if GLU:
                tl.store(part + (tl.program_id(1) * 2 + 1) * BLOCK_M * width, a1)
            tl.debug_barrier()  # every thread's partials written before the count is released
            last = tl.atomic_add(cnt_ptr + tl.program_id(0), 1, sem="acq_rel", scope="gpu") == SPLIT - 1
            if last:
                a0 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                a1 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                for k in tl.static_range(SPLIT):
                    a0 += tl.load(part + k * (2 * BLOCK_M) * width, cache_modifier=".cg")
                    if GLU:
                        a1 += tl.load(part + (k * 2 + 1) * BLOCK_M * width, cache_modifier=".cg")
                tl.atomic_xchg(cnt_ptr + tl.program_id(0), 0)  # ready for the next product
        if last:
            out_ty = y_ptr.dtype.element_ty
            y = a0
            if GLU:
                y = _silu_mul(y, a1, out_ty)
            tl.store(y_ptr + m[:, None] * stride_y + rows[None, :], y.to(out_ty),
                     mask=(m < M)[:, None] & (rows < N)[None, :])

    @triton.jit
    def _gemm_rows(w_ptr, N, row_words, BLOCK_N: tl.constexpr, STACK: tl.constexpr = False):
        """A few-row GEMM program's BLOCK_N rows of W, their offsets in words (of the rows, and of the up rows N
        later with GLU; rows past N at 0, their results never stored) and W as 32-bit words. STACK: the gate
        rows and their up rows stacked into one tile of 2 BLOCK_N rows (gate first), its offsets in both."""
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        if STACK:
            t = tl.arange(0, 2 * BLOCK_N)
            row = tl.program_id(0) * BLOCK_N + t % BLOCK_N
            both = tl.where(row < N, (row + tl.where(t < BLOCK_N, 0, N)) * row_words, 0)
            offs = (both, both)
        else:
            nmask = rows < N
            offs = (tl.where(nmask, rows * row_words, 0), tl.where(nmask, (rows + N) * row_words, 0))
        return rows, offs, w_ptr.to(tl.pointer_type(tl.uint32))

    @triton.jit
    def _unstacked(acc, STACK: tl.constexpr):
        """The few-row GEMMs' sums (gate or all, up): with STACK, of the stacked tile's gate rows, then its up
        rows (_gemm_rows); else acc as it is."""
        if STACK:
            R: tl.constexpr = acc[0].shape[0]
            acc = tl.split(tl.permute(tl.reshape(acc[0], [2, R // 2, 16]), (1, 2, 0)))
        return acc

    @triton.jit
    def _bytes(w, ASM: tl.constexpr):
        """The bytes of 32-bit words w [R, C] as int8 [R, 4 C] (byte b of word c at 4 c + b): on the device each
        word, repeated over its 4 bytes, is packed back into the one register it came from."""
        R: tl.constexpr = w.shape[0]
        C: tl.constexpr = w.shape[1]
        w4 = tl.reshape(tl.broadcast_to(w[:, :, None], [R, C, 4]), [R, 4 * C])
        if ASM:
            return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r,r,r,r", [w4], dtype=tl.int8, is_pure=True,
                                             pack=4)
        return ((w4 << (24 - 8 * (tl.arange(0, 4 * C) % 4))[None, :]) >> 24).to(tl.int8)

    @triton.jit
    def _byte_times(w, k: tl.constexpr, d, d_off):
        """Byte k of w times d (d_off = -2**23 d), rounded once as float32 d * byte is: the byte made the
        mantissa of 2**23 + byte, and one fma subtracts 2**23 d (exact) from its exact product with d."""
        if k == 3:
            v = (w >> 24) | 0x4B000000
        else:
            v = ((w >> (8 * k)) & 0xFF) | 0x4B000000
        return tl.fma(v.to(tl.float32, bitcast=True), d, d_off)

    @triton.jit
    def _x_scales(ds_ptr, j):
        """Block j's scales [X_ROWS] and sums of d * q [X_ROWS] of the few-row GEMMs' int8 x (quantize_x), read
        as one 8-byte word a row."""
        pair = tl.load(ds_ptr.to(tl.pointer_type(tl.int64)) + 16 * j + tl.arange(0, 16))
        return pair.to(tl.int32).to(tl.float32, bitcast=True), (pair >> 32).to(tl.int32).to(tl.float32, bitcast=True)

    @triton.jit
    def _x_block(q_ptr, ds_ptr, K, j):
        """Block j (32 columns) of the few-row GEMMs' int8 x (quantize_x, X_ROWS rows), transposed: [32, X_ROWS],
        with its scales and sums (_x_scales)."""
        xt = tl.load(q_ptr + tl.arange(0, 16)[None, :] * K + 32 * j + tl.arange(0, 32)[:, None])
        xd, xs = _x_scales(ds_ptr, j)
        return xt, xd, xs

    @triton.jit
    def skinny_q4k8_kernel(q_ptr, ds_ptr, w_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K, row_words, stride_y,
                           GLU: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, ASM: tl.constexpr,
                           STAGES: tl.constexpr,
                           QTYPE: tl.constexpr = 12, STACK_ROWS: tl.constexpr = 0):
        """Q4_K (QTYPE 12), Q5_K (13), IQ4_XS (23) or Q4_0 (2: 8 blocks a step) times a few rows of int8 x
        (quantize_x) on integer tensor cores: per sub-block, the int8 dot of its 32 nibbles in BLOCK_N rows
        (the first operand, so that a thread's scales serve 4 x rows; Q5_K: each with its fifth bit from qh,
        byte l's bit j for weight l of sub-block j; IQ4_XS: their levels, by _iq4_levels) with the x block,
        then scaled as the 1-row GEMV scales its dp4a sums: d sc xd isum - dmin m xs (IQ4_XS: d (sc - 32) xd
        isum; Q4_0: d xd isum - 8 d xs). IQ4_XS's and Q4_0's tiles hold a sub-block's low nibbles (its
        weights 0-15; IQ4_XS: their levels), then its high ones, x's own order, so that each of the four lanes
        that share a row in the product builds one qs word. With a word's low nibbles beside its high ones and
        x read in that order, each took two (sm_90: 7.42 and 6.05 instructions a weight, 0.51 and 1.07 of them
        shared-memory loads, stores and barriers, against 7.09 and 5.35, 0.31 and 0.31). Q4_0's
        144-byte step is read as a Q4_K superblock is (4 words, then 32 in one 128-byte load a row) and split
        into its 36 words in the threads that hold the row, each block's d and qs taken from them (_q40_block):
        loads of each 18-byte block where it lies, in pieces of 4 bytes, made its GEMMs 1.2-2.3x slower (H100).
        A gate/up product of BLOCK_N == STACK_ROWS rows a program takes its gate rows and their up
        rows as one tile of 2 BLOCK_N rows (_gemm_rows), the same sums in one product a step."""
        FIVE: tl.constexpr = QTYPE == 13
        IQ4: tl.constexpr = QTYPE == 23
        Q40: tl.constexpr = QTYPE == 2
        SB: tl.constexpr = 34 if IQ4 else 44 if FIVE else 36  # words a superblock (gemv_q4k8c_kernel's)
        STACK: tl.constexpr = GLU and BLOCK_N == STACK_ROWS
        PARTS: tl.constexpr = 2 if GLU and not STACK else 1  # tiles a step: gate and up, or one
        R: tl.constexpr = 2 * BLOCK_N if STACK else BLOCK_N  # rows of a tile
        rows, offs, w32 = _gemm_rows(w_ptr, N, row_words, BLOCK_N, STACK)
        i4 = tl.arange(0, 4)[None, :]
        acc = (tl.zeros([R, 16], dtype=tl.float32), tl.zeros([R, 16], dtype=tl.float32))
        lo, hi = _k_range(K // 256, SPLIT)
        tab = _iq4_registers(K) if IQ4 else None
        for sb in tl.range(lo, hi, num_stages=STAGES):
            heads = ()
            for s in tl.static_range(PARTS):
                if Q40:  # 8 blocks in 36 words: the first 4 here, the other 32 below, each a column [R]
                    base = tl.multiple_of(offs[s] + sb * SB, 4)[:, None]
                    heads += ((base, _words(tl.load(w32 + base + i4))),)
                elif IQ4:  # d, the scales' high bits, their low bits
                    base = tl.multiple_of(offs[s] + sb * SB, 2)[:, None]
                    w0, w1 = tl.split(tl.load(w32 + base + tl.arange(0, 2)[None, :]))
                    heads += ((base, _half2(w0, True)[0], w0 >> 16, w1),)
                else:
                    base = tl.multiple_of(offs[s] + sb * SB, 4)[:, None]
                    w0, w1, w2, w3 = _words(tl.load(w32 + base + i4))
                    d, dmin = _half2(w0, True)
                    heads += ((base, d, dmin, d * -8388608.0, dmin * -8388608.0,
                               (w1 & 0x3F3F3F3F, (w3 & 0x0F0F0F0F) | ((w1 >> 2) & 0x30303030)),
                               (w2 & 0x3F3F3F3F, ((w3 >> 4) & 0x0F0F0F0F) | ((w2 >> 2) & 0x30303030))),)
            quarters = ()
            fifths = ()
            for s in tl.static_range(0 if IQ4 else PARTS):  # the last 128 bytes (Q4_K, Q5_K: qs), in one load a row
                q4 = tl.load(w32 + heads[s][0] + SB - 32 + tl.arange(0, 32)[None, :])
                if Q40:  # the step's 36 words
                    quarters += (heads[s][1] + _columns(q4),)
                else:
                    lo2, hi2 = tl.split(tl.permute(tl.reshape(q4, [R, 2, 2, 8]), (0, 3, 1, 2)))
                    a0, a1 = tl.split(lo2)
                    b0, b1 = tl.split(hi2)
                    quarters += ((a0, b0, a1, b1),)
                    if FIVE:  # qh word c: the fifth bits of the weights of each quarter's word c
                        fifths += (tl.load(w32 + heads[s][0] + 4 + tl.arange(0, 8)[None, :]),)
            for p in tl.static_range(4):
                for h in tl.static_range(2):
                    xt, xd, xs = _x_block(q_ptr, ds_ptr, K, 8 * sb + 2 * p + h)
                    nxt = ()
                    for s in tl.static_range(PARTS):
                        if Q40:
                            d, q4 = _q40_block(quarters[s], 2 * p + h)
                            isum = _nibble_dot(q4 & 0x0F0F0F0F, (q4 >> 4) & 0x0F0F0F0F, xt, ASM)
                            a = tl.fma(isum.to(tl.float32), d[:, None] * xd[None, :], acc[s])
                            nxt += (tl.fma(8.0 * d[:, None], -xs[None, :], a),)
                        elif IQ4:
                            _, d, sh, sl = heads[s]
                            j = 2 * p + h
                            ds = d * (_f(((sl >> (4 * j)) & 0xF) | (((sh >> (2 * j)) & 3) << 4)) - 32.0)
                            qs = tl.load(w32 + heads[s][0] + 2 + 4 * j + i4)  # its 16 bytes
                            lo4, hi4 = _iq4_levels(qs, ASM, True, tab)
                            isum = _nibble_dot(lo4, hi4, xt, ASM)
                            nxt += (tl.fma(isum.to(tl.float32), ds[:, None] * xd[None, :], acc[s]),)
                        else:
                            _, d, dmin, d_off, dmin_off, scs, mns = heads[s]
                            ds = _byte_times(scs[p // 2], 2 * (p % 2) + h, d, d_off)
                            dm = _byte_times(mns[p // 2], 2 * (p % 2) + h, dmin, dmin_off)
                            nib = (quarters[s][p] >> (4 * h)) & 0x0F0F0F0F
                            if FIVE:
                                nib = nib | (((fifths[s] >> (2 * p + h)) & 0x01010101) << 4)
                            isum = tl.dot(_bytes(nib, ASM), xt, out_dtype=tl.int32)
                            a = tl.fma(isum.to(tl.float32), ds[:, None] * xd[None, :], acc[s])
                            nxt += (tl.fma(dm[:, None], -xs[None, :], a),)
                    acc = nxt if PARTS == 2 else (nxt[0], acc[1])
        acc = _unstacked(acc, STACK)
        _finish(y_ptr, ws_ptr, cnt_ptr, (tl.trans(acc[0]), tl.trans(acc[1])), rows, M, N, stride_y, GLU, SPLIT)

    @triton.jit
    def skinny_q8_0_kernel(q_ptr, ds_ptr, w_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K, row_words, stride_y,
                           GLU: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, ASM: tl.constexpr):
        """Q8_0 times a few rows of int8 x (quantize_x), as its GEMV computes: per block of 32 the int8 dot of
        its bytes in BLOCK_N rows with the x block on integer tensor cores, scaled by d xd. A step takes 4
        blocks (136 bytes, 8-byte aligned as rows are 16-byte aligned); blocks 0 and 2 start 2 bytes into a
        word, their words joined from two. Where 512 | K, skinny_q8_0w_kernel takes its place."""
        rows, offs, w32 = _gemm_rows(w_ptr, N, row_words, BLOCK_N)
        j8 = tl.arange(0, 8)[None, :]
        acc = (tl.zeros([BLOCK_N, 16], dtype=tl.float32), tl.zeros([BLOCK_N, 16], dtype=tl.float32))
        lo, hi = _k_range(K // 128, SPLIT)
        for g in range(lo, hi):
            for blk in tl.static_range(4):
                xt, xd, _ = _x_block(q_ptr, ds_ptr, K, 4 * g + blk)
                nxt = ()
                for s in tl.static_range(2 if GLU else 1):
                    base = tl.multiple_of(offs[s] + g * 34, 2) + 17 * (blk // 2)  # the word of the pair's first d
                    if blk % 2 == 0:
                        d, _ = _half2(tl.load(w32 + base), True)
                        at = w32 + base[:, None] + j8
                        qw = (tl.load(at) >> 16) | (tl.load(at + 1) << 16)
                    else:
                        _, d = _half2(tl.load(w32 + base + 8), True)
                        qw = tl.load(w32 + base[:, None] + 9 + j8)
                    isum = tl.dot(_bytes(qw, ASM), xt, out_dtype=tl.int32)
                    nxt += (tl.fma(isum.to(tl.float32), d[:, None] * xd[None, :], acc[s]),)
                acc = nxt if GLU else (nxt[0], acc[1])
        _finish(y_ptr, ws_ptr, cnt_ptr, (tl.trans(acc[0]), tl.trans(acc[1])), rows, M, N, stride_y, GLU, SPLIT)

    @triton.jit
    def _chunks4(t):
        """The 4 8-word chunks of a word tile t [R, 32], in order, each [R, 8]."""
        lo, hi = tl.split(tl.permute(tl.reshape(t, [t.shape[0], 2, 2, 8]), (0, 3, 2, 1)))  # [R, 8, c0, c1]
        c0, c1 = tl.split(lo)
        c2, c3 = tl.split(hi)
        return c0, c1, c2, c3

    @triton.jit
    def skinny_q8_0w_kernel(q_ptr, ds_ptr, w_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K, row_words, stride_y,
                            GLU: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, ASM: tl.constexpr,
                            STAGES: tl.constexpr, STACK_ROWS: tl.constexpr = 0):
        """Q8_0 times a few rows of int8 x on integer tensor cores, its weights read in runs of 128 bytes a row
        (8 lanes a row, 4 rows a warp's load): a step takes 16 blocks of each row, 544 bytes (16-byte aligned),
        as 17 chunks of 32 bytes. x comes laid out as a Q8_0 row (quantize_x's tail: zeros under each d), so a
        chunk and x's chunk at the same offset line up: in chunk c the bytes before 2 c are block c - 1's, the
        rest block c's. Block b's integer sum, the int8 dots of chunk b with x's part from 2 b and of chunk
        b + 1 with x's part before 2 b + 2, is then scaled by d xd, as the GEMV's are. STACK_ROWS: as
        skinny_q4k8's."""
        STACK: tl.constexpr = GLU and BLOCK_N == STACK_ROWS
        PARTS: tl.constexpr = 2 if GLU and not STACK else 1  # tiles a step: gate and up, or one
        R: tl.constexpr = 2 * BLOCK_N if STACK else BLOCK_N  # rows of a tile
        rows, offs, w32 = _gemm_rows(w_ptr, N, row_words, BLOCK_N, STACK)
        m = tl.arange(0, 16)
        pos = tl.arange(0, 32)[:, None]
        xrow = q_ptr + 16 * K + m[None, :] * tl.multiple_of(K // 32 * 34, 16) + pos  # [32, 16] a chunk
        acc = (tl.zeros([R, 16], dtype=tl.float32), tl.zeros([R, 16], dtype=tl.float32))
        lo, hi = _k_range(K // 512, SPLIT)
        for g in tl.range(lo, hi, num_stages=STAGES):
            ats = ()
            chunks = ()
            for s in tl.static_range(PARTS):
                at = w32 + tl.multiple_of(offs[s] + g * 136, 4)[:, None]
                ats += (at,)
                chunks += (_chunks4(tl.load(at + tl.arange(0, 32)[None, :])),)
            xnext = tl.load(xrow + 544 * g)
            for b in tl.static_range(16):
                if b % 4 == 3:  # chunk b + 1 starts the next 128 bytes (or is the step's last 32)
                    more = ()
                    for s in tl.static_range(PARTS):
                        if b == 15:
                            more += (chunks[s] + (tl.load(ats[s] + 128 + tl.arange(0, 8)[None, :]),),)
                        else:
                            more += (chunks[s] + _chunks4(tl.load(ats[s] + 8 * (b + 1) + tl.arange(0, 32)[None, :])),)
                    chunks = more
                xb = xnext
                xnext = tl.load(xrow + 544 * g + 32 * (b + 1))
                xd, _ = _x_scales(ds_ptr, 16 * g + b)
                nxt = ()
                for s in tl.static_range(PARTS):
                    dword = tl.load(w32 + offs[s] + g * 136 + 8 * b + b // 2)  # block b's d: step byte 34 b
                    d, _ = _half2(dword >> (16 * (b % 2)), True)
                    isum = tl.dot(_bytes(chunks[s][b], ASM), tl.where(pos >= 2 * b, xb, 0), out_dtype=tl.int32)
                    isum += tl.dot(_bytes(chunks[s][b + 1], ASM), tl.where(pos < 2 * b + 2, xnext, 0),
                                   out_dtype=tl.int32)
                    nxt += (tl.fma(isum.to(tl.float32), d[:, None] * xd[None, :], acc[s]),)
                acc = nxt if PARTS == 2 else (nxt[0], acc[1])
        acc = _unstacked(acc, STACK)
        _finish(y_ptr, ws_ptr, cnt_ptr, (tl.trans(acc[0]), tl.trans(acc[1])), rows, M, N, stride_y, GLU, SPLIT)

    @triton.jit
    def _words_from(w32, base, k0: tl.constexpr, n: tl.constexpr, odd):
        """[R, n] 32-bit words of bytes 4 k0 .. of superblocks that start at word base [R] (odd: 2 bytes later)."""
        at = w32 + base[:, None] + k0 + tl.arange(0, n)[None, :]
        a = tl.load(at)
        if odd:
            a = (a >> 16) | (tl.load(at + 1) << 16)
        return a

    @triton.jit
    def _minus32(P):
        """Each byte b (< 64) of the words P as the int8 b - 32: every byte lifted by 0x80 first, so that no
        subtraction borrows from the byte above."""
        return ((P | 0x80808080) - 0x20202020) ^ 0x80808080

    @triton.jit
    def skinny_q6k8_kernel(q_ptr, ds_ptr, w_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K, row_words, stride_y,
                           GLU: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, ASM: tl.constexpr,
                           STAGES: tl.constexpr):
        """Q6_K times a few rows of int8 x (quantize_x) on integer tensor cores, as its GEMV computes: a quarter
        of a half superblock (weights 128 h2 + 32 mq + l) is one x block; its values q - 32 in BLOCK_N rows, as
        int8, are dotted with the block's two halves (the other half zeroed) for its two sub-blocks of 16,
        whose int32 sums are weighted by their int8 scales in integers, then scaled by xd; d once a
        superblock. Superblocks in pairs from 4-byte boundaries (512 | K), odd ones' words assembled from two."""
        rows, offs, w32 = _gemm_rows(w_ptr, N, row_words, BLOCK_N)
        pos = tl.arange(0, 32)[:, None]
        c = tl.arange(0, 32)[None, :]  # x's block as [32, 32]: its rows' first halves, then their second halves
        xcols = q_ptr + (c % 16) * K + pos
        xhalf = (pos < 16) == (c < 16)
        acc = (tl.zeros([BLOCK_N, 16], dtype=tl.float32), tl.zeros([BLOCK_N, 16], dtype=tl.float32))
        lo, hi = _k_range(K // 512, SPLIT)
        for sb2 in tl.range(lo, hi, num_stages=STAGES):
            for odd in tl.static_range(2):
                sb = 2 * sb2 + odd
                heads = ()
                for s in tl.static_range(2 if GLU else 1):
                    base = offs[s] + sb2 * 105 + 52 * odd
                    scw = _words(_words_from(w32, base, 48, 4, odd).to(tl.int32, bitcast=True))  # 16 int8 scales
                    dword = tl.load(w32 + base + 52)  # d: bytes 208, 209 (of an odd one: the word's high half)
                    d, _ = _half2(dword >> 16 if odd else dword, True)
                    heads += ((base, scw, d),)
                part = (tl.zeros([BLOCK_N, 16], dtype=tl.float32), tl.zeros([BLOCK_N, 16], dtype=tl.float32))
                for h2 in tl.static_range(2):
                    bits = ()
                    for s in tl.static_range(2 if GLU else 1):  # low 4 bits in ql bytes 64 h2 + 32 (mq % 2) + l,
                        base = heads[s][0]  # high 2 in bits 2 mq of qh byte 32 h2 + l
                        bits += ((_words_from(w32, base, 16 * h2, 8, odd), _words_from(w32, base, 16 * h2 + 8, 8, odd),
                                  _words_from(w32, base, 32 + 8 * h2, 8, odd)),)
                    for mq in tl.static_range(4):
                        j = 8 * sb + 4 * h2 + mq
                        x2 = tl.load(xcols + 32 * j, mask=xhalf, other=0)
                        xd, _ = _x_scales(ds_ptr, j)
                        nxt = ()
                        for s in tl.static_range(2 if GLU else 1):
                            qb = _bytes(_minus32(_q6_bits(bits[s][mq % 2], bits[s][2], mq)), ASM)
                            sw = heads[s][1][2 * h2 + mq // 2]  # scales 8 h2 + 2 mq, + 1: its bytes 2 (mq % 2), + 1
                            sc_lo = (sw << (24 - 16 * (mq % 2))) >> 24
                            sc_hi = (sw << (16 - 16 * (mq % 2))) >> 24
                            ilo, ihi = tl.split(tl.permute(tl.reshape(tl.dot(qb, x2, out_dtype=tl.int32),
                                                                      [BLOCK_N, 2, 16]), (0, 2, 1)))
                            isum = ilo * sc_lo[:, None] + ihi * sc_hi[:, None]
                            nxt += (tl.fma(isum.to(tl.float32), xd[None, :], part[s]),)
                        part = nxt if GLU else (nxt[0], part[1])
                nxt = ()
                for s in tl.static_range(2 if GLU else 1):
                    nxt += (tl.fma(part[s], heads[s][2][:, None], acc[s]),)
                acc = nxt if GLU else (nxt[0], acc[1])
        _finish(y_ptr, ws_ptr, cnt_ptr, (tl.trans(acc[0]), tl.trans(acc[1])), rows, M, N, stride_y, GLU, SPLIT)

    for helper in (_dp4a, _prmt, _iq4_table, _iq4_registers, _iq4_pairs, _iq4_levels, _iq4_bytes,
                   _assignment, _lane_rows, _lane_superblocks, _store_lane_rows, _prefetch_rows, _f, _words, _bf16x2,
                   _half2, _q6_bits, _funnel, _window16, _bytes, _byte_times, _x_block, _words_from,
                   _k_range, _finish, quantize_blocks, _chunks4, _minus32, _gemm_rows, _x_scales,
                   _unstacked, _columns, _joined4, _q40_block, _nibble_dot):  # called by name, as _halves is
        globals()[helper.__name__] = helper

    kernels = {"dequant": dequant_kernel, "gather": gather_kernel, "gemv": gemv_kernel, "skinny": skinny_kernel,
               "quantize_x": quantize_x_kernel, "quantize_blocks": quantize_blocks, "gemv_q4k8c": gemv_q4k8c_kernel,
               "gemv_q6k8c": gemv_q6k8c_kernel, "gemv_q8_0c": gemv_q8_0c_kernel,
               "skinny_q4k8": skinny_q4k8_kernel, "skinny_q8_0": skinny_q8_0_kernel,
               "skinny_q8_0w": skinny_q8_0w_kernel, "skinny_q6k8": skinny_q6k8_kernel}
    if not _interpreting():  # the block shapes measured on the device at first use (the runner's warm-up)
        autotune = functools.partial(triton.autotune, **_disk_cache(triton))
        kernels["gemv_tuned"] = autotune(
            [triton.Config({"BLOCK_N": b, "UNROLL": u}, num_warps=w) for b, w, u in GEMV_CONFIGS],
            key=["N", "K", "QTYPE", "GLU", "EXPERTS"])(gemv_kernel)
        for skinny in {*WORD_KERNELS.values(), "skinny_q8_0w"}:
            kernels[f"{skinny}_tuned"] = autotune(
                [triton.Config({"BLOCK_N": b, "SPLIT": k, **_loop_stages(skinny, st)}, num_warps=w,
                               num_stages=st) for b, w, st, k in WORD_SKINNY_CONFIGS],
                # by the constants that pick what a kernel computes too: no type (or stacking) takes shapes
                # another chose, in a process or from the disk
                key=["M", "N", "K", "GLU",
                     *(a for a in ("QTYPE", "STACK_ROWS") if a in kernels[skinny].arg_names)],
                prune_configs_by={"early_config_prune": functools.partial(_prune_split, skinny)})(kernels[skinny])
        for name in set(INT8_GEMVS.values()):
            kernels[f"{name}_tuned"] = autotune(
                [triton.Config({"RT": rt, "WARPS": w, "KU": ku, "KS": ks}, num_warps=w)
                 for rt, w, ku, ks in LANE_K_CONFIGS],
                key=list(LANE_K_TUNE_KEY))(kernels[name])
        kernels["skinny_tuned"] = autotune(
            [triton.Config({"BLOCK_N": b, "UNROLL": u}, num_warps=w) for b, w, u in SKINNY_CONFIGS],
            key=["M", "N", "K", "QTYPE", "GLU"])(skinny_kernel)
    return kernels


def _disk_cache(triton) -> dict:
    """triton.autotune's keywords that keep its measurements in Triton's cache directory (~/.triton/cache,
    $TRITON_CACHE_DIR; Triton 3.4 and later), keyed by the kernel's source and its helpers', the tuning key and
    the configuration list: a restarted server or a second run on the same GPU chooses without measuring
    again (an 8B Q4_K_M target's decode shapes took 88 s to tune on the H200, its 16-row verify 335 s more)."""
    import inspect

    return {"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters else {}


def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def _table(device: torch.device) -> torch.Tensor:
    """IQ4_XS's 16 non-linear levels, on the device (kernels of other types ignore it)."""
    return torch.tensor(IQ4_VALUES, dtype=torch.int8, device=device)


def _check(data: torch.Tensor, qtype: int, cols: int) -> None:
    """The kernels read whole 256-column tiles of whole blocks: anything else would read past a row."""
    block, size = BLOCKS[qtype]
    assert cols % TILE == 0 and data.dtype == torch.uint8 and data.dim() == 2, (qtype, cols, data.shape)
    assert data.shape[1] == cols // block * size and data.stride(1) == 1, (qtype, cols, data.shape)


def dequantize(data: torch.Tensor, qtype: int, cols: int) -> torch.Tensor:
    """A [rows, row_bytes] uint8 matrix of GGUF blocks -> float32 [rows, cols]."""
    rows = data.shape[0]
    _check(data, qtype, cols)
    out = torch.empty(rows, cols, dtype=torch.float32, device=data.device)
    block_n = 128 if _interpreting() else 8  # the interpreter's cost is per program, not per element
    _build()["dequant"][(cdiv(rows, block_n), cols // TILE)](data, _table(data.device), out, rows, cols,
                                                             data.stride(0), QTYPE=qtype, BLOCK_N=block_n)
    return out


def gather(data: torch.Tensor, qtype: int, cols: int, tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `tokens` of a quantized embedding table, dequantized: [*tokens.shape, cols] in dtype."""
    _check(data, qtype, cols)
    flat = tokens.reshape(-1).contiguous()
    out = torch.empty(flat.numel(), cols, dtype=dtype, device=data.device)
    if flat.numel():
        _build()["gather"][(flat.numel(),)](flat, data, _table(data.device), out, cols, data.stride(0), QTYPE=qtype)
    return out.view(*tokens.shape, cols)


#: (rows of W per program, warps) the device tries at first use: the GEMV's (few rows, many programs to
#: stream the weight) and the few-row GEMM's; the interpreter takes the first of each
#: (rows of W per program, warps, 256-column tiles in flight); the interpreter takes the first. No 2-warp
#: GEMV: on the H200 (Triton 3.6) every 2-warp configuration of 2+ rows gave wrong Q4_K products (relative
#: error ~1, bench/results/quant-sweep-h200-unroll.json) while the interpreter and 4+ warps were exact
GEMV_CONFIGS = [(2, 4, 4), (1, 4, 4), (2, 4, 8), (4, 4, 4), (4, 4, 8), (8, 4, 4), (8, 8, 4), (16, 8, 1)]
SKINNY_CONFIGS = [(32, 4, 2), (16, 4, 2), (32, 4, 4), (16, 4, 4), (64, 4, 2), (32, 8, 4), (64, 4, 1), (32, 4, 1)]
#: the lanes-along-K GEMVs' (gemv_q4k8c_kernel, gemv_q6k8c_kernel, gemv_q8_0c_kernel): (rows a thread takes,
#: warps, steps (of 4 superblocks, or 32 16-byte chunks) loaded at once, warps that share a row's steps). Of
#: six shapes with warps sharing rows, swept on an H100 over the 8B shape's matrices
#: (bench/results/quant-sweep-lanes-k-split-h100.json), one beat every other shape: (1, 4, 1, 2) on Q8_0's
#: down, 12288 columns, 22.5 us against 24.3 ((2, 4, 1, 2) tied on Q4_K's LM head, 118.9 us against 118.9)
LANE_K_CONFIGS = [(4, 2, 1, 1), (2, 4, 1, 1), (1, 4, 1, 1), (4, 4, 1, 1), (2, 2, 1, 1), (1, 4, 2, 1), (2, 4, 2, 1),
                  (1, 2, 2, 1), (2, 2, 2, 1), (1, 4, 4, 1), (1, 2, 4, 1), (4, 2, 2, 1), (8, 2, 1, 1), (1, 4, 1, 2)]
#: the lanes-along-K GEMVs' tuning key (with, as Triton adds, their tensors' dtypes): _word_gemv keys the
#: shapes it had the tuner choose without prefetching by it too
LANE_K_TUNE_KEY = ("N", "K", "GLU", "QTYPE", "EXPERTS")

#: the word GEMMs' (skinny_q4k8, skinny_q6k8, skinny_q8_0, skinny_q8_0w): (rows of W per program, warps, stages,
#: K slices). A few rows over a small matrix make few programs: K slices multiply them (_finish)
WORD_SKINNY_CONFIGS = [(64, 4, 2, 1), (64, 4, 2, 2), (64, 4, 2, 4), (64, 4, 2, 8), (32, 4, 2, 4), (128, 4, 2, 1),
                       (128, 4, 2, 4), (64, 4, 1, 1), (64, 4, 1, 4), (64, 4, 1, 8), (64, 2, 2, 1), (64, 2, 2, 4),
                       (32, 2, 2, 8), (128, 4, 1, 2), (64, 4, 3, 4), (64, 4, 3, 8), (64, 2, 3, 1),
                       (64, 4, 3, 1), (32, 4, 3, 1), (32, 4, 2, 1)]
#: (64, 4, 3, 4) .. (64, 4, 3, 1): skinny_q4k8 best at them on an H100 (q/k/v, o and down at (64, 4, 3, 4), the
#: LM head at (64, 2, 3, 1)); 28 shapes swept at 16 rows (bench/results/quant-sweep-gemm-configs-h100.json):
#: (64, 4, 3, 1) took Q4_K's 24576 x 4096 as one product in 34.6 us against 38.8 at the best of the others;
#: every other Q4_K / Q6_K / Q8_0 product's best of the 28 was listed already. The last two: the stacked
#: gate/up GEMMs' (GLU_STACK_ROWS)

#: the gate/up GEMMs of Q4_K, Q5_K and Q8_0 (skinny_q4k8, skinny_q8_0w) at blocks of this many rows stack
#: each block's gate rows and their up rows into one tile of twice as many rows, one tensor-core product a
#: step: twice the programs of 64-row blocks, so a 12288-row gate/up spreads evenly over 132 multiprocessors.
#: 16 rows on an H100, fused as the decoder calls them (bench/results/stacked-glu-sweep-h100.json,
#: stacked-glu-sweep-q8_0-h100.json): Q4_K 35.1 us at (32, 4, 3, 1) against 37.2 at the best unstacked
#: shape swept, Q5_K 39.6 against 42.5, Q8_0 89.2 at (32, 4, 2, 1) against 106.4. 0 stacks none (the tuners key
#: by it, so an A/B of it takes each setting's own shapes).
GLU_STACK_ROWS = 32
SPLIT_PROGRAMS = 1024  # K slices only while the programs stay within this many (the workspace with them)


def _loop_stages(word: str, stages: int) -> dict:
    """The STAGES of the word GEMMs but skinny_q8_0: their K loops pipelined over that many stages, every load
    in them included (superblock headers, d's and x's scales too, which Triton's pipeliner leaves synchronous
    in a loop without the attribute). With its 128-byte loads, skinny_q4k8's 16-row products took 12-21% less
    time on an H100 (bench/results/skinny-q4k-wide-h100.json), skinny_q8_0w's 17-24% less than
    skinny_q8_0's (bench/results/skinny-q8_0-wide-h100.json). skinny_q6k8 wants 2: a stage of 64 rows holds
    each odd superblock's words twice and each x block as [32, 32], 75 KB of shared memory at 2 stages and 134
    at 3 (Triton 3.6, sm_90; skinny_q4k8 18-33), 3 programs a multiprocessor or 1; its LM head took 431.7 us
    against 545.5 at 16 rows (bench/results/quant-sweep-gemm-configs-h100.json)."""
    return {} if word == "skinny_q8_0" else {"STAGES": stages}


#: the columns of W a word GEMM's K loop takes a step: a superblock (Q4_K), two (Q6_K), 16 or 4 blocks of 32 (Q8_0)
GEMM_STEP_COLUMNS = {"skinny_q4k8": 256, "skinny_q6k8": 512, "skinny_q8_0w": 512, "skinny_q8_0": 128}


def _split_fits(name: str, block_n: int, split: int, n: int, k: int) -> bool:
    steps = k // GEMM_STEP_COLUMNS[name]
    return split == 1 or (cdiv(n, block_n) * split <= SPLIT_PROGRAMS and split <= steps)


def _prune_split(name: str, configs, named_args, **kwargs):
    return [c for c in configs if _split_fits(name, c.kwargs["BLOCK_N"], c.kwargs["SPLIT"], named_args["N"],
                                              named_args["K"])]


LANES = 2  # products that may run at once on a device (quant.SEGMENTS_SIDE_BY_SIDE: a stream and a second)


def _counters(device: torch.device, lane: int = 0) -> torch.Tensor:
    """The split GEMMs' arrival counts, one per block of rows: zero between products (the last slice resets
    its own), so one buffer serves every product that runs after another; products run side by side take
    different lanes. Every lane is made at the first call, so that none is first made inside a graph's
    capture (whose zeros would be written only when that graph is replayed)."""
    return _count_lanes(device)[lane]


@functools.cache
def _count_lanes(device: torch.device) -> torch.Tensor:
    return torch.zeros(LANES, SPLIT_PROGRAMS, dtype=torch.int32, device=device)


#: the types with a 1-row GEMV of their own on 32-bit words and int8 x (quantize_x), as llama.cpp's GPU
#: products do: dp4a over bytes in place of float arithmetic per weight (against float x:
#: bench/results/quant-sweep-int8-x-h200.json), all with lanes along K (LANE_K_CONFIGS); their names in _build()
INT8_GEMVS = {Q4_K: "gemv_q4k8c", Q5_K: "gemv_q4k8c", Q6_K: "gemv_q6k8c", Q8_0: "gemv_q8_0c", IQ4_XS: "gemv_q4k8c",
              Q4_0: "gemv_q4k8c"}
#: the types with a few-row GEMM of their own on 32-bit words, on int8 x (X_ROWS rows of quantize_x's) and
#: integer tensor cores, as their GEMVs compute (Q8_0's is skinny_q8_0w where 512 | K: _word_kernel). Q6_K's
#: (skinny_q6k8) ran as fast as the float-tile kernel it replaced on an H100, 16 rows: the LM head 435.5 us
#: against 432.8, down 52.3 against 55.2, a fused q/k/v 22.6 against 21.0 (bench/results/skinny-q6k-int8-x-h100.json).
#: Q5_K's runs in Q4_K's kernel (QTYPE 13), as its GEMV does, in place of the byte kernel on float x (which
#: computed a verify differently from its int8-x decode); a random 8B-shaped Q5_K_M verify of 16 rows took
#: 5.520 ms against 17.028 on an H100 (bench/results/q5k-word-gemm-ab-h100.json)
WORD_KERNELS = {Q4_K: "skinny_q4k8", Q5_K: "skinny_q4k8", Q6_K: "skinny_q6k8", Q8_0: "skinny_q8_0",
                IQ4_XS: "skinny_q4k8", Q4_0: "skinny_q4k8"}
X_ROWS = 16
#: the programs of a 1-row word GEMV whose rows start within this many bytes of W (of the gate rows, with
#: GLU) ask their rows into L2 before they wait for the kernel ahead (_prefetch_rows; 0: none): the first
#: of its weights stream while the norm or attention before it finishes. Q4_K_M 8B shape, H100, ms a 1-row
#: step (bench/results/gemv-prefetch-ab-h100.json): 0 2.559 / 2.560, 1 MiB 2.506, 2 MiB 2.488, 4 MiB 2.503 /
#: 2.505, 8 MiB 2.604, 16 MiB 2.692; every program prefetching its rows 2.782 / 2.800 against 2.579 / 2.586.
#: There the tuner had chosen each GEMV's block shape without prefetching (the first setting was 0), as
#: _word_gemv has it choose now: on another H100, shapes chosen with 2 MiB prefetching took 2.538 / 2.537 ms
#: with it and 2.784 / 2.788 without, where main's step ranged 2.53-2.59 over this session's machines. With
#: shapes chosen so, one H100: Q4_K_M 2.504 / 2.502 against 2.526 / 2.527, Q8_0 3.525 / 3.515 against 3.617
#: (bench/results/gemv-prefetch-plain-tuning-h100.json)
GEMV_PREFETCH = 2 ** 21
#: quantized experts on the word GEMVs (int8 x) where their type has one, else all on the byte kernel (float
#: x): a random 30B-A3B Q4_K_M step took 1.998 ms against 3.006 on the H200
#: (bench/results/moe-30b-Q4_K_M-word-gemvs-h200.json; tools/pdl_ab.py --knob ...EXPERT_WORD_GEMVS)
EXPERT_WORD_GEMVS = True


def _word_kernel(qtype: int, rows: int, cols: int, nbytes: int = 0) -> str | None:
    """The word kernel for this product over a matrix of nbytes (one expert's), if any. Q6_K's
    210-byte superblocks lie anywhere in 16-byte chunks: its GEMV reads the chunks around them from the
    matrix's start, its rows at any even byte, with int32 byte offsets (nbytes < 2 GiB); its GEMM takes
    superblocks in pairs from 4-byte boundaries (512 | cols). Q8_0's GEMM takes blocks in sixteens (512 | cols,
    skinny_q8_0w), else in fours (128 | cols); its lanes-along-K GEMV reads each block's d through int32
    offsets in float16 units (nbytes < 4 GiB)."""
    if qtype == Q6_K and ((rows > 1 and cols % 512) or (rows == 1 and nbytes >= 2 ** 31)):
        return None
    if qtype == Q8_0 and rows > 1 and cols % 128:
        return None
    if qtype == Q8_0 and rows > 1 and cols % 512 == 0:
        return "skinny_q8_0w"
    if qtype == Q8_0 and rows == 1 and nbytes >= 2 ** 32:
        return None
    return (INT8_GEMVS if rows == 1 else WORD_KERNELS).get(qtype)


def configs(qtype: int, rows: int, cols: int, n: int) -> list[tuple[int, ...]]:
    """The block shapes a product of `rows` rows over a `qtype` matrix of n rows is tried with (for sweeps)."""
    word = _word_kernel(qtype, rows, cols, n * cols // BLOCKS[qtype][0] * BLOCKS[qtype][1])
    if word:
        if rows == 1:
            return LANE_K_CONFIGS
        return [c for c in WORD_SKINNY_CONFIGS if _split_fits(word, c[0], c[3], n, cols)]
    return GEMV_CONFIGS if rows == 1 else SKINNY_CONFIGS


def int8_x(qtype: int, rows: int, cols: int, nbytes: int = 0) -> bool:
    """Whether this product (over a matrix of nbytes) computes with x quantized by quantize_x in place of x."""
    return _word_kernel(qtype, rows, cols, nbytes) is not None


def x8_buffers(rows: int, k: int, device) -> tuple[tuple[torch.Tensor, ...], int, int]:
    """Where quantize_x's result for [rows, k] goes: ((q, d, s), MP, SUMS); q flat, its MP rows (k apart)
    then their copies in Q8_0's row layout (k / 32 * 34 bytes apart)."""
    mp, sums = (1, 16) if rows == 1 else (X_ROWS, 32)
    assert rows <= mp, rows
    return ((torch.empty(mp * (k + k // 32 * 34), dtype=torch.int8, device=device),
             torch.empty(k // 32, mp, 2 if rows > 1 else 1, dtype=torch.float32, device=device),
             torch.empty(k // 16 if rows == 1 else 1, dtype=torch.float32, device=device)), mp, sums)


def x8_result(buffers: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """x8_buffers' tensors as the products take them (quantize_x's return)."""
    q, d, s = buffers
    return (q, d.flatten(), s) if d.shape[1] == 1 else (q, d)


def quantize_x(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """x [M, K] -> int8 q with x ~ d * q per 32 values, and the scales d and the sums s of d * q, which the
    products' offsets (Q4_K's mins, Q6_K's -32) multiply. q [MP (K + K / 32 * 34)]: MP rows of K, then each
    laid out as a Q8_0 row with zeros for its d's. One row (MP = 1), the GEMVs' x: (q, d [K / 32],
    s [K / 16]); a few (MP = X_ROWS, zeros past M), the few-row GEMMs': (q, ds), ds [K / 32, X_ROWS, 2]
    holding each block's d and s (per 32) side by side. An x that a norm kernel already quantized
    (remember_x8) is not quantized again."""
    rows, k = x.shape
    done = recall_x8(x)
    if done is not None:
        return done
    buffers, mp, sums = x8_buffers(rows, k, x.device)
    block = 256 if _interpreting() else 32  # as in dequantize
    nb = mp * k // 32
    _build()["quantize_x"][(cdiv(nb, block),)](x.contiguous(), *buffers, rows, k // 32, mp, nb, BLOCK=block,
                                                SUMS=sums, **pdl.options(x.device))
    return x8_result(buffers)


_X8: list = []  # at most one (weak reference to a tensor, its quantize_x)


def remember_x8(x: torch.Tensor, buffers: tuple[torch.Tensor, ...]) -> None:
    """x's quantize_x, written into x8_buffers by the kernel that wrote x (a norm, attention), for the one
    product that reads x next; x is not written in between (inference tensors keep no version count to
    check it by)."""
    _X8[:] = [(weakref.ref(x), x8_result(buffers))]


def recall_x8(x: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
    """The remembered quantize_x of x [M, K] (or of the tensor it views), taken once: while that tensor
    lives no other can hold its memory."""
    if not _X8:
        return None
    ref, x8 = _X8[0]
    held = ref()
    if (held is None or held.data_ptr() != x.data_ptr() or held.dtype != x.dtype or held.numel() != x.numel()
            or not (held.is_contiguous() and x.is_contiguous())):
        return None
    _X8.clear()
    return x8


def matmul(x: torch.Tensor, data: torch.Tensor, qtype: int, n: int, glu: bool = False,
           config: tuple[int, ...] | None = None, x8: tuple | None = None,
           out: torch.Tensor | None = None, lane: int = 0) -> torch.Tensor:
    """x [M, K] @ W^T for a quantized W of n rows ([n, row_bytes]; with glu 2n rows, gate then up, and
    the result silu(gate) * up [M, n]). config: one of configs()' block shapes, for sweeps. x8: x's
    quantize_x, where the caller shares it between products. out: where to write it, [M, n] with unit
    column stride (a fused q/k/v's columns of one segment). lane: which count buffer its K slices take
    (_counters); two products running side by side on two streams take different ones. The 1-row GEMVs
    launch with PDL (pdl.py), the few-row GEMMs without: with it a Q4_K_M verify window measured 8% slower
    on the H200 (5.75 ms against 5.32) while its decode step gained 12%."""
    rows, k = x.shape
    _check(data, qtype, k)
    x = x.contiguous()
    y = torch.empty(rows, n, device=x.device, dtype=x.dtype) if out is None else out
    assert y.shape == (rows, n) and y.dtype == x.dtype and y.stride(1) == 1, (y.shape, y.dtype, y.stride())
    kernels = _build()
    word = _word_kernel(qtype, rows, k, data.numel())
    tuned = config is None and f"{word}_tuned" in kernels
    if word and rows == 1:
        _word_gemv(word, x8 or quantize_x(x), data, y, qtype, n, k, data.stride(0), glu, config)
        return y
    if word:
        shapes = [config] if config else WORD_SKINNY_CONFIGS[:None if tuned else 1]
        partials = max([2 * 16 * sp * cdiv(n, b) * b for b, _, _, sp in shapes
                        if sp > 1 and _split_fits(word, b, sp, n, k)] or [1])  # the workspace the slices need
        common = (y, torch.empty(partials, dtype=torch.float32, device=x.device), _counters(x.device, lane), rows,
                  n, k, data.stride(0) // 4)
        args = (*(x8 or quantize_x(x)), data, *common, y.stride(0))
        extra = {"GLU": glu, "ASM": not _interpreting(), **({"QTYPE": qtype} if word == "skinny_q4k8" else {}),
                 **({"STACK_ROWS": GLU_STACK_ROWS} if word in ("skinny_q4k8", "skinny_q8_0w") else {})}
        if tuned:
            kernels[f"{word}_tuned"][lambda meta: (cdiv(n, meta["BLOCK_N"]), meta["SPLIT"])](*args, **extra)
        else:
            block_n, warps, stages, split = shapes[0]
            assert _split_fits(word, block_n, split, n, k), (word, shapes[0], n, k)
            kernels[word][(cdiv(n, block_n), split)](*args, BLOCK_N=block_n, SPLIT=split, num_warps=warps,
                                                     num_stages=stages, **_loop_stages(word, stages), **extra)
        return y
    tab = _table(x.device)
    name = "gemv" if rows == 1 else "skinny"
    args = (x, data, tab, y, n, k, data.stride(0), data, 0, 0, 0) if rows == 1 else \
        (x, data, tab, y, rows, n, k, data.stride(0), x.stride(0), y.stride(0))
    extra = pdl.options(x.device) if rows == 1 else {"BLOCK_M": max(16, pow2(rows)), "PRECISION": precision(x)}
    _byte_kernel(name, n, 1, args, config or (GEMV_CONFIGS if rows == 1 else SKINNY_CONFIGS)[0], config is None,
                 QTYPE=qtype, GLU=glu, **extra)
    return y


def _word_gemv(word: str, x8: tuple, data: torch.Tensor, y: torch.Tensor, qtype: int, n: int, k: int,
               row_bytes: int, glu: bool, config: tuple[int, ...] | None, programs: int = 1, **experts) -> None:
    """The 1-row word GEMV `word` (INT8_GEMVS) on x8 (quantize_x's): its tuned variant where the device has
    it and no config is given, else at config (or the first of its list). programs along axis 1 with
    experts (the kernels' EXPERTS arguments: _assignment)."""
    kernels = _build()

    def covered(meta) -> int:  # rows of W a program takes (with GLU: gate rows, each with its up row)
        return meta["RT"] * meta["WARPS"] // meta["KS"]

    if word == "gemv_q8_0c":  # in place of the sums, x laid out as Q8_0 rows (quantize_x's q after its K values)
        q, d = x8[:2]
        x8 = (q, d, q[d.numel() * 32:])
    args = (*x8, data, y, n, k, row_bytes if word == "gemv_q6k8c" else row_bytes // 4)  # its rows: any even byte
    extra = {"GLU": glu, "ASM": not _interpreting(), "QTYPE": qtype, "PREFETCH": 0 if experts else GEMV_PREFETCH,
             **experts, **pdl.options(y.device)}
    if config is None and f"{word}_tuned" in kernels:
        tuner = kernels[f"{word}_tuned"]
        grid = lambda meta: (cdiv(n, covered(meta)), programs)  # noqa: E731
        if extra["PREFETCH"]:  # products over experts never prefetch
            named = {"N": n, "K": k, "GLU": glu, "QTYPE": qtype, "EXPERTS": False}
            shape = (*(named[name] for name in LANE_K_TUNE_KEY), *(a.dtype for a in args if hasattr(a, "dtype")))
            plain = vars(tuner).setdefault("strata_chosen_plain", set())  # shapes it chose without prefetching
            if shape not in plain:
                # the tuner times a product alone, where a prefetch has no kernel ahead to overlap: it chooses
                # as without prefetching (GEMV_PREFETCH's figures were measured so)
                tuner[grid](*args, **{**extra, "PREFETCH": 0})
                plain.add(shape)
        tuner[grid](*args, **extra)
        return
    rt, warps, ku, ks = config or LANE_K_CONFIGS[0]
    meta = {"RT": rt, "WARPS": warps, "KU": ku, "KS": ks}
    kernels[word][(cdiv(n, covered(meta)), programs)](*args, **meta, num_warps=warps, **extra)


def _byte_kernel(name: str, n: int, programs: int, args: tuple, config: tuple[int, ...], tune: bool,
                 **extra) -> None:
    """The byte kernel `name` (gemv or skinny) over n rows of W, `programs` along axis 1: where tune and the
    device has it, its tuned variant; else at config (BLOCK_N, num_warps, UNROLL)."""
    kernels = _build()
    if tune and f"{name}_tuned" in kernels:
        kernels[f"{name}_tuned"][lambda meta: (cdiv(n, meta["BLOCK_N"]), programs)](*args, **extra)
    else:
        block_n, warps, unroll = config
        kernels[name][(cdiv(n, block_n), programs)](*args, BLOCK_N=block_n, UNROLL=unroll, num_warps=warps, **extra)


def expert_matmul(x: torch.Tensor, data: torch.Tensor, qtype: int, n: int, ids: torch.Tensor, share: int = 1,
                  glu: bool = False, config: tuple[int, ...] | None = None) -> torch.Tensor:
    """A window's (row, expert) assignments over stacked quantized experts, one GEMV each: data [E, rows,
    row_bytes] (each expert's n rows, with glu its n gate rows then its n up rows), ids [A] the experts,
    x [A / share, K] (assignment a reads row a // share). Returns [A, n] (with glu silu(gate) * up).
    Only the experts named are read; the ids stay on the device (CUDA-graph safe). Where the type has a
    1-row word GEMV for these experts, that kernel runs it (EXPERTS) on x quantized row by row (int8_x),
    as a dense product of one row would; else the generic byte kernel on float x. config: the chosen
    kernel's block shape (configs(qtype, 1, ...))."""
    rows, k = x.shape
    _check(data[0], qtype, k)
    assert ids.numel() == rows * share and data.is_contiguous(), (ids.shape, rows, share)
    x = x.contiguous()
    y = torch.empty(ids.numel(), n, device=x.device, dtype=x.dtype)
    word = _word_kernel(qtype, 1, k, data[0].numel()) if EXPERT_WORD_GEMVS else None
    if word:  # the rows laid end to end: each quantized as one row is (its blocks never straddle rows)
        _word_gemv(word, quantize_x(x.view(1, -1)), data, y, qtype, n, k, data.stride(1), glu, config,
                   ids.numel(), ids_ptr=ids.contiguous(), expert_bytes=data.stride(0), stride_y=y.stride(0),
                   EXPERTS=True, SHARE=share)
        return y
    args = (x, data, _table(x.device), y, n, k, data.stride(1), ids.contiguous(), data.stride(0), x.stride(0),
            y.stride(0))
    _byte_kernel("gemv", n, ids.numel(), args, config or GEMV_CONFIGS[0], config is None, QTYPE=qtype, GLU=glu,
                 EXPERTS=True, SHARE=share, **pdl.options(x.device))
    return y
