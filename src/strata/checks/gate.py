"""The greedy identity gate: target-only against DFlash, token for token, per prompt and verify window."""

from __future__ import annotations

from dataclasses import dataclass

from ..engine.config import EngineConfig
from ..engine.decode import Engine, GenerationResult
from ..engine.stats import Acceptance


@dataclass
class GateRecord:
    prompt: int
    window: int
    identical: bool
    first_difference: int | None
    target_only: GenerationResult
    dflash: GenerationResult

    def row(self) -> dict:
        st = self.dflash.stats()
        return {"prompt": self.prompt, "window": self.window, "identical": self.identical,
                "first_difference": self.first_difference, "tau": st["tau"], "acceptance_rate": st["acceptance_rate"],
                "new_tokens": st["new_tokens"], "per_position_acceptance": st["per_position_acceptance"],
                "accept_lengths": st["accept_lengths"]}


def gate(target, drafter, prompts: list[list[int]], windows: list[int], max_new_tokens: int, stop_ids=frozenset(),
         config: EngineConfig = EngineConfig()):
    """Target-only vs DFlash greedy for every prompt and W, on the engines `config` describes. Yields a
    GateRecord per (prompt, W).

    In the static layout target-only runs padded to the verify's rows (W, or a tree's N+1; see ModelRunner),
    so both sides round alike."""
    base_engine = None if config.static else Engine(target, config=config, tree=None)
    engines = {}
    for i, prompt in enumerate(prompts):
        base = None if config.static else base_engine.generate(prompt, max_new_tokens, stop_ids)
        for w in windows:
            if w not in engines:  # built once per W: on a GPU each holds its captured graphs
                rows = w if config.tree is None else config.tree + 1  # the verify's rows
                engines[w] = (Engine(target, config=config, pad_rows=rows, tree=None) if config.static else None,
                              Engine(target, drafter, config=config, window=w))
            padded, drafted = engines[w]
            if config.static:
                base = padded.generate(prompt, max_new_tokens, stop_ids)
            res = drafted.generate(prompt, max_new_tokens, stop_ids)
            same = res.output_ids == base.output_ids
            first_diff = next((k for k, (a, b) in enumerate(zip(res.output_ids, base.output_ids)) if a != b),
                              None if same else min(len(res.output_ids), len(base.output_ids)))
            yield GateRecord(i, w, same, first_diff, base, res)


def gate_report(records: list[GateRecord], prompts: int, max_new_tokens: int) -> dict:
    """The gate's summary: failures, and tau and acceptance by position per window over all prompts (and the
    tree's node budget when it verified trees)."""
    by_window: dict[int, Acceptance] = {}
    for rec in records:
        by_window[rec.window] = by_window.get(rec.window, Acceptance()).merge(rec.dflash.acceptance)
    return {"prompts": prompts, "max_new_tokens": max_new_tokens, "tree": records[0].dflash.tree if records else None,
            "failures": sum(not r.identical for r in records),
            "windows": {str(w): {"tau": a.tau, "rounds": a.rounds, "per_position_acceptance": a.per_position}
                        for w, a in by_window.items()},
            "records": [r.row() for r in records]}
