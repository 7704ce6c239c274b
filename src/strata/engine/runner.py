"""The model runner: an engine's target and drafter steps, and how they run.

It owns the target's cache and the device buffers of a round, sizes the windows, picks the kernel set,
and in the static layout captures each step in a CUDA graph. The models have one forward each; the
two layouts are only two ways of calling it:

- dynamic (the CPU default): each step attends over exactly the cells written so far, and the last
  windows shrink at the context's end.
- static (the GPU default, `--static` on the CPU): every verify runs the same number of rows at
  device-side positions and attends over a power-of-two bucket of cells under a mask, so a step's
  shapes never depend on the position. On a CUDA device each step is recorded once per bucket and
  replayed with a single launch; elsewhere the same steps simply run (the tests' CPU twin)."""

from __future__ import annotations

import time
from typing import Callable, Hashable

import torch

from ..cache import aligned_cells
from ..layers import graph_breaks
from ..layers.kernels import EAGER, TritonKernels, select_kernels
from ..layers.modules import Step
from ..models.decoder import ForwardOut
from ..models.placement import place_by_routing
from .acceptance import GREEDY, finite_or_flagged, greedy_accept
from .config import EngineConfig, Plan
from .drafter import Commit, Drafter, DraftRequest, Proposal
from .tree import Tree, build, walk


class CudaGraphs:
    """Steps over preallocated buffers, captured in CUDA graphs and replayed.

    At batch 1 a decode step is hundreds of small kernels: launched one by one from Python the launch
    overhead, not the GPU, sets the speed. A captured step only reads and writes tensors whose
    addresses never change (caches, input buffers, its own outputs). A step must be idempotent
    (running it twice on the same inputs has the effect of running it once), because capture runs it
    once for real before recording it. A step with host work inside (graph_breaks.on_host: a MoE
    layer's experts in host memory) is captured as segments in one memory pool, its host work run
    between them at each replay."""

    def __init__(self, device: torch.device, enabled: bool = True):
        self.enabled = enabled and torch.device(device).type == "cuda"
        self.graphs: dict[Hashable, tuple[list[Callable[[], None]], object]] = {}  # key: (replay's parts, result)
        self.capture_s = 0.0
        self.stream = torch.cuda.Stream() if self.enabled else None

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
            self.graphs[key] = self.capture(fn)
            self.capture_s += time.perf_counter() - t0
        return self.replay(key)

    def replay(self, key: Hashable):
        """The step captured under key, run again: its graphs and the host work between them (in inference
        mode, as captured: the host work writes into tensors made then, whoever replays it)."""
        parts, out = self.graphs[key]
        with torch.inference_mode():
            for part in parts:
                part()
        return out

    def capture(self, fn: Callable[[], object]) -> tuple[list[Callable[[], None]], object]:
        """fn recorded as its replay's parts (graphs, and the host work between them) and its result."""
        torch.cuda.synchronize()
        pool, parts = torch.cuda.graph_pool_handle(), []
        graph = torch.cuda.CUDAGraph()

        def split(fill):
            nonlocal graph
            graph.capture_end()
            parts.extend((graph.replay, fill))
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(pool=pool)

        with torch.cuda.stream(self.stream):
            graph.capture_begin(pool=pool)
            try:
                with graph_breaks.splitting(split):
                    out = fn()
            finally:
                graph.capture_end()
        parts.append(graph.replay)
        torch.cuda.synchronize()
        return parts, out


