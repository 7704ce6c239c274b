"""x quantized to int8 per 32 values for the products that take int8 x (the word GEMVs and GEMMs), in the
layouts they read: by a launch of its own (quantize_x), or by the norm or attention kernel that wrote x
(norms.py, attention.py), which hands it on with x (strategy.Activation)."""

from __future__ import annotations

import torch

from . import pdl
from .common import cdiv, interpreting

X_ROWS = 16  # the rows of the few-row GEMMs' x (fewer are padded with zeros); the kernels' tiles assume it


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
    holding each block's d and s (per 32) side by side."""
    from .jit_x8 import quantize_x_kernel

    rows, k = x.shape
    buffers, mp, sums = x8_buffers(rows, k, x.device)
    block = 256 if interpreting() else 32  # the interpreter's cost is per program, not per element
    nb = mp * k // 32
    quantize_x_kernel[(cdiv(nb, block),)](x.contiguous(), *buffers, rows, k // 32, mp, nb, BLOCK=block, SUMS=sums,
                                          **pdl.options(x.device))
    return x8_result(buffers)
