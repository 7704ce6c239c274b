"""Stage parity: one DFlash proposal recorded stage by stage by the serving steps (a runner whose drafter
steps carry a probe, never captured) and by the independent NumPy reference (reference.py)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from ..dflash.drafter import DFlashDrafter
from ..dflash.model import hf_layout
from ..engine.config import EngineConfig
from ..engine.runner import ModelRunner
from ..models.loader import unpack
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


class ProbedRunner(ModelRunner):
    """A model runner whose drafter steps show every stage to `probe(layer, stage, tensor)` (which may return
    a changed tensor: a planted bug). It never captures (a probe must see each step run)."""

    def __init__(self, target, drafter, config: EngineConfig, window: int, probe):
        config = replace(config, backend="static" if config.static else "eager")
        super().__init__(target, drafter, config, config.plan(target, window))
        self.probe = probe
        self.rate = True  # the confidences are compared too


def run_parity(drafter: DFlashDrafter, prompt_ids: list[int], w: int, plant_bug: tuple[int, str] | None = None,
               config: EngineConfig = EngineConfig()):
    """Prefill the target on the prompt, then one proposal recorded stage by stage, by the serving steps
    (run without graph capture, so the probe sees them) and by the reference. Returns (rows,
    first_divergence or None)."""
    target = drafter.target
    recorded: dict[tuple[int, str], np.ndarray] = {}

    def probe(layer, stage, t):
        if plant_bug == (layer, stage):
            t = t.clone()
            t.view(-1)[t.numel() // 2] += 1.0 + t.abs().max()
        recorded[(layer, stage)] = _numpy(t)
        return t

    runner = ProbedRunner(target, drafter, config, w, probe)
    with torch.inference_mode():
        runner.reset()
        out = runner.prefill(prompt_ids)
        anchor, pos = int(out.logits[-1].argmax()), len(prompt_ids)
        runner.start_round(anchor, pos)
        proposal = runner.draft(anchor, pos, w - 1, runner.kv_len(pos, w))
        tokens, confidence = proposal.tokens.tolist(), _numpy(proposal.confidence)
    ranges = [drafter.context_range(layer.mixer.window, pos) for layer in drafter.model.layers]
    ck, cv = [], []
    for j, (b, e) in enumerate(ranges):
        kv = drafter.cache.layers[j]
        ck.append(_numpy(kv.k[b:e]))
        cv.append(_numpy(kv.v[b:e]))
        recorded[(j, "context_k")], recorded[(j, "context_v")] = ck[-1], cv[-1]
    weights = {n: _numpy(p) for n, p in unpack(drafter.model.state_dict(), hf_layout(drafter.cfg)).items()}
    rows = w - 1 if drafter.cfg.anchor_drafts else w  # DSpark: the anchor's slot drafts, W-1 rows
    ref = reference_proposal(weights, drafter.cfg, _numpy(target.embed_tokens.weight), _numpy(target.lm_head.weight),
                             _numpy(out.taps), ck, cv, ranges, anchor, pos, rows)
    tol = TOLERANCE[target.dtype]
    table, first = [], None
    for layer, stage in stage_order(drafter.cfg.num_layers):
        name = stage if layer < 0 else f"layer{layer}.{stage}"
        row = _compare(name, recorded[(layer, stage)], ref[(layer, stage)], tol)
        for j, (b, e) in enumerate(ranges):  # the spec's cell range: [pos - window, pos) inside 0..pos
            if layer == j and stage == "context_k" and not (0 <= b <= e == pos):
                row.ok, row.note = False, f"out-of-range context cells {b}..{e} for a block at {pos}"
        table.append(row)
        if first is None and not row.ok:
            first = name
    if (-1, "tokens") in ref:  # DFlash2's selector walk, DSpark's chain: token for token
        want = ref[(-1, "tokens")].tolist()
        table.append(StageRow("draft_tokens", float("nan"), float("nan"), -1, tokens == want,
                              "" if tokens == want else f"{tokens} vs reference {want}"))
        first = first or (None if tokens == want else "draft_tokens")
    row = _compare("draft_confidence", confidence[:, None], ref[(-1, "confidence")][:, None], tol)
    table.append(row)  # what --draft-p-min and --spec auto read: DFlash's, DFlash2's and DSpark's own formulas
    return table, first or (None if row.ok else "draft_confidence")


def format_parity(rows: list[StageRow], first: str | None) -> str:
    lines = [f"{'stage':<24} {'min cos':>12} {'max abs':>12} {'worst row':>9}  status"]
    for r in rows:
        lines.append(f"{r.name:<24} {r.min_cos:>12.8f} {r.max_abs:>12.3e} {r.worst_row:>9}  "
                     f"{'ok' if r.ok else 'FAIL'}{'  ' + r.note if r.note else ''}")
    lines.append(f"FIRST DIVERGENCE: {first or 'none'}")
    return "\n".join(lines)
