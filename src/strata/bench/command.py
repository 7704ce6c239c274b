"""`strata bench`: the target (a model folder or random weights of a named shape), the drafter (given,
random, or none), the prompt, one run of run_bench, the JSON and plot, and the lines to print."""

from __future__ import annotations

import time
import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..engine.config import EngineConfig
from ..pair import PairSpec, load_drafter_for, load_pair, resolve
from ..dflash.random_init import random_drafter
from ..errors import StrataError
from ..files import replacing, write_json_atomic
from .plot import plot
from .run import run_bench, sync, tree_sweep, verify_sweep
from .window_sweep import sweep_lines, window_sweep


@dataclass(frozen=True)
class BenchSpec:
    shape: str | None = None  # random weights of a named shape instead of a model folder
    drafter_layers: int | None = None  # a random DFlash drafter of this many layers
    drafter_variant: str = "dflash"  # ... of this kind: dflash, dflash2 or dspark
    drafter_type: str = "BF16"  # ... stored as convert-dflash --type stores it (Q8_0: kept in its blocks on a GPU)
    block_size: int = 16
    prompt_len: int = 512
    prompt: str | None = None
    new_tokens: int = 256
    runs: int = 3
    hf: str = "eager"
    profile: bool = False
    quant: str | None = None  # with shape: a llama.cpp file type (Q4_K_M, Q8_0, ...) of random valid blocks
    trees: tuple[int, ...] = ()  # tree budgets swept against the chain (tree_sweep)
    prompts: str | None = None  # the sweep's prompt file (default: the demo's held-out prompts, or the bench's)
    windows: tuple[int, ...] = ()  # verify windows whose step cost is measured (verify_sweep)
    window_sweep: bool = False  # DFlash at each fixed window and under --spec auto on the prompt set

    def __post_init__(self):
        if self.prompt_len < 1 or self.new_tokens < 1:
            raise StrataError("--prompt-len and --new-tokens must be >= 1")
        if self.runs < 1:
            raise StrataError(f"--runs must be >= 1, got {self.runs}")
        if self.quant is not None and self.shape is None:
            raise StrataError("--quant needs --shape (a GGUF model brings its own types: --model FILE.gguf)")
        if self.prompts is not None and (self.shape is not None or not (self.trees or self.window_sweep)):
            raise StrataError("--prompts: the sweeps' prompts need --tree or --window-sweep and a model with a "
                              "tokenizer")
        if any(n < 1 for n in self.trees):
            raise StrataError(f"--tree: budgets must be >= 1, got {min(self.trees)}")
        if any(w < 1 for w in self.windows):
            raise StrataError(f"--verify-windows: windows must be >= 1, got {min(self.windows)}")


def check_sizes(pair: PairSpec, engine: EngineConfig, bench: BenchSpec, cfg) -> None:
    """What the bench will run, against the target's config and the device's memory, before anything
    loads: the prompt in the context, and each verify window's and tree's rows."""
    from ..cache import refuse_rows_unless_fit

    pair.check_for(cfg)
    max_len = engine.check_before_load(cfg, pair.torch_device(), pair.torch_dtype())
    if bench.prompt is None and bench.prompt_len >= max_len:
        raise StrataError(f"--prompt-len {bench.prompt_len} does not fit the context of {max_len} tokens")
    asked = [(w, f"{{verify_windows}} {w}") for w in bench.windows] + [(n + 1, f"{{tree}} {n}") for n in bench.trees]
    for rows, what in asked:
        refuse_rows_unless_fit(rows, what, cfg, max_len, pair.torch_device(), pair.torch_dtype())


