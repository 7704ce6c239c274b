"""What the word kernels (32-bit words of GGUF blocks times int8 x) share: the lanes-along-K GEMVs' rows,
experts, L2 prefetch and stores, and the few-row GEMMs' K slices, rows and x blocks."""

from __future__ import annotations

import triton
import triton.language as tl

from .jit_common import _silu_mul, prefetch_l2, settle


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
