"""The dense kernels of a decode step: the GEMV and few-row GEMM over float weights (gate/up fused), the
experts' GEMVs and down sums, and the router's top-k."""

from __future__ import annotations

import triton
import triton.language as tl

from .jit_common import settle


@triton.jit
def gemv_kernel(x_ptr, w_ptr, e_ptr, b_ptr, y_ptr, N, K, stride_x, stride_e, stride_w, stride_y, up_offset,
                HAS_BIAS: tl.constexpr, GLU: tl.constexpr, EXPERTS: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, SHARE: tl.constexpr = 1, PDL: tl.constexpr = False):
    """y = W x for output row a = program_id(1) (one row unless EXPERTS), from input row a // SHARE; with
    EXPERTS row a has its own matrix, expert e[a]'s at w + e[a] * stride_e. GLU: the up rows sit up_offset
    after the gate rows."""
    settle(PDL)
    a = tl.program_id(1).to(tl.int64)
    if EXPERTS:
        w_ptr += tl.load(e_ptr + a) * stride_e
    x_ptr += (a // SHARE) * stride_x
    y_ptr += a * stride_y
    rows = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rmask = rows < N
    cols = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + cols
        kmask = kk < K
        x = tl.load(x_ptr + kk, mask=kmask, other=0.0).to(tl.float32)
        wmask = rmask[:, None] & kmask[None, :]
        w = tl.load(w_ptr + rows[:, None] * stride_w + kk[None, :], mask=wmask, other=0.0,
                    eviction_policy="evict_first")
        acc += w.to(tl.float32) * x[None, :]
        if GLU:
            u = tl.load(w_ptr + up_offset + rows[:, None] * stride_w + kk[None, :], mask=wmask, other=0.0,
                        eviction_policy="evict_first")
            acc_up += u.to(tl.float32) * x[None, :]
    out_ty = y_ptr.dtype.element_ty
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
    if GLU:
        gate = y.to(out_ty).to(tl.float32)
        up = tl.sum(acc_up, axis=1).to(out_ty).to(tl.float32)
        y = (gate * tl.sigmoid(gate)).to(out_ty).to(tl.float32) * up
    tl.store(y_ptr + rows, y.to(out_ty), mask=rmask)


@triton.jit
def expert_down_sum_kernel(a_ptr, w_ptr, e_ptr, sw_ptr, out_ptr, N, K, stride_a, stride_e, stride_w, stride_out,
                           SLOTS: tl.constexpr, SLOTS_P2: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    """Row r = program_id(1) of the experts' weighted sum, for a block of output columns: the down GEMVs
    of its SLOTS assignments a = r * SLOTS + j (expert e[a]'s matrix over activation row a) side by side
    in one tile, each rounded as the GEMV stores it, then weighted by sw[a] and summed slot by slot in
    order, rounding as ops.sum_slots does: the sum needs no launch or pass over memory of its own."""
    settle(PDL)
    r = tl.program_id(1).to(tl.int64)
    j = tl.arange(0, SLOTS_P2)
    jmask = j < SLOTS
    a = r * SLOTS + j
    e = tl.load(e_ptr + a, mask=jmask, other=0)
    rows = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rmask = rows < N
    cols = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + e[:, None, None] * stride_e + rows[None, :, None] * stride_w
    wmask = jmask[:, None, None] & rmask[None, :, None]
    acc = tl.zeros([SLOTS_P2, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + cols
        kmask = kk < K
        x = tl.load(a_ptr + a[:, None] * stride_a + kk[None, :], mask=jmask[:, None] & kmask[None, :],
                    other=0.0).to(tl.float32)
        w = tl.load(w_rows + kk[None, None, :], mask=wmask & kmask[None, None, :], other=0.0,
                    eviction_policy="evict_first")
        acc += w.to(tl.float32) * x[:, None, :]
    out_ty = out_ptr.dtype.element_ty
    y = tl.sum(acc, axis=2).to(out_ty).to(tl.float32)
    p = (y * tl.load(sw_ptr + a, mask=jmask, other=0.0).to(tl.float32)[:, None]).to(out_ty).to(tl.float32)
    out = tl.zeros([BLOCK_N], dtype=tl.float32)
    for s in tl.static_range(SLOTS):
        out = (out + tl.sum(tl.where(j[:, None] == s, p, 0.0), axis=0)).to(out_ty).to(tl.float32)
    tl.store(out_ptr + r * stride_out + rows, out.to(out_ty), mask=rmask)


@triton.jit
def skinny_kernel(x_ptr, w_ptr, b_ptr, y_ptr, se_ptr, perm_ptr, M, N, K, stride_x, stride_w, stride_y, stride_e,
                  up_offset, HAS_BIAS: tl.constexpr, GLU: tl.constexpr, EXPERTS: tl.constexpr, KROW: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                  PDL: tl.constexpr = False):
    """y [M, N] = x [M, K] @ W^T for a few rows: each weight tile is streamed once, on tensor cores. GLU:
    the up rows sit up_offset after the gate rows. EXPERTS: the M rows are a window's (row, expert)
    assignments sorted by expert (se, perm); program (n, i) works only when assignment i is its expert's
    first, for all (up to BLOCK_M) of that expert's assignments, over expert se[i]'s matrix at
    w + se[i] * stride_e, so each expert hit is read once. Assignment a reads x row a // KROW and writes
    y row a."""
    cols = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    nmask = cols < N
    settle(PDL)
    m = tl.arange(0, BLOCK_M)
    mmask = m < M
    rows = m.to(tl.int64)
    if EXPERTS:
        i = tl.program_id(1)
        e = tl.load(se_ptr + i)
        leader = ((i == 0) | (tl.load(se_ptr + tl.maximum(i - 1, 0)) != e)).to(tl.int32)
        j = i + m
        mmask = (j < M) & (j * 0 + leader > 0)
        mmask = mmask & (tl.load(se_ptr + j, mask=mmask, other=-1) == e)
        rows = tl.load(perm_ptr + j, mask=mmask, other=0).to(tl.int64)
        nmask = nmask & (cols * 0 + leader > 0)
        w_ptr += e.to(tl.int64) * stride_e
    kr = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + kr
        kmask = kk < K
        x = tl.load(x_ptr + (rows // KROW)[:, None] * stride_x + kk[None, :], mask=mmask[:, None] & kmask[None, :],
                    other=0.0)
        wmask = kmask[:, None] & nmask[None, :]
        w = tl.load(w_ptr + cols[None, :] * stride_w + kk[:, None], mask=wmask, other=0.0,
                    eviction_policy="evict_first")
        acc = tl.dot(x, w, acc, input_precision=PRECISION)
        if GLU:
            u = tl.load(w_ptr + up_offset + cols[None, :] * stride_w + kk[:, None], mask=wmask, other=0.0,
                        eviction_policy="evict_first")
            acc_up = tl.dot(x, u, acc_up, input_precision=PRECISION)
    out_ty = y_ptr.dtype.element_ty
    y = acc
    if HAS_BIAS:
        y += tl.load(b_ptr + cols, mask=nmask, other=0.0).to(tl.float32)[None, :]
    if GLU:
        gate = y.to(out_ty).to(tl.float32)
        y = (gate * tl.sigmoid(gate)).to(out_ty).to(tl.float32) * acc_up.to(out_ty).to(tl.float32)
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], y.to(out_ty), mask=mmask[:, None] & nmask[None, :])


@triton.jit
def route_kernel(logits_ptr, w_ptr, e_ptr, E, stride_l, K: tl.constexpr, KP: tl.constexpr,
                 BLOCK_E: tl.constexpr, RENORM: tl.constexpr, PDL: tl.constexpr = False):
    """One row's routing: softmax over the experts in float32, the top K by repeated maximum (the lower
    expert id first among equals), renormalised when asked, written in ascending expert order."""
    settle(PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_E)
    valid = cols < E
    x = tl.load(logits_ptr + row * stride_l + cols, mask=valid, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    p = tl.where(valid, p / tl.sum(p, axis=0), -1.0)
    slots = tl.arange(0, KP)
    vals = tl.zeros([KP], dtype=tl.float32)
    idx = tl.full([KP], 1 << 30, dtype=tl.int32)
    for i in tl.static_range(K):
        best = tl.max(p, axis=0)
        j = tl.min(tl.where(p == best, cols, BLOCK_E), axis=0)
        vals = tl.where(slots == i, best, vals)
        idx = tl.where(slots == i, j, idx)
        p = tl.where(cols == j, -1.0, p)
    if RENORM:
        vals = vals / tl.sum(vals, axis=0)
    rank = tl.sum((idx[None, :] < idx[:, None]).to(tl.int32), axis=1)  # experts below each one
    live = slots < K
    tl.store(w_ptr + row * K + rank, vals.to(w_ptr.dtype.element_ty), mask=live)
    tl.store(e_ptr + row * K + rank, idx.to(tl.int64), mask=live)
