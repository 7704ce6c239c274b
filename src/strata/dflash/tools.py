"""Correctness tools, each over the serving path (the model runner's steps and kernel set): stage parity
of one proposal against the NumPy reference, the taps check, the greedy identity gate."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from ..engine.config import EngineConfig
from ..engine.decode import Engine, GenerationResult
from ..engine.drafter import Drafter
from ..engine.runner import ModelRunner
from ..engine.stats import Acceptance
from ..layers.modules import Step
from ..models.loader import unpack
from .drafter import DFlashDrafter
from .model import hf_layout
from .reference import reference_proposal

# The stages of a drafter layer the serving path exposes (q/k norm and RoPE run as one group, so the
# reference's q_normed has no runtime twin).
LAYER_STAGES = ["context_k", "context_v", "attn_in", "q_raw", "q_roped", "k", "v", "attn", "o_residual", "mlp",
                "out"]
# Tolerances by dtype: max abs error relative to (1 + max |reference|), and the lowest row cosine.
TOLERANCE = {torch.float32: (1e-4, 1 - 1e-6), torch.float16: (2e-2, 0.999), torch.bfloat16: (5e-2, 0.995)}


@dataclass
class StageRow:
    name: str
    min_cos: float
    max_abs: float
    worst_row: int
    ok: bool
    note: str = ""


def stage_order(n_layers: int) -> list[tuple[int, str]]:
    return [(-1, "fused")] + [(j, s) for j in range(n_layers) for s in LAYER_STAGES] + \
        [(-1, "final_norm"), (-1, "logits")]


def _compare(name, got: np.ndarray, ref: np.ndarray, tol) -> StageRow:
    atol, min_cos = tol
    if got.shape != ref.shape:
        return StageRow(name, float("nan"), float("inf"), -1, False, f"shape {got.shape} vs reference {ref.shape}")
    for side, arr in (("runtime", got), ("reference", ref)):
        if not np.isfinite(arr).all():
            bad = int(np.argwhere(~np.isfinite(arr.reshape(arr.shape[0], -1)))[0][0]) if arr.size else -1
            return StageRow(name, float("nan"), float("inf"), bad, False, f"non-finite value in {side}")
    g = got.reshape(got.shape[0], -1) if got.size else got.reshape(0, 1)
    r = ref.reshape(ref.shape[0], -1) if ref.size else ref.reshape(0, 1)
    if g.shape[0] == 0:
        return StageRow(name, 1.0, 0.0, -1, True, "empty")
    err = np.abs(g - r).max(axis=1)
    cos = (g * r).sum(1) / np.maximum(np.linalg.norm(g, axis=1) * np.linalg.norm(r, axis=1), 1e-30)
    both_zero = (np.linalg.norm(g, axis=1) == 0) & (np.linalg.norm(r, axis=1) == 0)
    cos = np.where(both_zero, 1.0, cos)
    worst = int(np.argmax(err))
    bound = atol * (1 + np.abs(r).max())
    ok = bool(err.max() <= bound and cos.min() >= min_cos)
    return StageRow(name, float(cos.min()), float(err.max()), worst, ok)


def _numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().double().cpu().numpy()


def run_parity(drafter: DFlashDrafter, prompt_ids: list[int], w: int, plant_bug: tuple[int, str] | None = None,
               config: EngineConfig = EngineConfig()):
    """Prefill the target on the prompt, then one proposal recorded stage by stage, by the serving steps
    (run without graph capture, so the probe sees them) and by the reference. Returns (rows,
    first_divergence or None)."""
    target = drafter.target
    runner = ModelRunner(target, drafter, replace(config, graphs=False), w)
    recorded: dict[tuple[int, str], np.ndarray] = {}

    def probe(layer, stage, t):
        if plant_bug == (layer, stage):
            t = t.clone()
            t.view(-1)[t.numel() // 2] += 1.0 + t.abs().max()
        recorded[(layer, stage)] = _numpy(t)
        return t

    runner.probe = probe
    with torch.inference_mode():
        runner.reset()
        out = runner.prefill(prompt_ids)
        anchor, pos = int(out.logits[-1].argmax()), len(prompt_ids)
        runner.start_round(anchor, pos)
        runner.draft(anchor, pos, w - 1, runner.kv_len(pos, w))
    ranges = [drafter.context_range(layer.window, pos) for layer in drafter.model.layers]
    ck, cv = [], []
    for j, (b, e) in enumerate(ranges):
        kv = drafter.cache.layers[j]
        ck.append(_numpy(kv.k[b:e]))
        cv.append(_numpy(kv.v[b:e]))
        recorded[(j, "context_k")], recorded[(j, "context_v")] = ck[-1], cv[-1]
    weights = {n: _numpy(p) for n, p in unpack(drafter.model.state_dict(), hf_layout(drafter.cfg)).items()}
    ref = reference_proposal(weights, drafter.cfg, _numpy(target.embed_tokens.weight), _numpy(target.lm_head.weight),
                             _numpy(out.taps), ck, cv, ranges, anchor, pos, w)
    tol = TOLERANCE[target.dtype]
    rows, first = [], None
    for layer, stage in stage_order(drafter.cfg.num_layers):
        name = stage if layer < 0 else f"layer{layer}.{stage}"
        row = _compare(name, recorded[(layer, stage)], ref[(layer, stage)], tol)
        for j, (b, e) in enumerate(ranges):  # the spec's cell range: [pos - window, pos) inside 0..pos
            if layer == j and stage == "context_k" and not (0 <= b <= e == pos):
                row.ok, row.note = False, f"out-of-range context cells {b}..{e} for a block at {pos}"
        rows.append(row)
        if first is None and not row.ok:
            first = name
    return rows, first


def format_parity(rows: list[StageRow], first: str | None) -> str:
    lines = [f"{'stage':<24} {'min cos':>12} {'max abs':>12} {'worst row':>9}  status"]
    for r in rows:
        lines.append(f"{r.name:<24} {r.min_cos:>12.8f} {r.max_abs:>12.3e} {r.worst_row:>9}  "
                     f"{'ok' if r.ok else 'FAIL'}{'  ' + r.note if r.note else ''}")
    lines.append(f"FIRST DIVERGENCE: {first or 'none'}")
    return "\n".join(lines)


class _Taps(Drafter):
    """A drafter that only asks for taps: the taps check's verify windows."""

    def __init__(self, layers: list[int]):
        self.tap_layers = layers