class HostCopy:
    """A small device tensor's values on their way to the host: the copy is enqueued at once (into pinned
    memory on a GPU, so later work may overwrite the tensor), and values() waits for that copy alone."""

    def __init__(self, t: torch.Tensor):
        self.device = t
        self.ready = None
        if t.is_cuda:
            self.host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self.host.copy_(t, non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record()
        else:
            self.host = t.clone()

    def values(self) -> list:
        if self.ready is not None:
            self.ready.synchronize()
        return self.host.tolist()


class ModelRunner:
    #: the parity check's stage probe (checks/parity.py's ProbedRunner sets one); None: the steps as served
    probe = None

    def __init__(self, target, drafter: Drafter, cfg: EngineConfig, plan: Plan):
        """plan: the settings resolved against this target and drafter (EngineConfig.resolve). In the static
        layout target-only decoding (W = 1) can run in windows of cfg.pad_rows rows, the anchor first and
        padding after: a GEMM row's result does not depend on the other rows, but it can depend on their
        number, so in bfloat16 a 1-row decode and a W-row verify round differently and greedy choices at
        near-ties can flip. With pad_rows = W, target-only runs in the verify's shapes and DFlash output equals
        it token for token at any precision (on a GPU the extra rows are nearly free: the weights are
        streamed once either way)."""
        window = plan.window
        self.target, self.drafter, self.window = target, drafter, window
        self.max_len, self.rows = plan.max_len, plan.rows
        self.static = cfg.static
        self.tree = cfg.tree  # tree verification: nodes per round (the anchor adds a row)
        dev = target.device
        spare = self.static or self.tree is not None  # rows that may sit past the context for a moment
        self.cache = target.make_cache(aligned_cells(self.max_len + self.rows) if spare else self.max_len,
                                       rows=self.rows)
        self.graphs = CudaGraphs(dev, enabled=cfg.graphs)
        self.kernels = select_kernels(dev, cfg.backend, cfg.attention, cfg.kernels)
        self.anchor = torch.zeros(1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)
        self.candidates = torch.zeros(window - 1, dtype=torch.long, device=dev)
        self.limit = torch.full((1,), max(window - 1, 0), dtype=torch.long, device=dev)  # candidates proposed
        self.padding = torch.zeros(max(0, self.rows - window), dtype=torch.long, device=dev)
        self.row_tokens = torch.zeros(self.rows, dtype=torch.long, device=dev)  # a verify's, for observe
        self.offsets = torch.arange(self.rows, device=dev)
        self.tree_inputs: Tree | None = None
        self.rate = cfg.reads_confidence is not None  # proposals carry their confidences only where read

    def window_at(self, pos: int) -> int:
        """Tokens verified by the round at pos: fixed in the static layout (cells past the context are
        spare), shrinking at the context's end in the dynamic one. A tree keeps its depth (its cache has
        spare cells)."""
        return self.window if self.static or self.tree is not None else min(self.window, self.max_len - pos)

    def kv_len(self, pos: int, rows: int) -> int:
        """Cells the steps of a round at pos read: exactly those written (dynamic), or the power of two
        (at least 256) that holds them (static: a handful of captured graphs serve every length)."""
        if not self.static:
            return pos + (self.rows if self.tree is not None else rows)
        return min(self.bucket(pos + self.rows), self.cache.cells)

    @staticmethod
    def bucket(end: int) -> int:
        b = 256
        while b < end:
            b *= 2
        return b

    def reset(self) -> None:
        self.cache.reset()
        self.drafter.reset()

    def prefill_rows(self, n: int) -> int:
        """Rows of a prefill chunk for a prompt of n tokens: attention scores of one chunk (rows x n per
        head, float32 where the kernel materialises them) stay within a fixed budget, so prefill memory
        grows linearly with the prompt."""
        budget = (1 << 30) if self.target.device.type == "cuda" else (256 << 20)
        return max(64, budget // (4 * n * self.target.cfg.num_heads))

    def prefill(self, prompt_ids: list[int]):
        """The prompt through the target in chunks (eager, whatever the layout); the drafter observes each.
        A target whose experts are placed by "prefill" then settles them (models/placement.py). Returns
        the ForwardOut: the last row's logits [1, vocab] and every row's taps."""
        dev, n = self.target.device, len(prompt_ids)
        tokens = torch.tensor(prompt_ids, dtype=torch.long, device=dev)
        positions = torch.arange(n, device=dev)
        rows = self.prefill_rows(n)
        logits, taps = None, []
        for start in range(0, n, rows):
            end = min(n, start + rows)
            out = self.target(tokens[start:end], Step(positions[start:end], end, EAGER), self.cache,
                              self.drafter.tap_layers, logits="last" if end == n else "none")
            logits = out.logits
            taps.append(out.taps)
            self.drafter.observe(Commit(start, list(prompt_ids[start:end]), out.taps, positions[start:end],
                                        probe=self.probe, row_tokens=tokens[start:end], kv_len=end))
        self.cache.commit(n)
        place_by_routing(self.target)
        return ForwardOut(logits, torch.cat(taps) if taps[0] is not None else None)

    def start_round(self, anchor: int, pos: int) -> None:
        self.anchor.fill_(anchor)
        self.pos.fill_(pos)

    def advance(self, outcome: torch.Tensor) -> None:
        """The device's anchor and position moved past a round's outcome [a, next, ...] without the host:
        the next round can be launched before this one's outcome is read."""
        self.anchor.copy_(outcome[1:2].clamp_min(0))  # NOT_FINITE: a round that is never read
        self.pos.add_(outcome[:1] + 1)

    def draft(self, anchor: int, pos: int, n: int, kv_len: int) -> Proposal:
        req = DraftRequest(anchor, pos, n, self.anchor, self.pos, kv_len, self.kernels, self.probe, self.rate)
        if self.static and self.drafter.on_device:
            return self.graphs.run(("draft", kv_len, n), lambda: self.drafter.propose(req))
        return self.drafter.propose(req)

    def verify(self, candidates: torch.Tensor, w: int, kv_len: int, accept=GREEDY, q: torch.Tensor | None = None,
               limit: torch.Tensor | None = None):
        """The target over [anchor, candidates, padding] at pos..: (ForwardOut, the rows' positions, the
        round's outcome [a, next, c1..] as a device tensor, by the acceptor `accept`; q: the distributions the
        candidates were sampled from; limit [1]: how many of them the draft proposed, where it was cut on the
        device). The step computes the greedy outcome, captured with it; another acceptor runs on its logits
        after it."""
        rows = self.rows if self.static and w == self.window else w  # a shorter (adaptive) window: no padding
        cands = self.candidates[:w - 1]
        if w > 1:
            cands.copy_(candidates)
        if limit is not None:
            self.limit.copy_(limit)
        padding = self.padding[:rows - w]

        def step():
            tokens = torch.cat([self.anchor, cands, padding])
            self.row_tokens[:rows].copy_(tokens)
            positions = self.pos + self.offsets[:rows]
            out = self.target(tokens, Step(positions, kv_len, self.kernels), self.cache, self.drafter.tap_layers)
            return out, positions, greedy_accept(out.logits[:w], cands, self.limit)

        out, positions, greedy = self.graphs.run(("verify", kv_len, rows), step) if self.static else step()
        return out, positions, greedy if accept is GREEDY else accept(out.logits[:w], cands, q, self.limit)

    def draft_tree(self, anchor: int, pos: int, n: int, kv_len: int):
        """The drafter's pass and the tree built from its logits [n, V], as one step (one graph with an
        on-device drafter): the tree is the drafting, its verify only the target's step."""
        req = DraftRequest(anchor, pos, n, self.anchor, self.pos, kv_len, self.kernels, self.probe)
        fused = isinstance(self.kernels, TritonKernels)
        def step():
            proposal = self.drafter.propose(req)
            if proposal.tree is not None:  # the drafter's own (DFlash2's selector)
                return proposal.tree(self.tree)
            return build(self.anchor, proposal.logits[:n], self.tree, fused=fused)

        if self.static and self.drafter.on_device:
            return self.graphs.run(("draft", kv_len, n, "tree"), step)
        tree = step()
        if not self.graphs.enabled:
            return tree
        if self.tree_inputs is None:  # a host drafter's tree, where the captured verify reads it
            self.tree_inputs = Tree(*(torch.empty_like(t) for t in vars(tree).values()))
        for buf, t in zip(vars(self.tree_inputs).values(), vars(tree).values()):
            buf.copy_(t)
        return self.tree_inputs

    def verify_tree(self, tree, kv_len: int):
        """Tree verification: the target over all the tree's rows under the ancestor mask, its argmax walked
        down the tree, and the accepted path moved into position order: its K/V into cells pos+1.., its
        taps into rows 1... Returns (ForwardOut with the path's taps, the path's positions, the outcome
        [a, next, path tokens (D)]), all on the device."""
        depths = self.window - 1
        dev = self.target.device

        def step():  # every tensor it reads is made inside or lives on: a graph replays the addresses it saw
            cells = torch.arange(kv_len, device=dev)
            rel = (cells - self.pos).clamp(0, self.tree)
            in_tree = (cells >= self.pos) & (cells <= self.pos + self.tree)
            mask = (cells < self.pos)[None, :] | (in_tree[None, :] & tree.ancestors[:, rel])
            at = Step(self.pos + tree.depth, kv_len, self.kernels, cells=self.pos + self.offsets, masks={None: mask})
            out = self.target(tree.tokens, at, self.cache, self.drafter.tap_layers)
            top, best = out.logits.max(-1)
            outcome = finite_or_flagged(walk(tree, best, depths), torch.isfinite(top).all())
            path = torch.cat([torch.zeros(1, dtype=torch.long, device=dev), outcome[2:]])
            # a path can be longer than a small tree has rows: its own range, not self.offsets
            src, dst = self.pos + path, self.pos + torch.arange(depths + 1, device=dev)
            kv = self.cache.kv  # every layer's (trees run on attention-only targets): gathered, then written
            kv.index_copy_(-3, dst, kv.index_select(-3, src))
            taps = None if out.taps is None else out.taps.index_select(0, path)
            packed = torch.cat([outcome[:2], tree.tokens.index_select(0, outcome[2:])])
            return ForwardOut(None, taps), dst, packed

        return self.graphs.run(("tree", kv_len), step) if self.static else step()

    def observe(self, start: int, tokens: list[int], taps, positions: torch.Tensor, kv_len: int) -> None:
        """The drafter hears the round's commit; a device-side drafter's observe is captured with the
        verify whose outputs it reads."""
        commit = Commit(start, tokens, taps, positions, self.kernels, self.probe,
                        self.row_tokens[:positions.shape[0]], kv_len)
        if self.static and self.drafter.on_device:
            self.graphs.run(("observe", kv_len, positions.shape[0]), lambda: self.drafter.observe(commit))
        else:
            self.drafter.observe(commit)
