"""The dense products of a decode step, where cuBLAS and torch.compile leave time on the table: a 1-row GEMV
with no split-K (cuBLAS splits the smaller GEMVs over K: a second reduction kernel and ~75% of copy
bandwidth on the H200), the same for a few rows on tensor cores, gate/up read side by side with silu(gate)
* up written directly, a mixture-of-experts MLP as per-assignment GEMVs reading only the experts hit (or,
for more rows, each expert hit once on tensor cores), and the routing after the router."""

from __future__ import annotations

import torch

from . import pdl
from .common import cdiv, fitting_stages, pow2, precision
from .tuning import (EXPERT_DOWN_CONFIG, EXPERT_DOWN_SUM_CONFIG, EXPERT_GEMV_MAX, EXPERT_GLU_CONFIG,
                     EXPERT_GROUP_CONFIG, EXPERT_GROUP_MIN_ROWS, GEMV_CONFIG, GEMV_GLU_CONFIG, GEMV_SHAPE_CONFIGS,
                     SKINNY_CONFIG, SKINNY_MAX_ROWS)


def projection_kernel(x: torch.Tensor, w: torch.Tensor) -> str | None:
    """The name of the kernel for x @ w^T ("gemv" for one row, "skinny" for up to SKINNY_MAX_ROWS), or
    None for other shapes and layouts."""
    if x.dim() != 2 or x.stride(1) != 1 or w.stride(1) != 1:
        return None
    if x.shape[0] == 1:
        return "gemv"
    return "skinny" if x.shape[0] <= SKINNY_MAX_ROWS else None


def gemv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, glu: bool = False,
         config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """x [1, K] @ w[N, K]^T (+ b) -> [1, N]; with glu, w stacks gate and up rows ([2I, K]) and the result
    is silu(gate) * up [1, I]."""
    from .jit_dense import gemv_kernel

    n_total, k = w.shape
    n = n_total // 2 if glu else n_total
    y = torch.empty(*x.shape[:-1], n, device=x.device, dtype=x.dtype)
    block_n, block_k, warps = config or GEMV_SHAPE_CONFIGS.get((n_total, k, glu)) or \
        (GEMV_GLU_CONFIG if glu else GEMV_CONFIG)
    gemv_kernel[(cdiv(n, block_n), 1)](
        x, w, w, b if b is not None else w, y, n, k, 0, 0, w.stride(0), 0, n * w.stride(0), HAS_BIAS=b is not None,
        GLU=glu, EXPERTS=False, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, **pdl.options(x.device))
    return y


def experts(h: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
            experts: torch.Tensor, reduce=None, grouped: bool | None = None, sum_slots=None,
            down_sums: bool = True) -> torch.Tensor:
    """ops.experts_routed's contract, for a few rows: every (row, expert) assignment a GEMV over its expert's
    gate/up (silu(gate) * up written directly), then over its down matrix, reading only the experts hit; each
    row's outputs summed in ascending expert order as ops.sum_slots sums them, by the down GEMVs themselves
    (down_sums: two launches in all), or after them by `reduce` (its contract: the host's outputs merged
    first). grouped (the default past EXPERT_GROUP_MIN_ROWS rows): each expert hit once for all its rows
    (_experts_grouped), then summed by reduce or sum_slots (default ops.sum_slots; the compiled set passes its
    fused one)."""
    from .. import ops
    from .jit_dense import expert_down_sum_kernel, gemv_kernel

    n, k = experts.shape
    flat = experts.reshape(-1).contiguous()
    summed = reduce or sum_slots or ops.sum_slots
    if grouped if grouped is not None else n > EXPERT_GROUP_MIN_ROWS:
        return summed(_experts_grouped(h, gate_up, down, flat, k), weights, h.dtype)
    _, _, inter, hidden = gate_up.shape
    h = h.contiguous()  # each row read in place by its k assignments
    act = torch.empty(n * k, inter, device=h.device, dtype=h.dtype)
    block_n, block_k, warps = EXPERT_GLU_CONFIG
    gemv_kernel[(cdiv(inter, block_n), n * k)](
        h, gate_up, flat, gate_up, act, inter, hidden, h.stride(0), gate_up.stride(1), gate_up.stride(2),
        act.stride(0), gate_up.stride(0), HAS_BIAS=False, GLU=True, EXPERTS=True, BLOCK_N=block_n, BLOCK_K=block_k,
        SHARE=k, num_warps=warps, **pdl.options(h.device))
    if reduce is None and down_sums:
        out = torch.empty(n, hidden, device=h.device, dtype=h.dtype)
        block_n, block_k, warps = EXPERT_DOWN_SUM_CONFIG
        expert_down_sum_kernel[(cdiv(hidden, block_n), n)](
            act, down, flat, weights.contiguous(), out, hidden, inter, act.stride(0), down.stride(0),
            down.stride(1), out.stride(0), SLOTS=k, SLOTS_P2=pow2(k), BLOCK_N=block_n, BLOCK_K=block_k,
            num_warps=warps, **pdl.options(h.device))
        return out
    y = torch.empty(n * k, hidden, device=h.device, dtype=h.dtype)
    block_n, block_k, warps = EXPERT_DOWN_CONFIG
    gemv_kernel[(cdiv(hidden, block_n), n * k)](
        act, down, flat, down, y, hidden, inter, act.stride(0), down.stride(0), down.stride(1), y.stride(0), 0,
        HAS_BIAS=False, GLU=False, EXPERTS=True, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
        **pdl.options(h.device))
    return summed(y.view(n, k, hidden), weights, h.dtype)


