"""`strata bench --window-sweep`: DFlash at each fixed verify window and under --spec auto on a prompt set, so
that the window auto picks round by round can be held against the best fixed one (what --spec auto promises:
never below it)."""

from __future__ import annotations

from dataclasses import replace

from ..engine.config import EngineConfig
from ..engine.decode import Engine
from ..engine.window_policy import candidate_windows
from .run import decode_set


def window_sweep(target, drafter, prompts: list[list[int]], new_tokens: int, window: int,
                 config: EngineConfig = EngineConfig()) -> dict:
    """Tokens/s over every prompt's decoding, tau and the mean verified window, at each of auto's candidate
    windows (powers of two up to W, and W) fixed, then under auto (one engine across the set, as a server keeps
    it: its costs are measured once); whether every output equals the first's. One untimed prompt first."""
    out = {"prompts": len(prompts), "new_tokens": new_tokens, "window": window, "fixed": {}}
    first = None
    for w in [*candidate_windows(window), "auto"]:
        opts = replace(config, window=window if w == "auto" else w, auto_window=w == "auto", adaptive_window=False,
                       pad_rows=1)
        engine = Engine(target, drafter, config=opts)
        engine.generate(prompts[0], new_tokens if target.device.type == "cuda" else 2)
        acc, tok_s, outputs = decode_set(engine, prompts, new_tokens)
        first = first or outputs
        row = {"tok_s": tok_s, "tau": acc.tau, "rounds": acc.rounds,
               "mean_window": 1 + sum(acc.drafted) / acc.rounds if acc.rounds else 1.0,
               "identical": outputs == first}
        if w == "auto":
            out["auto"] = row
        else:
            out["fixed"][str(w)] = row
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
