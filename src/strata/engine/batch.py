"""Continuous batching of target-only decoding: up to max_num_seqs sequences, each in its own slot of one KV
cache, decode together, a token each per step. A sequence joins at the next step (its prompt prefilled into its
slot alone) and leaves when it is done, freeing the slot.

Batch invariance: every step runs all the slots (an idle one on a dummy row in its own slot) over all the
cache's cells, so the shapes of a step never depend on which sequences share it, and each row's arithmetic
depends only on its own values. A request's tokens are therefore the same alone or beside others, greedy or
sampled (each sequence draws from its own seeded generator)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..cache import aligned_cells, kv_bytes, memory
from ..errors import SettingError
from ..layers.modules import LayerKV, Step
from .sampling import SamplingParams, process, sample


@dataclass(eq=False)
class Sequence:
    prompt_ids: list[int]
    max_new_tokens: int
    params: SamplingParams = SamplingParams()
    stop_ids: frozenset = frozenset()
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" or "length" once done
    slot: int | None = None
    gen: torch.Generator | None = None
    on_tokens: Callable[[list[int]], None] | None = None  # hears each token as it is decoded


class SlotCache:
    """One slot of a batched cache, as a forward reads a cache: each layer's K/V of that sequence alone."""

    def __init__(self, cache, slot: int):
        self.layers = [LayerKV(kv.k[slot:slot + 1], kv.v[slot:slot + 1]) for kv in cache.layers]


def refuse_unless_batchable(cfg, max_num_seqs: int, max_len: int, device, dtype) -> None:
    """What batching runs and holds, from a model's config before any weight loads: a dense attention-only
    target, and the KV cache of max_num_seqs sequences of max_len positions each in the device's memory; else a
    one-line error with the numbers."""
    if cfg.linear is not None or cfg.moe is not None:
        raise SettingError(f"{{max_num_seqs}} {max_num_seqs}: batched serving runs dense attention-only targets so "
                           f"far; the target is a {cfg.family} model")
    need = kv_bytes(cfg.num_layers, (max_num_seqs, aligned_cells(max_len), cfg.num_kv_heads, cfg.head_dim), dtype)
    have = memory(torch.device(device))
    if need > have:
        raise SettingError(f"{{max_num_seqs}} {max_num_seqs} x {{max_len}} {max_len}: their KV cache needs "
                           f"{need / 2 ** 30:.1f} GiB, more than the {have / 2 ** 30:.1f} GiB of "
                           f"{torch.device(device).type} memory")


class BatchEngine:
    def __init__(self, target, max_num_seqs: int, max_len: int):
        if max_num_seqs < 1:
            raise SettingError(f"{{max_num_seqs}} must be >= 1, got {max_num_seqs}")
        refuse_unless_batchable(target.cfg, max_num_seqs, max_len, target.device, target.dtype)
        self.target, self.max_len = target, max_len
        self.cache = target.make_cache(aligned_cells(max_len), batch=max_num_seqs)
        dev = target.device
        self.tokens = torch.zeros(max_num_seqs, 1, dtype=torch.long, device=dev)
        self.positions = torch.zeros(max_num_seqs, 1, dtype=torch.long, device=dev)
        self.free = list(range(max_num_seqs))
        self.waiting: deque[Sequence] = deque()
        self.running: dict[int, Sequence] = {}

    def add(self, seq: Sequence) -> None:
        if not seq.prompt_ids or len(seq.prompt_ids) >= self.max_len:
            raise SettingError(f"a prompt of {len(seq.prompt_ids)} tokens does not fit the context of {self.max_len}")
        if not seq.params.greedy:
            seq.gen = seq.params.generator(self.target.device)
        self.waiting.append(seq)

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def pick(self, seq: Sequence, logits: torch.Tensor) -> int:
        """The sequence's next token from its logits [1, V]."""
        if seq.params.greedy:
            return int(logits.argmax(-1))
        return int(sample(process(logits, seq.params), seq.gen))

    def abort(self, seq: Sequence) -> None:
        """A sequence leaves before its end (its client went away): its slot is free at the next step."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        elif seq.slot is not None and self.running.get(seq.slot) is seq:
            del self.running[seq.slot]
            self.free.append(seq.slot)
        seq.finish_reason = "abort"

    def emit(self, seq: Sequence, token: int) -> None:
        seq.output_ids.append(token)
        if seq.on_tokens is not None:
            seq.on_tokens([token])
        if token in seq.stop_ids:
            seq.finish_reason = "stop"
        elif len(seq.output_ids) >= seq.max_new_tokens or len(seq.prompt_ids) + len(seq.output_ids) >= self.max_len:
            seq.finish_reason = "length"

    @torch.inference_mode()
    def prefill(self, seq: Sequence, slot: int) -> None:
        """The prompt into the slot, alone (its shapes are the prompt's own), and its first token."""
        n, dev = len(seq.prompt_ids), self.target.device
        tokens = torch.tensor([seq.prompt_ids], dtype=torch.long, device=dev)
        positions = torch.arange(n, device=dev).unsqueeze(0)
        out = self.target(tokens, Step(positions, n), SlotCache(self.cache, slot), logits="last")
        seq.slot = slot
        self.emit(seq, self.pick(seq, out.logits[0, -1:]))

    @torch.inference_mode()
    def step(self) -> list[Sequence]:
        """Admit what fits, then one decode step of every running sequence; returns those that finished."""
        done = []
        while self.waiting and self.free:
            seq = self.waiting.popleft()
            self.prefill(seq, self.free.pop(0))
            if seq.finish_reason:
                self.free.append(seq.slot)
                done.append(seq)
            else:
                self.running[seq.slot] = seq
        if not self.running:
            return done
        self.tokens.zero_()
        self.positions.zero_()
        for slot, seq in self.running.items():
            self.tokens[slot, 0] = seq.output_ids[-1]
            self.positions[slot, 0] = len(seq.prompt_ids) + len(seq.output_ids) - 1
        out = self.target(self.tokens, Step(self.positions, self.cache.cells), self.cache, logits="all")
        for slot, seq in list(self.running.items()):
            self.emit(seq, self.pick(seq, out.logits[slot]))
            if seq.finish_reason:
                del self.running[slot]
                self.free.append(slot)
                done.append(seq)
        return done

    def run(self, seqs: list[Sequence]) -> list[Sequence]:
        """Every sequence to its end (all joining at once)."""
        for seq in seqs:
            self.add(seq)
        while self.busy:
            self.step()
        return seqs