@torch.inference_mode()
def taps_check(target, tap_layers: list[int], seq: list[int], prefix: int, w: int,
               config: EngineConfig = EngineConfig()):
    """Cosine, per position, between taps from one prefill and taps from the serving path's verify
    windows of w rows over a cache."""
    n = len(seq)
    full = target(torch.tensor(seq, device=target.device), Step(torch.arange(n, device=target.device), n),
                  target.make_cache(n), tap_layers).taps
    runner = ModelRunner(target, _Taps(tap_layers), replace(config, max_len=n + w), w)
    runner.reset()
    parts = [runner.prefill(seq[:prefix]).taps]
    pos = prefix
    while pos < n:
        rows = min(w, n - pos)
        chunk = seq[pos:pos + rows]
        runner.start_round(chunk[0], pos)
        cands = torch.tensor((chunk[1:] + [0] * w)[:w - 1], dtype=torch.long, device=target.device)
        out, _, _ = runner.verify(cands, w, runner.kv_len(pos, w))
        parts.append(out.taps[:rows])
        pos += rows
        runner.cache.commit(pos)
    windowed = torch.cat(parts).float()
    full = full.float()
    cos = torch.nn.functional.cosine_similarity(windowed, full, dim=-1)
    return cos.cpu().numpy(), float((windowed - full).abs().max())


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
