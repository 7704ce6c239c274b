"""Prompt lookup (n-gram) drafting: propose what followed the latest earlier occurrence of the
sequence's last n tokens. No model, no training; strong on inputs that repeat themselves."""

from __future__ import annotations

import torch

from .drafter import Commit, Drafter, DraftRequest, Proposal


class PromptLookupDrafter(Drafter):
    name = "prompt-lookup"
    max_window = 256  # any number of candidates can be looked up; the verify window's cost bounds it
    default_window = 8

    def __init__(self, max_ngram: int = 3, device="cpu", min_ngram: int = 1):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.device = device
        self.history: list[int] = []

    def reset(self) -> None:
        self.history = []

    def observe(self, commit: Commit) -> None:
        del self.history[commit.start:]
        self.history.extend(commit.tokens)

    def lookup(self, seq: list[int], n: int) -> list[int]:
        for size in range(min(self.max_ngram, len(seq) - 1), self.min_ngram - 1, -1):
            suffix = seq[-size:]
            for start in range(len(seq) - size - 1, -1, -1):  # latest earlier occurrence first
                if seq[start:start + size] == suffix:
                    follow = seq[start + size: start + size + n]
                    if follow:
                        return follow
        return []

    def propose(self, req: DraftRequest) -> Proposal:
        seq = self.history[:req.pos] + [req.anchor]
        found = self.lookup(seq, req.n)
        found = found + [found[-1] if found else req.anchor] * (req.n - len(found))
        return Proposal(torch.tensor(found, dtype=torch.long, device=self.device))
