"""A round's rules: how much of a proposal the target accepts, and which token follows.

Every rule returns the round's outcome as one device tensor [a, next, c1..c(W-1)]: the accepted count,
the token that follows the accepted prefix, and the candidates. The decode loop reads it with a single
host transfer per round. An acceptor is the rule a request decodes by (acceptor()): greedy acceptance runs
inside the verify step, captured with it; speculative sampling runs on the verify step's logits after it,
since its parameters and generator change with each request. Tree verification walks its tree greedily
(tree.walk)."""

from __future__ import annotations

import torch

from .sampling import SamplingParams, process, sample

#: the `next` of an outcome whose target logits were not finite (NaN, or +inf): the decode loop stops there
NOT_FINITE = -1


def finite_or_flagged(outcome: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
    """outcome [a, next, ...] with next set to NOT_FINITE unless finite (a 0-d bool, on the device: the
    flag travels with the round's one host read)."""
    return torch.cat([outcome[:1], torch.where(finite, outcome[1:2], NOT_FINITE), outcome[2:]])


def greedy_accept(target_logits: torch.Tensor, candidates: torch.Tensor,
                  limit: torch.Tensor | None = None) -> torch.Tensor:
    """target_logits: [W, V] over [anchor, c1..c(W-1)]; candidates: [W-1]. The longest prefix of the
    candidates equal to the target's argmax, then the target's own token after it (NOT_FINITE where a
    row's largest logit is NaN or inf: max propagates NaN). limit [1]: the candidates proposed (a draft cut
    short on the device, --draft-p-min); the rest are verified but never accepted."""
    top, best = target_logits.max(-1)
    n = candidates.shape[0]
    a = (candidates == best[:n]).to(torch.int64).cumprod(0).sum().view(1)
    if limit is not None:
        a = torch.minimum(a, limit)
    return finite_or_flagged(torch.cat([a, best.gather(0, a), candidates]), torch.isfinite(top).all())


def speculative_accept(p: torch.Tensor, candidates: torch.Tensor, q: torch.Tensor | None,
                       gen: torch.Generator, limit: torch.Tensor | None = None) -> torch.Tensor:
    """Lossless speculative sampling (Leviathan et al.; Chen et al.).

    p: [W, V] target probabilities over [anchor, c1..c(W-1)]; candidates: [W-1]; q: [W-1, V] the
    distributions the candidates were drawn from, or None when they were chosen deterministically
    (one-hot q). Accept c_i with probability min(1, p_i(c_i) / q_i(c_i)); at the first rejection
    draw from normalize(max(0, p_i - q_i)); if all are accepted draw the bonus from p_(W-1) (the
    same formula with a zero q row). limit [1]: the candidates proposed (a draft cut short on the device);
    past it q is a zero row, so the token at the cut is drawn from p, as after a draft of that length. No
    value is read back to the host."""
    n, vocab = candidates.shape[0], p.shape[-1]
    rows = torch.arange(n, device=p.device)
    if q is None:
        q = torch.zeros(n, vocab, device=p.device, dtype=p.dtype)
        q[rows, candidates] = 1.0
    p_c = p[rows, candidates]
    q_c = q[rows, candidates]
    u = torch.rand(n, generator=gen, device=p.device)
    a = (u * q_c < p_c).to(torch.int64).cumprod(0).sum().view(1)
    q_rows = torch.cat([q, torch.zeros(1, vocab, device=p.device, dtype=q.dtype)])
    if limit is not None:
        a = torch.minimum(a, limit)
        q_rows = q_rows * (torch.arange(n + 1, device=p.device) < limit)[:, None]
    p_a = p.index_select(0, a)
    residual = (p_a - q_rows.index_select(0, a)).clamp_min(0)
    # p == q on this row leaves an empty residual: then p itself is the right law
    residual = torch.where(residual.sum() > 0, residual, p_a)
    return finite_or_flagged(torch.cat([a, sample(residual, gen), candidates]), torch.isfinite(p.sum(-1)).all())


class Greedy:
    """The target's argmax decides (greedy_accept); the verify step computes it, so a captured step holds it."""

    def __call__(self, logits: torch.Tensor, candidates: torch.Tensor, q=None, limit=None) -> torch.Tensor:
        return greedy_accept(logits, candidates, limit)


class Sampled:
    """Lossless speculative sampling (speculative_accept) of one request: its parameters and generator."""

    def __init__(self, params: SamplingParams, gen: torch.Generator):
        self.params, self.gen = params, gen

    def __call__(self, logits: torch.Tensor, candidates: torch.Tensor, q: torch.Tensor | None,
                 limit: torch.Tensor | None = None) -> torch.Tensor:
        return speculative_accept(process(logits, self.params), candidates, q, self.gen, limit)


GREEDY = Greedy()


def acceptor(params: SamplingParams, gen: torch.Generator | None):
    """The rule a request's rounds accept by."""
    return GREEDY if params.greedy else Sampled(params, gen)