def _experts_grouped(h: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, flat: torch.Tensor,
                     k: int) -> torch.Tensor:
    """The outputs [N, k, H] of a window's (row, expert) assignments `flat` (row-major), each expert hit
    read once: the union of the rows' experts, not one copy per assignment."""
    from .jit_dense import skinny_kernel

    n = h.shape[0]
    _, _, inter, hidden = gate_up.shape
    se, perm = torch.sort(flat, stable=True)
    dup = max(16, pow2(n))  # an expert serves each row at most once
    act = torch.empty(n * k, inter, device=h.device, dtype=h.dtype)
    y = torch.empty(n * k, hidden, device=h.device, dtype=h.dtype)
    block_n, block_k, warps = EXPERT_GROUP_CONFIG
    for x, w, out, rows, cols, krow, glu in ((h, gate_up, act, inter, hidden, k, True),
                                              (act, down, y, hidden, inter, 1, False)):
        skinny_kernel[(cdiv(rows, block_n), n * k)](
            x, w, w, out, se, perm, n * k, rows, cols, x.stride(0), w.stride(-2), out.stride(0), w.stride(-3),
            w.stride(0) if glu else 0, HAS_BIAS=False, GLU=glu, EXPERTS=True, KROW=krow, BLOCK_M=dup,
            BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=precision(h), num_warps=warps, **pdl.options(h.device))
    return y.view(n, k, hidden)


def route_topk(logits: torch.Tensor, top_k: int, renormalize: bool):
    """ops.route after the router's logits [N, E], in one launch: (weights [N, k] in the logits' dtype,
    experts [N, k] int64), each row's pairs in ascending expert order."""
    from .jit_dense import route_kernel

    n, e = logits.shape
    weights = torch.empty(n, top_k, device=logits.device, dtype=logits.dtype)
    experts = torch.empty(n, top_k, device=logits.device, dtype=torch.long)
    route_kernel[(n,)](logits, weights, experts, e, logits.stride(0), K=top_k, KP=max(2, pow2(top_k)),
                       BLOCK_E=max(16, pow2(e)), RENORM=renormalize, num_warps=1, **pdl.options(logits.device))
    return weights, experts


def experts_fit(gate_up: torch.Tensor, down: torch.Tensor, experts: torch.Tensor) -> bool:
    """experts' layout: contiguous stacked matrices, few enough assignments."""
    return experts.numel() <= EXPERT_GEMV_MAX and gate_up.is_contiguous() and down.is_contiguous()


def skinny(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, glu: bool = False,
           config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """x [M, K] @ w[N, K]^T (+ b) -> [M, N] for a few rows (glu as in gemv), where cuBLAS would split K
    and reduce in a second kernel."""
    from .jit_dense import skinny_kernel

    rows, k = x.shape
    n_total = w.shape[0]
    n = n_total // 2 if glu else n_total
    y = torch.empty(rows, n, device=x.device, dtype=x.dtype)
    block_n, block_k, warps, stages = config or SKINNY_CONFIG
    block_m = max(16, pow2(rows))
    if x.element_size() == 4:
        stages = fitting_stages(stages, (block_n * (2 if glu else 1) + block_m) * block_k * 4)
    skinny_kernel[(cdiv(n, block_n), 1)](
        x, w, b if b is not None else w, y, w, w, rows, n, k, x.stride(0), w.stride(0), y.stride(0), 0,
        n * w.stride(0), HAS_BIAS=b is not None, GLU=glu, EXPERTS=False, KROW=1,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=precision(x),
        num_warps=warps, num_stages=stages, **pdl.options(x.device))
    return y