def run_command(pair: PairSpec, engine: EngineConfig, bench: BenchSpec, command: str) -> dict:
    if engine.auto_window:  # --spec auto: the runs at the drafter's block size, auto in the window sweep
        engine, bench = replace(engine, auto_window=False), replace(bench, window_sweep=True)
    from ..models.loader import load_model_config
    from ..models.random_init import random_target, shape_config

    if bench.shape and pair.model:
        raise StrataError("give --model or --shape, not both")
    check_sizes(pair, engine, bench, shape_config(bench.shape)[1] if bench.shape else
                load_model_config(resolve(pair)[0])[1])
    t0 = time.perf_counter()
    if bench.shape:
        target = random_target(bench.shape, device=pair.torch_device(), dtype=pair.torch_dtype(), quant=bench.quant,
                               mtp=pair.mtp)
        if pair.expert_cache is not None:  # random weights are made on the device: only a pinned budget moves some
            from ..models.placement import place_experts

            place_experts(target, target.device, pair.expert_cache, engine.context(target.cfg),
                          by=pair.expert_placement)
        label, tokenizer, dflash = bench.shape + (f"-{bench.quant}" if bench.quant else ""), None, pair.dflash
        loaded = None
    else:
        loaded = load_pair(pair, engine, drafter=False)
        target, tokenizer, label = loaded.target, loaded.tokenizer, loaded.label
        dflash = resolve(pair)[1]
    sync(target.device)
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    if dflash or pair.prompt_lookup is not None or pair.mtp:
        drafter = load_drafter_for(pair, target, engine, dflash)
    elif bench.drafter_layers:
        drafter = random_drafter(target, bench.drafter_layers, bench.block_size, variant=bench.drafter_variant,
                                 file_type=bench.drafter_type)
    else:
        drafter = None
    sync(target.device)
    drafter_s = time.perf_counter() - t0
    window = engine.window_for(drafter) if drafter is not None else (engine.window or 8)
    if bench.prompt is not None:
        if tokenizer is None:
            raise StrataError("--prompt needs a model with a tokenizer (random --shape weights have none)")
        prompt = tokenizer.encode_prompt(bench.prompt)
        if not prompt:
            raise StrataError("--prompt: the text encodes to no tokens")
    else:
        gen = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, target.cfg.vocab_size, (bench.prompt_len,), generator=gen).tolist()
    if bench.trees:
        for n in bench.trees:  # refused before any timing: no drafter, one without logits, too many nodes
            replace(engine, tree=n).window_for(drafter)
    hf = () if bench.hf == "none" or bench.quant else tuple(bench.hf.split(","))  # no peer reads GGUF blocks
    result = run_bench(target, drafter, prompt, bench.new_tokens, window, engine, runs=bench.runs, hf_modes=hf,
                       profile=bench.profile, startup={"load_target_s": load_s, "load_drafter_s": drafter_s})
    if bench.windows:
        result["verify_sweep"] = verify_sweep(target, prompt, bench.new_tokens, bench.windows, engine)
    if bench.trees or bench.window_sweep:
        from ..prompts import prompt_set

        prompts = prompt_set(loaded, None, bench.prompts) if loaded is not None and bench.prompt is None else [prompt]
    if bench.trees:
        result["tree_sweep"] = tree_sweep(target, drafter, prompts, bench.new_tokens, window, bench.trees, engine,
                                          profile=bench.profile)
    if bench.window_sweep:
        result["window_sweep"] = window_sweep(target, drafter, prompts, bench.new_tokens, window, engine)
    result["model"] = label
    variant = "" if bench.drafter_variant == "dflash" else f" {bench.drafter_variant}"
    variant += "" if bench.drafter_type == "BF16" else f" {bench.drafter_type}"
    result["drafter"] = dflash or ("the model's MTP block" + (" (random)" if bench.shape else "") if pair.mtp else
                                   f"random {bench.drafter_layers}-layer{variant}" if bench.drafter_layers else None)
    result["command"] = command
    result["commit"] = source_commit()
    result["quant"] = bench.quant
    return result


