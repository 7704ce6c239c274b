"""Deciding how much of a proposal the target accepts."""

from __future__ import annotations

import torch


def greedy_accept(target_logits: torch.Tensor, candidates: torch.Tensor) -> tuple[int, int]:
    """target_logits: [W, V] over [anchor, c1..c(W-1)]; candidates: [W-1].

    Returns (a, bonus): the longest prefix of candidates equal to the target's argmax, and the
    target's own token after it. One host sync."""
    best = target_logits.argmax(-1)
    n = candidates.shape[0]
    if n:
        matches = (candidates == best[:n]).to(torch.int64)
        a_t = matches.cumprod(0).sum()
        a_bonus = torch.stack([a_t, best.gather(0, a_t.view(1))[0]]).tolist()
        return int(a_bonus[0]), int(a_bonus[1])
    return 0, int(best[0].item())
