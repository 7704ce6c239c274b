"""The one small interface every drafter implements, so the decode loop never branches on the kind.

A round: the loop asks `propose` for n candidates to follow the anchor token at position pos, the
target verifies them, and `observe` hears what the verify window committed, with the target's taps of
its rows (for drafters that want them)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..layers.kernels import EAGER, Kernels
from ..layers.modules import Probe
from .tree import TOP_K


@dataclass
class DraftRequest:
    anchor: int  # the last committed token, whose features no drafter has seen yet
    pos: int  # its position
    n: int  # candidates wanted
    anchor_t: torch.Tensor  # the same two values on the target's device ([1] int64 each); inside a
    pos_t: torch.Tensor  # captured step only these are current (see Drafter.on_device)
    kv_len: int  # cells a step may read: at least pos + n + 1
    kernels: Kernels = EAGER
    probe: Probe | None = None
    rate: bool = False  # whether the proposal carries its confidences (something reads them: Proposal.confidence)


@dataclass
class Commit:
    start: int  # position of tokens[0]
    tokens: list[int]  # the committed tokens (anchor, then the accepted candidates)
    taps: torch.Tensor | None  # [rows, features] of every row the target ran (rows >= len(tokens))
    positions: torch.Tensor  # [rows] their positions, on the device
    kernels: Kernels = EAGER
    probe: Probe | None = None
    row_tokens: torch.Tensor | None = None  # [rows] every row's token, on the device (what an MTP block reads)
    kv_len: int = 0  # cells a step over the rows may read (at least the last row's position + 1)


@dataclass
class Proposal:
    tokens: torch.Tensor  # [n] int64, on the target's device
    logits: torch.Tensor | None = None  # [n, vocab] float32: the drafter's raw logits, when it has them
    #: sampling, for a drafter whose slots depend on the draws before them (DFlash2's selector):
    #: draw(probs, gen) -> (tokens [n], q [n, vocab]), each slot drawn from its q, probs turning a slot's
    #: logits [1, vocab] into the sampling distribution (temperature, top-k, top-p); None: each slot is drawn
    #: from its own logits
    draw: Callable[[Callable, torch.Generator], tuple[torch.Tensor, torch.Tensor]] | None = None
    #: [n] float32: how likely each slot's candidate is accepted once the slots before it are, as the drafter
    #: rates it (llama.cpp's p_min quantity: DFlash's top-10 probability, DFlash2's pair-score probability,
    #: DSpark's confidence head); None: the drafter does not rate its candidates
    confidence: torch.Tensor | None = None
    #: tree(budget) -> Tree: the drafter's own draft tree (DFlash2's beam over its selector); None: the tree is
    #: built from the logits (engine/tree.py)
    tree: Callable[[int], object] | None = None


class Drafter:
    """Base class; also the target-only 'drafter' that proposes nothing."""

    name = "none"
    #: the largest verify window (anchor + candidates) this drafter supports, and what bounds it
    max_window = 1
    limit = "largest window"
    #: the window used when none is asked for
    default_window: int | None = None
    #: HF layer ids whose residual stream the drafter wants from every target forward
    tap_layers: list[int] | None = None
    #: whether proposals carry logits for every position (what tree verification branches on)
    gives_logits = False
    #: whether proposals carry a confidence for each candidate (what --draft-p-min and --spec auto read)
    rates_drafts = False
    #: the children a draft tree's node may have (bounds --tree's budget at a depth)
    tree_top_k = TOP_K
    #: The device contract. True: propose and observe read only the tensor fields of their argument
    #: (anchor_t, pos_t, taps, positions) and the fixed ones (n, kv_len, kernels), and only launch
    #: device work, so the model runner may capture them in CUDA graphs and replay them each round.
    #: False: they may use the host values (anchor, pos, tokens) and are called every round.
    on_device = False

    @property
    def window(self) -> int:
        return self.default_window or self.max_window

    def reset(self) -> None:
        """Forget the previous sequence."""

    def observe(self, commit: Commit) -> None:
        """Tokens committed at positions commit.start.."""

    def propose(self, req: DraftRequest) -> Proposal:
        raise NotImplementedError("the target-only drafter proposes nothing")


class OracleDrafter(Drafter):
    """Replays a known continuation: full acceptance, for benchmarks and for testing the loop."""

    name = "oracle"

    def __init__(self, sequence: list[int], max_window: int, device="cpu"):
        self.sequence = list(sequence)
        self.max_window = max_window
        self.device = device

    def propose(self, req: DraftRequest) -> Proposal:
        nxt = self.sequence[req.pos + 1: req.pos + 1 + req.n]
        nxt = nxt + [0] * (req.n - len(nxt))
        return Proposal(torch.tensor(nxt, dtype=torch.long, device=self.device))