def write(result: dict, out: Path, png: Path, index: Path) -> None:
    """The plot, then the JSON (each atomically: a failing plot leaves no JSON that lacks it), then the
    result's line in the index beside it (index_line), in place of a line for the same file."""
    with replacing(png) as tmp:
        plot(result, tmp)
    write_json_atomic(out, result)
    lines = index.read_text().splitlines() if index.is_file() else []
    kept = [ln for ln in lines if ln.strip() and json.loads(ln).get("file") != out.name]
    entry = index_line(result, out.name, png.name if png.parent == out.parent else None)
    with replacing(index) as tmp:
        tmp.write_text("".join(ln + "\n" for ln in sorted(kept + [json.dumps(entry)],
                                                         key=lambda ln: json.loads(ln)["file"])))


def index_line(result: dict, file: str, plot_file: str | None) -> dict:
    """A bench result as a line of bench/results/index.jsonl (docs/BENCHMARKS.md describes its fields)."""
    env, ratios = result["env"], result["ratios"]
    drafter = result.get("drafter")
    mode = f"{result['backend']} W={result['window']}" + (f" drafter {Path(drafter).name}" if drafter and
                                                           not drafter.startswith("random") else
                                                           f" {drafter} drafter" if drafter else "")
    metric = {"target_only_tok_s": round(result["target_only"]["tok_s"], 1),
              "of_floor": round(ratios["target_only_vs_floor"], 3),
              "oracle_x": round(ratios["oracle_vs_target_only"], 2)}
    if "verify_window_vs_decode" in ratios:
        metric["verify_vs_step"] = round(ratios["verify_window_vs_decode"], 2)
    if "dflash" in result:
        metric.update(dflash_tok_s=round(result["dflash"]["tok_s"], 1), tau=round(result["dflash"]["tau"], 2))
    return {"commit": result.get("commit"), "commit_from": "content", "device": env["device"],
            "versions": {k: v for k, v in env.items() if k not in ("device", "dtype")}, "model": result["model"],
            "quant": result.get("quant") or env["dtype"], "mode": mode, "metric": metric, "file": file,
            "plot": plot_file}


def source_commit() -> str | None:
    """The commit the running source is (STRATA_COMMIT, else git's HEAD of the checkout it runs from, "+" when
    the checkout has changes), or None where neither tells."""
    import os
    import subprocess

    if os.environ.get("STRATA_COMMIT"):
        return os.environ["STRATA_COMMIT"]
    root = Path(__file__).resolve().parents[3]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+" if dirty.stdout.strip() else "")


def profile_lines(label: str, steps: dict | None) -> list[str]:
    """One line per captured step that graph_profile replayed alone."""
    return [f"{label} step {step}: {p['wall_ms']:.3f} ms replayed alone"
            + (f", kernels {p['kernel_ms']:.3f} ms ({p['kernels']})" if "kernel_ms" in p else "")
            for step, p in (steps or {}).items()]


