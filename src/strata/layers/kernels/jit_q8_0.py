"""Q8_0 over int8 x: the lanes-along-K GEMV and the few-row GEMMs (blocks in sixteens where 512 divides
K, else in fours)."""

from __future__ import annotations

import triton
import triton.language as tl

from .jit_common import _bytes, _dp4a, _half2, _words, settle
from .jit_word import (_assignment, _finish, _gemm_rows, _k_range, _lane_rows, _prefetch_rows, _store_lane_rows,
                       _unstacked, _x_block, _x_scales)


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
