"""Tree verification (DDTree, arXiv 2604.12989): the drafter's per-position distributions of one pass give
a tree of candidate continuations instead of a chain; the target verifies every node in one forward
under an ancestor-only mask and its own argmax walks the tree, so the output stays the target's.

All of it runs on the device in static shapes (no host value read), so the runner captures it in a
CUDA graph per budget:
- `build`: the N best prefixes by cumulative log-probability over the per-depth top-k. The best-first
  search the paper describes (pop the best node, push its next sibling and its first child) selects
  exactly the N highest-scoring prefixes, since a prefix scores at least as high as any extension of it;
  a beam of N per depth holds every prefix that can be among them, and a global top-N picks them.
- `walk`: the accepted path, following the target's argmax from the anchor through the children.
Row 0 of a tree is the anchor (depth 0); rows 1..N are nodes in order of depth."""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: tokens each depth offers the search (the paper's per-position top-k)
TOP_K = 8
#: a prefix's score falls by at least this per depth, so ties never rank a node above its parent
DEPTH_PENALTY = 1e-4


@dataclass
class Tree:
    tokens: torch.Tensor  # [N+1] int64: the anchor, then each node's token
    depth: torch.Tensor  # [N+1] int64: 0 for the anchor
    parent: torch.Tensor  # [N+1] int64: the parent's row (the anchor is its own)
    ancestors: torch.Tensor  # [N+1, N+1] bool: row j is an ancestor of row i, or i itself


def largest_budget(depths: int, top_k: int = TOP_K) -> int:
    """The most nodes a tree of this depth can hold with top_k tokens a depth."""
    return sum(top_k ** d for d in range(1, depths + 1))


def build(anchor: torch.Tensor, logits: torch.Tensor, budget: int, top_k: int = TOP_K) -> Tree:
    """anchor [1]; logits [D, V] the drafter's for depths 1..D; budget N nodes (at most largest_budget)."""
    depths, _ = logits.shape
    dev = logits.device
    k = min(top_k, logits.shape[-1])
    logq = torch.log_softmax(logits.float(), dim=-1)
    vals, idx = torch.topk(logq, k, dim=-1)  # [D, k]
    # depth 0: the anchor alone (no item assignment: a Python scalar written into a CUDA tensor is a host
    # copy, which CUDA-graph capture refuses)
    beam = torch.where(torch.arange(budget, device=dev) == 0, 0.0, float("-inf"))
    steps = vals - DEPTH_PENALTY
    scores, picks = [], []
    for d in range(depths):  # an unsorted top-N a depth; the tokens and parents are read off all picks after
        beam, pick = torch.topk((beam[:, None] + steps[d][None, :]).reshape(-1), budget, sorted=False)
        scores.append(beam)
        picks.append(pick)
    score, pick = torch.stack(scores), torch.stack(picks)  # [D, N] each
    tokens = idx.gather(1, pick % k)
    parents = pick // k  # the slot in the previous depth's beam
    chosen = torch.topk(score.reshape(-1), budget, sorted=False).indices
    chosen = chosen[torch.argsort(chosen)]  # by depth, then beam slot: parents come before children
    d_of, slot_of = chosen // budget, chosen % budget
    row_of = torch.full((depths, budget), -1, dtype=torch.long, device=dev)
    row_of[d_of, slot_of] = torch.arange(1, budget + 1, device=dev)
    parent_slot = parents[d_of, slot_of]
    parent = torch.where(d_of == 0, 0, row_of[(d_of - 1).clamp_min(0), parent_slot])
    parent = torch.cat([torch.zeros(1, dtype=torch.long, device=dev), parent])
    rows = budget + 1
    node = torch.arange(rows, device=dev)
    anc = ((node[:, None] == node[None, :]) | ((parent[:, None] == node[None, :]) & (node[:, None] > 0))).float()
    for _ in range(max(depths - 1, 0).bit_length()):  # squaring: ancestors up to twice as far back each time
        anc = (anc @ anc).clamp_max_(1.0)
    anc = anc > 0
    return Tree(torch.cat([anchor, tokens[d_of, slot_of]]),
                torch.cat([torch.zeros(1, dtype=torch.long, device=dev), d_of + 1]), parent, anc)


def walk(tree: Tree, best: torch.Tensor, depths: int) -> torch.Tensor:
    """The accepted path: from the anchor, the child whose token is the target's argmax at its parent,
    while there is one. best [N+1] the target's argmax per row. Returns [a, next, r_1..r_D] (int64):
    the accepted depth, the target's token after the path, and the path's rows (0 past the path).

    A node is on the path when it and all its ancestors carry the argmax of their parents; siblings
    hold distinct tokens, so at most one node a depth is."""
    dev = best.device
    node = torch.arange(tree.tokens.shape[0], device=dev)
    good = (tree.tokens == best.index_select(0, tree.parent)) | (node == 0)  # the anchor is given
    on_path = ~(tree.ancestors & ~good[None, :]).any(-1)
    a = on_path.sum() - 1
    slot = torch.where(on_path, tree.depth, depths + 1)  # off-path nodes land in a spare slot
    path = torch.zeros(depths + 2, dtype=torch.long, device=dev).scatter_(0, slot, torch.where(on_path, node, 0))
    last = path.gather(0, a.view(1))
    return torch.cat([a.view(1), best.gather(0, last), path[1:depths + 1]])
