"""The benchmark plot: tokens/s by method (with the floor) and the per-position acceptance."""

from __future__ import annotations

from pathlib import Path


def title(result: dict) -> str:
    """What was run: the model (its label names a --quant file type), where, and the run's shape."""
    s = result["shape"]
    parts = [result.get("model"), f"{s['layers']}L h{s['hidden']}", result["env"]["device"], result["env"]["dtype"],
             f"prompt {result['prompt_len']}, {result['new_tokens']} new, W={result['window']}"]
    return ", ".join(p for p in parts if p)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names, values = ["floor"], [result["floor_tok_s"]]
    for key, label in (("target_only", "Strata target-only"), ("dflash_oracle", "Strata DFlash (oracle)"),
                       ("dflash", "Strata DFlash")):
        if key in result:
            names.append(label)
            values.append(result[key]["tok_s"])
    for mode, r in (result.get("hf") or {}).items():
        if isinstance(r, dict) and "tok_s" in r:
            names.append(f"HF generate ({mode})")
            values.append(r["tok_s"])
    sweep, verify = result.get("tree_sweep"), result.get("verify_sweep")
    panels = 2 + bool(sweep) + bool(verify)
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.5))
    ax1, ax2 = axes[0], axes[1]
    bars = ax1.barh(names, values, color=["#999999"] + ["#3b75af"] * (len(names) - 1))
    ax1.bar_label(bars, fmt="%.0f", padding=3)
    ax1.set_xlabel("tokens / s")
    ax1.set_title(title(result), fontsize=9)
    for key, label in (("dflash", "DFlash drafter"), ("dflash_oracle", "oracle")):
        if key in result and result[key]["per_position_acceptance"]:
            acc = result[key]["per_position_acceptance"]
            ax2.plot(range(1, len(acc) + 1), acc, marker="o", label=f"{label} (tau {result[key]['tau']:.2f})")
    ax2.set_xlabel("candidate position")
    ax2.set_ylabel("acceptance")
    ax2.set_ylim(0, 1.05)
    ax2.legend()
    ax2.set_title("acceptance by position")
    if sweep:
        tree_panel(axes[2], sweep)
    if verify:
        verify_panel(axes[-1], verify)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def verify_panel(ax, verify: dict) -> None:
    """A verify step's cost by window, as a multiple of the 1-row decode step."""
    windows = [int(w) for w in verify["vs_decode"]]
    ax.plot(windows, list(verify["vs_decode"].values()), marker="o", color="#3b75af")
    ax.set_xscale("log", base=2)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("verify window W (rows)")
    ax.set_ylabel("step time / 1-row decode step")
    ax.set_title("verify cost by window", fontsize=9)


def tree_panel(ax, sweep: dict) -> None:
    """tau and tokens/s by tree budget, the chain's as dashed lines."""
    budgets = [int(n) for n in sweep["budgets"]]
    rows = list(sweep["budgets"].values())
    ax.plot(budgets, [r["tau"] for r in rows], marker="o", color="#3b75af", label="tau")
    ax.axhline(sweep["chain"]["tau"], color="#3b75af", linestyle="--", label=f"chain tau {sweep['chain']['tau']:.2f}")
    ax.set_xscale("log", base=2)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("tree nodes N")
    ax.set_ylabel("tau (tokens per round)")
    speed = ax.twinx()
    speed.plot(budgets, [r["tok_s"] for r in rows], marker="s", color="#d9730d", label="tok/s")
    speed.axhline(sweep["chain"]["tok_s"], color="#d9730d", linestyle="--",
                  label=f"chain {sweep['chain']['tok_s']:.0f} tok/s")
    speed.set_ylabel("tokens / s")
    speed.set_ylim(bottom=0)
    lines = ax.get_legend_handles_labels()
    more = speed.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=8, loc="lower right")
    ax.set_title(f"tree budget sweep: {sweep['prompts']} prompts x {sweep['new_tokens']} tokens, W={sweep['window']}",
                 fontsize=9)
