"""Preallocated, position-addressed key/value caches.

Cell t of a layer holds the key and value of position t. Nothing is ever reallocated or copied:
writing a window stores its cells, and rolling back only lowers `length`, so stale cells past it are
simply overwritten when those positions are written again. Each layer has its own buffers (training
writes them under autograd, which tracks in-place writes per tensor)."""

from __future__ import annotations

import torch

from .errors import SettingError
from .layers.modules import LayerKV

CELL_ALIGN = 64


def aligned_cells(n: int) -> int:
    """n cells rounded up to a multiple of CELL_ALIGN. Attention reads a static step's cells as one
    matrix; with an odd row length cuBLAS can only take its unaligned kernels (5x slower on the H200
    at 785 cells)."""
    return -(-n // CELL_ALIGN) * CELL_ALIGN


def memory(device: torch.device) -> int:
    """Bytes a device has: a GPU's free memory, the host's physical memory."""
    import os

    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def kv_bytes(num_layers: int, shape: tuple, dtype) -> int:
    """Bytes of these layers' K and V, each of `shape`."""
    return 2 * num_layers * torch.Size(shape).numel() * dtype.itemsize


def refuse_unless_fits(num_layers: int, shape: tuple, device, dtype) -> SettingError:
    """A cache of these layers' K and V (each of `shape`, cells first or after the batch) is refused, not
    attempted, where the device lacks the memory: an overcommitting host would let the allocation through
    and kill the process while zeroing it. Returns the error to raise should the allocation fail anyway."""
    size = kv_bytes(num_layers, shape, dtype)
    cells = shape[-3]
    too_big = SettingError(f"a KV cache of {cells} positions ({size / 2 ** 30:.1f} GiB) does not fit in "
                           f"{torch.device(device).type} memory; give a smaller {{max_len}}")
    if size > memory(torch.device(device)):
        raise too_big
    return too_big


def step_bytes(cfg, rows: int, cells: int) -> int:
    """Bytes one forward of `rows` rows over `cells` cells holds at its peak beyond the weights and the
    cache, float32 where kernels upcast: the logits, one layer's attention scores, a tree's masks, and
    the widest activations."""
    width = max(3 * cfg.intermediate_size, 4 * cfg.hidden_size, 3 * cfg.num_heads * cfg.head_dim)
    return 4 * rows * (cfg.vocab_size + cfg.num_heads * cells + width) + rows * (rows + cells)


def refuse_rows_unless_fit(rows: int, what: str, cfg, max_len: int, device, dtype) -> None:
    """A step of `rows` rows (a verify window, or a tree's nodes and its anchor) is refused before the
    weights load when no round could run it (its rows take cells of the context after the prompt) or the
    device could not hold it beside the cache. what: the setting that asks for them (a SettingError
    template)."""
    if rows >= max_len:
        raise SettingError(f"{what}: a verify step of {rows} rows does not fit the context of {max_len} tokens "
                           f"(its rows follow at least one prompt token; {{max_len}})")
    cells = aligned_cells(max_len + rows)
    need = kv_bytes(cfg.num_layers, (cells, cfg.num_kv_heads, cfg.head_dim), dtype) + step_bytes(cfg, rows, cells)
    have = memory(torch.device(device))
    if need > have:
        raise SettingError(f"{what}: a verify step of {rows} rows and its cache need about {need / 2 ** 30:.1f} "
                           f"GiB, more than the {have / 2 ** 30:.1f} GiB of {torch.device(device).type} memory")


class KVCache:
    def __init__(self, num_layers: int, cells: int, kv_heads: int, head_dim: int, device, dtype,
                 batch: int | None = None):
        shape = (cells, kv_heads, head_dim) if batch is None else (batch, cells, kv_heads, head_dim)
        #: every layer's K and V in one tensor [2 * layers, ..., cells, kv_heads, head_dim], so moving cells
        #: (a tree's accepted path) is one gather and one scatter for the whole model. The layers' views are
        #: taken through .data: each is its own autograd leaf with its own version counter, as training
        #: writes rows that carry gradients into each layer in turn (views of one tensor would share one).
        too_big = refuse_unless_fits(num_layers, shape, device, dtype)
        try:
            self.kv = torch.zeros(2 * num_layers, *shape, device=device, dtype=dtype)
        except (RuntimeError, MemoryError) as e:  # allocation failures; anything else is not the user's
            if not isinstance(e, (MemoryError, torch.OutOfMemoryError)) and "alloc" not in str(e):
                raise
            raise too_big from None
        self.layers = [LayerKV(self.kv[2 * i].data, self.kv[2 * i + 1].data) for i in range(num_layers)]
        self.cells = cells
        self.length = 0

    def commit(self, length: int) -> None:
        """Declare positions < length valid (after a window was written)."""
        if not 0 <= length <= self.cells:
            raise ValueError(f"cache length {length} outside 0..{self.cells}")
        self.length = length

    rollback = commit

    def reset(self) -> None:
        self.length = 0
