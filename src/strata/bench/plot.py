"""The benchmark plot: tokens/s by method (with the floor) and the per-position acceptance."""

from __future__ import annotations

from pathlib import Path


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
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    bars = ax1.barh(names, values, color=["#999999"] + ["#3b75af"] * (len(names) - 1))
    ax1.bar_label(bars, fmt="%.0f", padding=3)
    ax1.set_xlabel("tokens / s")
    s = result["shape"]
    ax1.set_title(f"{result['env']['device']}, {result['env']['dtype']}, {s['layers']}L h{s['hidden']}, "
                  f"prompt {result['prompt_len']}, {result['new_tokens']} new, W={result['window']}", fontsize=9)
    for key, label in (("dflash", "DFlash drafter"), ("dflash_oracle", "oracle")):
        if key in result and result[key]["per_position_acceptance"]:
            acc = result[key]["per_position_acceptance"]
            ax2.plot(range(1, len(acc) + 1), acc, marker="o", label=f"{label} (tau {result[key]['tau']:.2f})")
    ax2.set_xlabel("candidate position")
    ax2.set_ylabel("acceptance")
    ax2.set_ylim(0, 1.05)
    ax2.legend()
    ax2.set_title("acceptance by position")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
