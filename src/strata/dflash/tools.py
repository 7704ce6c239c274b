"""Correctness tools: stage parity against the NumPy reference, the taps check, the greedy gate."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..spec.decode import Engine
from .reference import reference_proposal
from .runtime import DFlashDrafter

LAYER_STAGES = ["context_k", "context_v", "attn_in", "q_raw", "q_normed", "q_roped", "k", "v", "attn", "o_residual",
                "mlp", "out"]
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


def run_parity(drafter: DFlashDrafter, prompt_ids: list[int], w: int, plant_bug: tuple[int, str] | None = None):
    """Prefill the target on the prompt, then one proposal recorded stage by stage in both
    implementations. Returns (rows, first_divergence or None)."""
    target = drafter.target
    cache = target.make_cache(len(prompt_ids) + w)
    prompt = torch.tensor(prompt_ids, device=target.device)
    out = target(prompt, 0, cache, taps=drafter.tap_layers)
    drafter.reset()
    drafter.observe(prompt_ids, 0, out.taps)
    anchor, pos = int(out.logits[-1].argmax()), len(prompt_ids)

    recorded: dict[tuple[int, str], np.ndarray] = {}

    def trace(layer, stage, t):
        if plant_bug == (layer, stage):
            t = t.clone()
            t.view(-1)[t.numel() // 2] += 1.0 + t.abs().max()
        recorded[(layer, stage)] = t.detach().double().cpu().numpy()
        return t

    drafter.propose(anchor, pos, w - 1, trace=trace)
    fused = drafter.model.hidden_norm(drafter.model.fc(out.taps.to(target.dtype)))
    recorded[(-1, "fused")] = fused.double().cpu().numpy()
    ranges = [drafter.context_range(j, pos) for j in range(drafter.cfg.num_layers)]
    ck, cv = [], []
    for j, (b, e) in enumerate(ranges):
        k, v = drafter.cache.read(j, e, b)
        ck.append(k.double().cpu().numpy())
        cv.append(v.double().cpu().numpy())
        recorded[(j, "context_k")], recorded[(j, "context_v")] = ck[-1], cv[-1]
    weights = {n: p.detach().double().cpu().numpy() for n, p in drafter.model.state_dict().items()}
    ref = reference_proposal(
        weights, drafter.cfg, target.embed_tokens.weight.double().cpu().numpy(),
        target.lm_head.weight.double().cpu().numpy(), out.taps.double().cpu().numpy(), ck, cv, ranges, anchor, pos, w)
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


def taps_check(target, tap_layers: list[int], seq: list[int], prefix: int, w: int):
    """Cosine, per position, between taps from one prefill and taps from windows of w over a cache."""
    full = target(torch.tensor(seq, device=target.device), 0, target.make_cache(len(seq)), taps=tap_layers).taps
    cache = target.make_cache(len(seq) + w)
    parts = [target(torch.tensor(seq[:prefix], device=target.device), 0, cache, taps=tap_layers).taps]
    cache.commit(prefix)
    pos = prefix
    while pos < len(seq):
        chunk = seq[pos:pos + w]
        parts.append(target(torch.tensor(chunk, device=target.device), pos, cache, taps=tap_layers).taps)
        pos += len(chunk)
        cache.commit(pos)
    windowed = torch.cat(parts).float()
    full = full.float()
    cos = torch.nn.functional.cosine_similarity(windowed, full, dim=-1)
    return cos.cpu().numpy(), float((windowed - full).abs().max())


def gate(target, drafter, prompts: list[list[int]], windows: list[int], max_new_tokens: int, stop_ids=frozenset(),
         max_len: int | None = None, static: bool = False, **engine_opts):
    """Target-only vs DFlash greedy for every prompt and W. Yields one dict per (prompt, W).

    static: both in the fixed-shape layout, target-only padded to W rows (see Engine's pad_rows);
    engine_opts (graphs, attention) go to every Engine."""
    opts = dict(max_len=max_len, static=static, **engine_opts)
    base_engine = None if static else Engine(target, **opts)
    engines = {}
    for i, prompt in enumerate(prompts):
        base = None if static else base_engine.generate(prompt, max_new_tokens, stop_ids)
        for w in windows:
            if w not in engines:  # built once per W: on a GPU each holds its captured graphs
                engines[w] = (Engine(target, pad_rows=w, **opts) if static else None,
                              Engine(target, drafter, window=w, **opts))
            padded, drafted = engines[w]
            if static:
                base = padded.generate(prompt, max_new_tokens, stop_ids)
            res = drafted.generate(prompt, max_new_tokens, stop_ids)
            same = res.output_ids == base.output_ids
            first_diff = next((k for k, (a, b) in enumerate(zip(res.output_ids, base.output_ids)) if a != b),
                              None if same else min(len(res.output_ids), len(base.output_ids)))
            yield {"prompt": i, "window": w, "identical": same, "first_difference": first_diff,
                   "target_only": base, "dflash": res}
