"""DSpark's addition to the drafter, as llama.cpp's `dflash` graph runs it: a low-rank Markov head chaining each
slot's draft to the token before it, out[i] = logits[i] + markov_w2 . markov_w1[previous token], the previous
token of the first slot being the anchor. Its logits are the raw ones (no logit scale or softcap). By default
(sample_from_anchor) the anchor's own slot drafts the first token, so a block of W-1 rows drafts W-1 tokens."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..engine.sampling import sample
from ..layers.modules import Linear


class MarkovHead(nn.Module):
    """markov_w1 [V, R] (an embedding of the previous token), markov_w2 [V, R] (back to the vocabulary), named as
    the reference checkpoint names them."""

    def __init__(self, vocab: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = Linear(rank, vocab)

    def bias(self, prev: torch.Tensor) -> torch.Tensor:
        """The logits' bias after token prev [1]: [1, V] float32."""
        return self.markov_w1.weight[prev].float() @ self.markov_w2.weight.float().T

    def chain(self, logits: torch.Tensor, anchor: torch.Tensor, pick) -> tuple[torch.Tensor, torch.Tensor]:
        """Slot by slot from the anchor [1] over the draft slots' logits [n, V]: each slot's logits biased by the
        token picked before it, and pick(row [1, V]) -> (token [1], the row [1, V] to keep). Device work only:
        (tokens [n], the kept rows [n, V])."""
        prev, tokens, kept = anchor.view(1), [], []
        for i in range(logits.shape[0]):
            prev, row = pick(logits[i:i + 1].float() + self.bias(prev))
            tokens.append(prev)
            kept.append(row)
        if not tokens:
            return anchor.new_empty(0), logits.new_empty(0, logits.shape[-1]).float()
        return torch.cat(tokens), torch.cat(kept)

    def walk(self, logits: torch.Tensor, anchor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The greedy chain, each slot's argmax the next slot's previous token: (tokens [n], the chained logits
        [n, V])."""
        return self.chain(logits, anchor, lambda row: (row.argmax(-1), row))

    def draw(self, logits: torch.Tensor, anchor: torch.Tensor, probs, gen) -> tuple[torch.Tensor, torch.Tensor]:
        """The sampled chain: each slot drawn (no host read) from q = probs of its logits biased by the token
        drawn before it, so that rejection sampling against the target stays lossless: (tokens [n], q [n, V])."""
        def pick(row):
            q = probs(row)
            return sample(q, gen), q

        return self.chain(logits, anchor, pick)

    def loss(self, logits: torch.Tensor, prev: torch.Tensor, labels: torch.Tensor):
        """Training, teacher-forced: each slot's logits [N, V] biased by its true previous token prev [N] ->
        (cross-entropy [N], whether the chain picks the true token [N], biased logits [N, V])."""
        biased = logits.float() + self.bias(prev)
        return F.cross_entropy(biased, labels, reduction="none"), biased.argmax(-1) == labels, biased


def confidence(head: nn.Module | None, markov: MarkovHead, h: torch.Tensor, chained: torch.Tensor,
               anchor: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Each slot's confidence [n]: the confidence head's sigmoid from the slot's hidden state and the token before
    it (the anchor, then the chain's picks), or without a head the chained logits' top probability."""
    if head is None:
        return torch.softmax(chained.float(), -1).amax(-1)
    prev = torch.cat([anchor.view(1), tokens[:-1]])
    return torch.sigmoid(confidence_logit(head.proj, h, markov.markov_w1.weight[prev]))


def confidence_logit(proj: nn.Linear, h: torch.Tensor, prev_code: torch.Tensor) -> torch.Tensor:
    """The confidence head before its sigmoid: how likely a slot's draft is accepted once the drafts before it
    were, from the slot's final-normed hidden state h [..., H] and markov_w1 of the token before it [..., R]
    (llama.cpp's order: h first) -> [...]."""
    x = torch.cat([h, prev_code.to(h.dtype)], -1)
    return F.linear(x.float(), proj.weight.float(), proj.bias.float() if proj.bias is not None else None).squeeze(-1)
