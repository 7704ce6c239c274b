"""Deciding how much of a proposal the target accepts."""

from __future__ import annotations

import torch


def greedy_accept(target_logits: torch.Tensor, candidates: torch.Tensor) -> tuple[int, int, list[int]]:
    """target_logits: [W, V] over [anchor, c1..c(W-1)]; candidates: [W-1].

    Returns (a, bonus, candidates as a list): the longest prefix of candidates equal to the target's
    argmax, the target's own token after it, and the candidates, all in one host transfer."""
    best = target_logits.argmax(-1)
    n = candidates.shape[0]
    matches = (candidates == best[:n]).to(torch.int64)
    a_t = matches.cumprod(0).sum()
    values = torch.cat([a_t.view(1), best.gather(0, a_t.view(1)), candidates]).tolist()
    return values[0], values[1], values[2:]


def speculative_accept(p: torch.Tensor, candidates: torch.Tensor, q: torch.Tensor | None,
                       gen: torch.Generator) -> tuple[int, int]:
    """Lossless speculative sampling (Leviathan et al.; Chen et al.).

    p: [W, V] target probabilities over [anchor, c1..c(W-1)]; candidates: [W-1]; q: [W-1, V] the
    distributions the candidates were drawn from, or None when they were chosen deterministically
    (one-hot q). Accept c_i with probability min(1, p_i(c_i) / q_i(c_i)); at the first rejection
    draw from normalize(max(0, p_i - q_i)); if all are accepted draw the bonus from p_(W-1).
    Returns (accepted count a, the token that follows them)."""
    n = candidates.shape[0]
    if n:
        rows = torch.arange(n, device=p.device)
        p_c = p[rows, candidates]
        q_c = q[rows, candidates] if q is not None else torch.ones_like(p_c)
        u = torch.rand(n, generator=gen, device=p.device)
        ok = (u * q_c < p_c).to(torch.int64)
        a = int(ok.cumprod(0).sum().item())
    else:
        a = 0
    if a == n:
        return a, int(torch.multinomial(p[n], 1, generator=gen).item())
    if q is not None:
        residual = (p[a] - q[a]).clamp_min(0)
    else:
        residual = p[a].clone()
        residual[candidates[a]] = 0
    total = residual.sum()
    if total <= 0:  # p == q on this row: the residual is empty, p itself is the right law
        residual, total = p[a], p[a].sum()
    return a, int(torch.multinomial(residual / total, 1, generator=gen).item())
