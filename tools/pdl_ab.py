"""Programmatic dependent launch on and off (STRATA_PDL, layers/kernels/pdl.py) in one process: ms per
target-only step (padded to each window W: a verify's cost) of a random-weight shape, each setting's outputs
compared with the first's. Inductor's flag is set once per process, at the first setting's compiled kernels.
With --knob the settings are values of KernelOptions fields instead (Python literals, one engine each);
--set fixes module constants (the autotune lists of layers/kernels/tuning.py) before any kernel is built.

    PYTHONPATH=src python3 tools/pdl_ab.py --shape qwen3-8b --windows 1 16 --settings 1 0
    PYTHONPATH=src python3 tools/pdl_ab.py --shape qwen3-8b --quant Q4_K_M --windows 1 \
        --knob norm_max_rows --settings 0 64 0 64
    PYTHONPATH=src python3 tools/pdl_ab.py --shape qwen3-8b --quant Q4_K_M --windows 16 \
        --knob quantize_rows norm_max_rows --settings 1,64 16,64 1,0 \
        --set 'strata.layers.kernels.tuning.WORD_SKINNY_CONFIGS=[(64, 4, 2, 1)]'

--out FILE.json also keeps every line's figures, the block shapes the autotuner chose, the device and the
command, for bench/results."""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import os
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from strata.engine.config import EngineConfig  # noqa: E402
from strata.engine.decode import Engine  # noqa: E402
from strata.layers.kernels import KernelOptions  # noqa: E402
from strata.layers.kernels.quantized import kernels  # noqa: E402
from strata.models.random_init import random_target  # noqa: E402


def set_constants(items: list[str]) -> None:
    """Set module constants from MODULE.NAME=VALUE items (VALUE a Python literal)."""
    for fixed in items:
        path, value = fixed.split("=", 1)
        module, name = path.rsplit(".", 1)
        setattr(importlib.import_module(module), name, ast.literal_eval(value))


def tuned_shapes() -> dict:
    """The block shape the autotuner chose for each product the quantized kernels ran so far, by kernel and
    tuning key (which of a list's shapes a setting's products took, where two settings' outputs part)."""
    chosen = {}
    for name, kernel in kernels().items():
        for key, cfg in getattr(kernel, "cache", {}).items() if name.endswith("_tuned") else ():
            chosen.setdefault(name, {})[str(key)] = {**cfg.kwargs, "num_warps": cfg.num_warps,
                                                     "num_stages": cfg.num_stages}
    return chosen


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-30b-a3b")
    ap.add_argument("--quant", default=None)
    ap.add_argument("--windows", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--settings", nargs="+", default=["1", "0"],
                    help="STRATA_PDL (or --knob) values, in order; with several knobs, comma-separated")
    ap.add_argument("--knob", nargs="+", default=None,
                    help="KernelOptions fields to set instead, e.g. norm_max_rows")
    ap.add_argument("--set", nargs="+", default=[], metavar="MODULE.NAME=VALUE",
                    help="module constants fixed for every setting, set first (e.g. a shorter autotune list)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", default=None, help="a JSON file of the results")
    args = ap.parse_args()
    set_constants(args.set)
    target = random_target(args.shape, device="cuda", dtype=torch.bfloat16, quant=args.quant)
    prompt = torch.randint(0, target.cfg.vocab_size, (512,), generator=torch.Generator().manual_seed(0)).tolist()
    opts = EngineConfig(backend="graphs+triton", max_len=512 + args.new_tokens + max(args.windows) + 1)
    first: dict[int, list[int]] = {}
    rows: list[dict] = []
    knobs = args.knob or []
    unknown = set(knobs) - set(KernelOptions.__dataclass_fields__)
    if unknown:
        fields = ", ".join(KernelOptions.__dataclass_fields__)
        ap.error(f"--knob {sorted(unknown)}: not KernelOptions fields ({fields})")
    name = ",".join(knobs) or "STRATA_PDL"
    for setting in args.settings:
        kernel_options = KernelOptions()
        if knobs:
            values = ast.literal_eval(setting if len(knobs) == 1 else f"({setting},)")
            kernel_options = replace(kernel_options, **dict(zip(knobs, [values] if len(knobs) == 1 else values,
                                                                strict=True)))
        else:
            os.environ["STRATA_PDL"] = setting
        for w in args.windows:
            engine = Engine(target, config=replace(opts, pad_rows=w, kernels=kernel_options))
            ids = engine.generate(prompt, args.new_tokens).output_ids
            runs = [engine.generate(prompt, args.new_tokens) for _ in range(args.runs)]
            ms = [1e3 * r.decode_s / max(len(r.accept_lengths), 1) for r in runs]
            same = all(r.output_ids == ids for r in runs) and first.setdefault(w, ids) == ids
            print(f"{args.shape} {args.quant or 'bf16'} W={w} {name}={setting}: {statistics.median(ms):.3f} ms "
                  f"a step (median of {args.runs}), outputs identical: {same}", flush=True)
            rows.append({"window": w, "setting": setting, "ms_per_step": statistics.median(ms), "runs_ms": ms,
                         "outputs_identical": same, "tuned": tuned_shapes()})
    if args.out:
        Path(args.out).write_text(json.dumps({
            "command": " ".join(sys.argv), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": importlib.import_module("triton").__version__, "shape": args.shape, "quant": args.quant,
            "new_tokens": args.new_tokens, "knobs": name, "set": args.set, "results": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
