"""DSpark's addition to the drafter, as llama.cpp's `dflash` graph runs it: a low-rank Markov head chaining each
slot's draft to the token before it, out[i] = logits[i] + markov_w2 . markov_w1[previous token], the previous
token of the first slot being the anchor. Its logits are the raw ones (no logit scale or softcap). By default
(sample_from_anchor) the anchor's own slot drafts the first token, so a block of W-1 rows drafts W-1 tokens."""

from __future__ import annotations

import torch
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
