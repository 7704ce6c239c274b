"""Tree verification (DDTree, arXiv 2604.12989): the drafter's per-position distributions of one pass give
a tree of candidate continuations instead of a chain; the target verifies every node in one forward
under an ancestor-only mask and its own argmax walks the tree, so the output stays the target's.

All of it runs on the device in static shapes (no host value read), so the runner captures it in CUDA
graphs: the build with the drafter's pass, the verify and the walk as the target's step.
- `build`: the N best prefixes by cumulative log-probability over the per-depth top-k. The best-first
  search the paper describes (pop the best node, push its next sibling and its first child) selects
  exactly the N highest-scoring prefixes, since a prefix scores at least as high as any extension of it;
  a beam of N per depth holds every prefix that can be among them, and a global top-N picks them. On a
  GPU the beams, the selection and the ancestor rows are one Triton launch (in torch they are ~60 small
  kernels, a third of a millisecond).
- `beam_tree`: the same search where a node's children depend on its own token (DFlash2's selector scores a
  slot's candidates after the token before them: dflash2.CandidateSelector.tree), in torch.
- `walk`: the accepted path, following the target's argmax from the anchor through the children.
Row 0 of a tree is the anchor (depth 0); rows 1..N are nodes in order of depth."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..layers.kernels.common import pow2

#: tokens each depth offers the search (the paper's per-position top-k)
TOP_K = 8
#: a prefix's score falls by at least this per depth, so ties never rank a node above its parent
DEPTH_PENALTY = 1e-4
#: the score of a step whose log-probability is NaN or -inf
UNLIKELY = -1e30


@dataclass
class Tree:
    tokens: torch.Tensor  # [N+1] int64: the anchor, then each node's token
    depth: torch.Tensor  # [N+1] int64: 0 for the anchor
    parent: torch.Tensor  # [N+1] int64: the parent's row (the anchor is its own)
    ancestors: torch.Tensor  # [N+1, N+1] bool: row j is an ancestor of row i, or i itself


def largest_budget(depths: int, top_k: int = TOP_K) -> int:
    """The most nodes a tree of this depth can hold with top_k tokens a depth."""
    return sum(top_k ** d for d in range(1, depths + 1))


def top_steps(logits: torch.Tensor, top_k: int = TOP_K) -> tuple[torch.Tensor, torch.Tensor]:
    """Each depth's top_k tokens [D, k] and their log-probabilities (float32), from the logits without writing
    the log-softmax out: the top of the logits, less their log-sum-exp."""
    logits = logits.float()
    vals, idx = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1)
    return vals - torch.logsumexp(logits, dim=-1, keepdim=True), idx


def search_steps(logprobs: torch.Tensor) -> torch.Tensor:
    """Log-probabilities as the search's step scores: less the depth penalty, and a NaN (the target's weights)
    or -inf lowest but finite, so that every node still scores below its parent and the chosen nodes keep
    their ancestors."""
    return torch.nan_to_num(logprobs - DEPTH_PENALTY, nan=UNLIKELY, neginf=UNLIKELY)


def build(anchor: torch.Tensor, logits: torch.Tensor, budget: int, top_k: int = TOP_K, fused: bool = False) -> Tree:
    """anchor [1]; logits [D, V] the drafter's for depths 1..D; budget N nodes (at most largest_budget).
    fused: the Triton kernel (a CUDA device, or the interpreter)."""
    logprobs, idx = top_steps(logits, top_k)
    steps = search_steps(logprobs)
    if fused:
        return _build_fused(anchor, steps, idx, budget)
    depths, k = steps.shape
    return beam_tree(anchor, depths, k, budget, lambda d, parents: (steps[d].expand(budget, k),
                                                                     idx[d].expand(budget, k)))


def beam_tree(anchor: torch.Tensor, depths: int, k: int, budget: int, children) -> Tree:
    """The N best prefixes, depth by depth: children(d, beam's tokens [N]) -> (each beam entry's k children's
    log-probabilities less the depth penalty [N, k], their tokens [N, k]) at depth d + 1; the anchor is the
    only entry at depth 0. A child's step may depend on its parent's token (DFlash2's selector) or not."""
    dev = anchor.device
    # depth 0: the anchor alone (no item assignment: a Python scalar written into a CUDA tensor is a host
    # copy, which CUDA-graph capture refuses)
    beam = torch.where(torch.arange(budget, device=dev) == 0, 0.0, float("-inf"))
    last = anchor.expand(budget)
    scores, picks, toks = [], [], []
    for d in range(depths):  # an unsorted top-N a depth; the tokens and parents are read off all picks after
        steps, tokens = children(d, last)
        beam, pick = torch.topk((beam[:, None] + steps).reshape(-1), budget, sorted=False)
        last = tokens.reshape(-1).gather(0, pick)
        scores.append(beam)
        picks.append(pick)
        toks.append(last)
    score, pick, tokens = torch.stack(scores), torch.stack(picks), torch.stack(toks)  # [D, N] each
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


def _build_fused(anchor: torch.Tensor, steps: torch.Tensor, idx: torch.Tensor, budget: int) -> Tree:
    depths, k = steps.shape
    dev, rows = steps.device, budget + 1
    np_, kp, dp = pow2(budget), pow2(k), pow2(depths)
    score = torch.empty(depths, np_, device=dev)
    slot = torch.empty(depths, np_, dtype=torch.int32, device=dev)
    tok = torch.empty(depths, np_, dtype=torch.long, device=dev)
    cand = torch.empty(max(np_ * kp, dp * np_), device=dev)
    row = torch.empty(dp * np_, dtype=torch.int32, device=dev)
    tokens, depth, parent = (torch.empty(rows, dtype=torch.long, device=dev) for _ in range(3))
    anc = torch.empty(rows, rows, dtype=torch.int8, device=dev)
    from .tree_kernel import tree_build_kernel

    tree_build_kernel[(1,)](steps.contiguous(), idx.contiguous(), anchor, score, slot, tok, cand, row, tokens, depth,
                    parent, anc, budget, k, D=depths, NP=np_, KP=kp, DP=dp, RP=pow2(rows), CH=32, num_warps=4)
    return Tree(tokens, depth, parent, anc.view(torch.bool))


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