def summary(result: dict) -> list[str]:
    window = result["window"]
    t = result["target_only"]
    lines = [f"floor {result['floor_tok_s']:.1f} tok/s ({result['copy_bandwidth_GBps']:.1f} GB/s copy, "
             f"{result['bytes_per_token'] / 1e6:.1f} MB read per token of {result['weight_bytes'] / 1e6:.1f} MB "
             + (f"weights on the device, {result['host_weight_bytes'] / 1e6:.1f} MB in host memory)"
                if "host_weight_bytes" in result else "weights)"),
             f"target-only {t['tok_s']:.1f} tok/s ({result['ratios']['target_only_vs_floor']:.2f} of floor)"]
    if result.get("product_check"):
        lines.insert(1, "quantized products against their blocks dequantized (relative error): " + ", ".join(
            f"{name} rows {err:.1e}" for name, err in result["product_check"].items()))
    if "target_only_without_triton" in result:
        lines.append(f"target-only without Strata's Triton kernels {result['target_only_without_triton']['tok_s']:.1f} "
                     f"tok/s (the kernels: x{result['ratios']['triton_vs_compiled_only']:.2f})")
    o = result["dflash_oracle"]
    lines.append(f"DFlash oracle W={window}: {o['tok_s']:.1f} tok/s, tau {o['tau']:.2f}, "
                 f"x{result['ratios']['oracle_vs_target_only']:.2f}; round: draft {o['split']['draft_ms']:.2f} ms, "
                 f"verify {o['split']['verify_ms']:.2f} ms, other {o['split']['other_ms']:.2f} ms")
    if "dflash" in result:
        d = result["dflash"]
        name = {"mtp": "MTP", "prompt-lookup": "prompt lookup"}.get(d.get("drafter"), "DFlash")
        lines.append(f"{name} W={window}: {d['tok_s']:.1f} tok/s, tau {d['tau']:.2f}, "
                     f"x{result['ratios']['dflash_vs_target_only']:.2f}; round: draft {d['split']['draft_ms']:.2f} ms, "
                     f"verify {d['split']['verify_ms']:.2f} ms"
                     + (f"; at the oracle's tau {o['tau']:.2f}: {d['tok_s_at_oracle_tau']:.1f} tok/s"
                        if "tok_s_at_oracle_tau" in d else ""))
    if result.get("window_sweep"):
        lines += sweep_lines(result["window_sweep"])
    sweep = result.get("tree_sweep")
    if sweep:
        c = sweep["chain"]
        lines.append(f"tree sweep on {sweep['prompts']} prompts x {sweep['new_tokens']} tokens, W={sweep['window']}: "
                     f"chain {c['tok_s']:.1f} tok/s, tau {c['tau']:.2f}, verify {c['verify_ms']:.2f} ms")
        for n, r in sweep["budgets"].items():
            lines.append(f"  tree of {n} nodes: {r['tok_s']:.1f} tok/s (x{r['tok_s_vs_chain']:.2f}), tau {r['tau']:.2f} "
                         f"(x{r['tau_vs_chain']:.2f}), verify {r['verify_ms']:.2f} ms, "
                         f"{'identical' if r['identical_to_chain'] else 'DIFFERENT'} output")
        for name, r in [("chain", c), *sweep["budgets"].items()]:
            lines += profile_lines(f"  {name}", r.get("profile"))
    for engine, steps in (result.get("profile") or {}).items():
        lines += profile_lines(engine, steps)
    rollback = result.get("rollback")
    if rollback:
        end = f" (from the end state, nothing replayed: {rollback['at_end_ms']:.3f} ms)" if "at_end_ms" in rollback else ""
        lines.append(f"rollback a round ({rollback['layers']} linear-attention layers): start state with {rollback['rows']} "
                     f"rows replayed {rollback['replay_ms']:.3f} ms{end}; writing a state per verified row instead "
                     f"{rollback['snapshot_writes_ms']:.3f} ms")
    verify = result.get("verify_sweep")
    if verify:
        lines.append("verify step by window: " + ", ".join(f"W={w} {ms:.2f} ms (x{verify['vs_decode'][w]:.2f})"
                                                          for w, ms in verify["ms_per_step"].items()))
    cache = result.get("expert_cache")
    if cache:
        c = cache["split"]
        lines += cache["placement"].splitlines()
        lines.append(f"  a token: {c['ms_per_token']:.2f} ms = waiting for the routing {c['routing_read_ms']:.2f} + "
                     f"CPU experts {c['host_experts_ms']:.2f} + the rest {c['rest_ms']:.2f}")
    for mode, r in (result.get("hf") or {}).items():
        if isinstance(r, dict) and "tok_s" in r:
            lines.append(f"HF generate ({mode}): {r['tok_s']:.1f} tok/s (first call {r['first_call_s']:.1f} s)")
        elif isinstance(r, dict) and "error" in r:
            lines.append(f"HF generate ({mode}): {r['error']}")
    return lines
