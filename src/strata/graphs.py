"""Steps over preallocated buffers, captured in CUDA graphs and replayed.

At batch 1 a decode step is hundreds of small kernels: launched one by one from Python the launch
overhead, not the GPU, sets the speed. A step here is a function that only reads and writes tensors
whose addresses never change (caches, input buffers, its own outputs), so on a CUDA device its kernels
are recorded once and replayed with a single launch. Elsewhere the same function simply runs: the CPU
twin executes the very code the graph records.

A step must be idempotent (running it twice on the same inputs has the effect of running it once),
because capture runs it once for real before recording it."""

from __future__ import annotations

import time
from typing import Callable, Hashable

import torch


class StepGraphs:
    def __init__(self, device: torch.device, enabled: bool = True):
        self.enabled = enabled and torch.device(device).type == "cuda"
        self.graphs: dict[Hashable, tuple[torch.cuda.CUDAGraph, object]] = {}
        self.capture_s = 0.0

    def run(self, key: Hashable, fn: Callable[[], object]):
        """fn()'s result; on CUDA from a graph captured the first time `key` is run."""
        if not self.enabled:
            return fn()
        entry = self.graphs.get(key)
        if entry is None:
            t0 = time.perf_counter()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn()  # lazy initialisation (cuBLAS workspaces, kernel selection) stays out of the graph
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = fn()
            self.graphs[key] = entry = (graph, out)
            torch.cuda.synchronize()
            self.capture_s += time.perf_counter() - t0
        graph, out = entry
        graph.replay()
        return out
