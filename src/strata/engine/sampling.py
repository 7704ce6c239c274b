"""Sampling parameters and the logits -> probabilities processing shared by target and drafter."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import StrataError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0  # 0: no limit
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)  # noqa: E731
        if not (number(self.temperature) and 0 <= self.temperature <= 100):
            raise StrataError(f"temperature must be between 0 and 100, got {self.temperature!r}", "temperature")
        if not (isinstance(self.top_k, int) and not isinstance(self.top_k, bool) and self.top_k >= 0):
            raise StrataError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}", "top_k")
        if not (number(self.top_p) and 0 < self.top_p <= 1):
            raise StrataError(f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        if self.seed is not None and not (isinstance(self.seed, int) and not isinstance(self.seed, bool)
                                          and 0 <= self.seed < 2 ** 63):
            raise StrataError(f"seed must be an integer in 0..2**63-1, got {self.seed!r}", "seed")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self, device) -> torch.Generator:
        gen = torch.Generator(device=device)
        if self.seed is None:
            gen.seed()
        else:
            gen.manual_seed(self.seed)
        return gen


def process(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[N, V] logits -> [N, V] float32 probabilities after temperature, top-k and top-p.

    The same function serves the target's p and the drafter's q, so both are restricted alike."""
    x = logits.float() / params.temperature
    vocab = x.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        sorted_p, idx = torch.sort(probs, dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass strictly above each token
        drop = before >= params.top_p  # keep the smallest prefix whose mass reaches top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, idx, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """One draw per row of [N, V] probabilities, without a host synchronisation: the index of the
    largest p_i / E_i with E_i ~ Exp(1) is distributed as p (an exponential race; zero-probability
    entries never win)."""
    race = torch.empty_like(probs).exponential_(generator=gen)
    return (probs / race).argmax(-1)
