"""The device's one-launch tree build (tree.build with fused=True): each depth's beam, the global top N, the
rows in depth order with their parents', and the ancestor rows, in one program (in torch they are ~60 small
kernels, a third of a millisecond)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rank_in(s, c, scratch_ptr, C: tl.constexpr, CH: tl.constexpr):
    """Each candidate's rank among the C candidates stored at scratch_ptr: how many score higher, ties
    going to the lower index (so ranks are distinct)."""
    rank = tl.zeros_like(c)
    for c0 in range(0, C, CH):
        o = c0 + tl.arange(0, CH)
        so = tl.load(scratch_ptr + o, cache_modifier=".cg")
        better = (so[None, :] > s[:, None]) | ((so[None, :] == s[:, None]) & (o[None, :] < c[:, None]))
        rank += tl.sum(better.to(tl.int32), axis=1)
    return rank


@triton.jit
def tree_build_kernel(steps_ptr, idx_ptr, anchor_ptr, score_ptr, slot_ptr, tok_ptr, cand_ptr, row_ptr,
                      tokens_ptr, depth_ptr, parent_ptr, anc_ptr, N, K, D: tl.constexpr, NP: tl.constexpr,
                      KP: tl.constexpr, DP: tl.constexpr, RP: tl.constexpr, CH: tl.constexpr):
    """One program: each depth's beam of N (ranked, best first), the global top N over all beams, the
    rows in depth order with their parents' rows, and the ancestor rows by walking up the parents."""
    C: tl.constexpr = NP * KP
    c = tl.arange(0, C)
    slot, j = c // KP, c % KP
    for d in range(D):
        if d == 0:
            prev = tl.where(slot == 0, 0.0, float("-inf"))
        else:
            prev = tl.load(score_ptr + (d - 1) * NP + slot, mask=slot < N, other=float("-inf"),
                           cache_modifier=".cg")
        s = prev + tl.load(steps_ptr + d * K + j, mask=j < K, other=float("-inf"))
        s = tl.where((slot < N) & (j < K), s, float("-inf"))
        tl.store(cand_ptr + c, s)
        tl.debug_barrier()
        rank = rank_in(s, c, cand_ptr, C, CH)
        keep = rank < N
        tl.store(score_ptr + d * NP + rank, s, mask=keep)
        tl.store(slot_ptr + d * NP + rank, slot, mask=keep)
        tl.store(tok_ptr + d * NP + rank, tl.load(idx_ptr + d * K + j, mask=j < K, other=0), mask=keep)
        tl.debug_barrier()
    G: tl.constexpr = DP * NP
    a = tl.arange(0, G)
    da, sa = a // NP, a % NP
    live = (da < D) & (sa < N)
    s = tl.load(score_ptr + a, mask=live, other=float("-inf"), cache_modifier=".cg")
    tl.store(cand_ptr + a, s)
    tl.debug_barrier()
    chosen = (rank_in(s, a, cand_ptr, G, CH) < N) & live
    row = tl.cumsum(chosen.to(tl.int32), axis=0)  # 1-based in (depth, rank) order: row 0 is the anchor
    tl.store(row_ptr + a, row, mask=chosen)
    tl.debug_barrier()
    up = tl.load(slot_ptr + a, mask=chosen, other=0, cache_modifier=".cg")
    par = tl.load(row_ptr + (da - 1) * NP + up, mask=chosen & (da > 0), other=0, cache_modifier=".cg")
    tl.store(tokens_ptr + row, tl.load(tok_ptr + a, mask=chosen, other=0, cache_modifier=".cg"), mask=chosen)
    tl.store(depth_ptr + row, (da + 1).to(tl.int64), mask=chosen)
    tl.store(parent_ptr + row, par.to(tl.int64), mask=chosen)
    tl.store(tokens_ptr, tl.load(anchor_ptr))
    tl.store(depth_ptr, tl.zeros((), dtype=tl.int64))
    tl.store(parent_ptr, tl.zeros((), dtype=tl.int64))
    r = tl.arange(0, RP)
    rows = N + 1
    tl.store(anc_ptr + r[:, None] * rows + r[None, :], tl.zeros([RP, RP], dtype=tl.int8),
             mask=(r[:, None] < rows) & (r[None, :] < rows))
    tl.debug_barrier()
    cur = r
    for _ in range(D + 1):  # every row marks itself, its parent, ... up to the anchor (its own parent)
        tl.store(anc_ptr + r * rows + cur, tl.full([RP], 1, dtype=tl.int8), mask=r < rows)
        cur = tl.load(parent_ptr + cur, mask=r < rows, other=0, cache_modifier=".cg").to(tl.int32)
