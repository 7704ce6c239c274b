"""The one small interface every drafter implements, so the decode loop never branches on the kind.

A round: the loop asks `propose(anchor, pos, n)` for n candidates to follow the anchor token at
position pos, verifies them, and reports the committed tokens (with the target's taps of those
positions, for drafters that want them) through `observe`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Proposal:
    tokens: torch.Tensor  # [n] int64, on the target's device
    logits: torch.Tensor | None = None  # [n, vocab] float32: the drafter's raw logits, when it has them


class Drafter:
    """Base class; also the target-only 'drafter' that proposes nothing."""

    name = "none"
    #: the largest verify window (anchor + candidates) this drafter supports
    max_window = 1
    #: HF layer ids whose residual stream the drafter wants from every target forward
    tap_layers: list[int] | None = None
    #: True for drafters whose static-layout steps work on device buffers alone:
    #: propose_static(anchor, pos, n, ctx_len, attention, kernels) -> Proposal, where ctx_len covers
    #: pos + n + 1 cells, and observe_static(taps, positions, kernels).
    #: The engine captures those in CUDA graphs; the others are asked through propose and observe
    #: with host values in either layout.
    on_device = False

    def reset(self) -> None:
        """Forget the previous sequence."""

    def observe(self, tokens: list[int], start: int, taps: torch.Tensor | None) -> None:
        """Tokens committed at positions start.. (taps: their features, rows aligned with tokens)."""

    def propose(self, anchor: int, pos: int, n: int) -> Proposal:
        raise NotImplementedError("the target-only drafter proposes nothing")


class NoDrafter(Drafter):
    pass


class OracleDrafter(Drafter):
    """Replays a known continuation: full acceptance, for benchmarks and for testing the loop."""

    name = "oracle"

    def __init__(self, sequence: list[int], max_window: int, device="cpu"):
        self.sequence = list(sequence)
        self.max_window = max_window
        self.device = device

    def propose(self, anchor: int, pos: int, n: int) -> Proposal:
        nxt = self.sequence[pos + 1: pos + 1 + n]
        nxt = nxt + [0] * (n - len(nxt))
        return Proposal(torch.tensor(nxt, dtype=torch.long, device=self.device))
