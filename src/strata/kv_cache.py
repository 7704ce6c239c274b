"""Preallocated, position-addressed key/value cache.

Cell t of a layer holds the key and value of position t. Nothing is ever reallocated or copied:
writing a window stores its cells, and rolling back only lowers `length`, so stale cells past it are
simply overwritten when those positions are written again.
"""

from __future__ import annotations

import torch

CELL_ALIGN = 64


def aligned_cells(n: int) -> int:
    """n cells rounded up to a multiple of CELL_ALIGN. Attention reads a static step's cells as one
    matrix; with an odd row length cuBLAS can only take its unaligned kernels (5x slower on the H200
    at 785 cells)."""
    return -(-n // CELL_ALIGN) * CELL_ALIGN


class KVCache:
    def __init__(self, num_layers: int, max_len: int, kv_heads: int, head_dim: int, device, dtype):
        shape = (num_layers, max_len, kv_heads, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.max_len = max_len
        self.length = 0

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        end = start + k.shape[0]
        self.k[layer, start:end] = k
        self.v[layer, start:end] = v

    def scatter(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store rows of k/v at the cells named by a device tensor (no host value read: graph-safe)."""
        self.k[layer].index_copy_(0, positions, k)
        self.v[layer].index_copy_(0, positions, v)

    def read(self, layer: int, end: int, begin: int = 0):
        return self.k[layer, begin:end], self.v[layer, begin:end]

    def commit(self, length: int) -> None:
        """Declare positions < length valid (after a window was written)."""
        if not 0 <= length <= self.max_len:
            raise ValueError(f"cache length {length} outside 0..{self.max_len}")
        self.length = length

    rollback = commit

    def reset(self) -> None:
        self.length = 0
