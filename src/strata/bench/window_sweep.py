"""`strata bench --window-sweep`: DFlash at each fixed verify window and under --spec auto on a prompt set, so
that the window auto picks round by round can be held against the best fixed one (what --spec auto promises:
never below it)."""

from __future__ import annotations

from dataclasses import replace

from ..engine.config import EngineConfig
from ..engine.decode import Engine
from ..engine.stats import Acceptance
from ..engine.window_policy import candidate_windows
from .run import decode_set


def window_sweep(target, drafter, prompts: list[list[int]], new_tokens: int, window: int,
                 config: EngineConfig = EngineConfig()) -> dict:
    """Tokens/s over every prompt's decoding, tau and the mean verified window, at each of auto's candidate
    windows (powers of two up to W, and W) fixed and under auto (one engine each across the set, as a server
    keeps it: auto's costs are measured once); whether every output equals the first window's. The engines take
    each prompt in turn, so that a drift of the machine's speed falls on all of them alike. One untimed prompt
    each first."""
    names = [*map(str, candidate_windows(window)), "auto"]
    engines = {w: Engine(target, drafter, config=replace(config, window=window if w == "auto" else int(w),
                                                         auto_window=w == "auto", adaptive_window=False, pad_rows=1))
               for w in names}
    totals = {w: [Acceptance(), 0, 0.0, []] for w in names}
    for engine in engines.values():
        engine.generate(prompts[0], new_tokens if target.device.type == "cuda" else 2)
    for p in prompts:
        for w, engine in engines.items():
            acc, tokens, secs, outputs = decode_set(engine, [p], new_tokens)
            t = totals[w]
            t[0], t[1], t[2] = t[0].merge(acc), t[1] + tokens, t[2] + secs
            t[3] += outputs
    out = {"prompts": len(prompts), "new_tokens": new_tokens, "window": window, "fixed": {}, "interleaved": True}
    for w, (acc, tokens, secs, outputs) in totals.items():
        row = {"tok_s": tokens / secs if secs else 0.0, "tau": acc.tau, "rounds": acc.rounds,
               "mean_window": 1 + sum(acc.drafted) / acc.rounds if acc.rounds else 1.0,
               "identical": outputs == totals[names[0]][3]}
        if w == "auto":
            out["auto"] = row
        else:
            out["fixed"][w] = row
    best = max(out["fixed"], key=lambda w: out["fixed"][w]["tok_s"])
    out["best_fixed"] = int(best)
    out["auto_vs_best_fixed"] = out["auto"]["tok_s"] / out["fixed"][best]["tok_s"] if out["fixed"][best]["tok_s"] else 0
    return out


def sweep_lines(sweep: dict) -> list[str]:
    a = sweep["auto"]
    lines = [f"window sweep on {sweep['prompts']} prompts x {sweep['new_tokens']} tokens: --spec auto "
             f"{a['tok_s']:.1f} tok/s, tau {a['tau']:.2f}, mean window {a['mean_window']:.2f} "
             f"(x{sweep['auto_vs_best_fixed']:.2f} the best fixed, W={sweep['best_fixed']})"]
    for w, r in sweep["fixed"].items():
        lines.append(f"  W={w}: {r['tok_s']:.1f} tok/s, tau {r['tau']:.2f}, "
                     f"{'identical' if r['identical'] else 'DIFFERENT'} output")
    if not a["identical"]:
        lines.append("  auto: DIFFERENT output")
    return lines
