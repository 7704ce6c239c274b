"""The MoE paths that only a GPU runs for real, checked token for token on tiny random targets in float32: the
expert cache's captured step (one CUDA graph per stretch between sparse layers, the CPU's experts between
them) at budgets of none, some and all of the experts, against the same target with every expert on the device
and against its eager run; and quantized experts (QuantExperts, one GEMV per assignment inside the graphs),
all or some of them on the device, against the same blocks dequantized. Prints one line per case and exits 1
on any difference, or if a Triton kernel failed and left its torch path (then named). On the CPU the same
cases run without graphs (the tests' twin), the quantized ones only in Triton's interpreter
(TRITON_INTERPRET=1: Q8_0 in about 15 minutes on 2 cores, Q4_K_M longer). On the H200 the cache cases and Q8_0
took 150 s in one run, and Q8_0 alone up to 250 s in another (each engine autotunes, compiles and captures
anew), so give --only quantized far more for its Q4_K_M cases.

    python tools/moe_paths_check.py [--device cuda] [--only cache|quantized]"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from strata.engine.decode import Engine  # noqa: E402
from strata.models.loader import load_target  # noqa: E402
from strata.models.placement import place_experts, sparse_layers  # noqa: E402
from strata.models.random_init import random_target, write_random_model  # noqa: E402

PROMPTS = [[3, 99, 14, 250, 8, 8, 41], [17, 5, 6, 7, 5, 6, 7, 5]]
#: experts of 1.5 MiB in float32 (hidden 128, intermediate 1024), 4 per layer, 2 sparse layers
CACHE_SHAPE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=32, num_experts=4, num_experts_per_tok=2,
                   moe_intermediate_size=1024)
#: the quantized kernels' 256-column tiles
QUANT_SHAPE = dict(hidden_size=256, intermediate_size=256, moe_intermediate_size=256, head_dim=64,
                   num_hidden_layers=2, num_experts=4, num_experts_per_tok=2)


def tokens(target, static: bool, window: int = 1) -> list[list[int]]:
    backend = "graphs+triton" if static else "eager"  # on a CPU the graphs backends run static, uncaptured
    return [Engine(target, max_len=64, backend=backend, pad_rows=window).generate(p, 16).output_ids for p in PROMPTS]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--only", choices=("cache", "quantized"), help="run only the expert cache's cases, or only the "
                                                                  "quantized experts' (default: both)")
    args = ap.parse_args()
    dev, failed = args.device, []

    def report(name: str, got, want) -> None:
        if got != want:
            failed.append(name)
        print(f"{'ok   ' if got == want else 'DIFF '} {name}" + ("" if got == want else f": {got} != {want}"))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if args.only != "quantized":
            with tempfile.TemporaryDirectory() as d:
                cache_cases(dev, report, Path(d))
        if args.only != "cache":
            quantized_cases(dev, report)
    fallbacks = sorted({str(w.message) for w in caught if str(w.message).startswith("Triton kernel")})
    for message in fallbacks:  # the torch path then stood in for the kernel under check
        print(f"FELL BACK {message}")
    return 1 if failed or fallbacks else 0


def cache_cases(dev, report, folder: Path) -> None:
    path = write_random_model(folder / "moe", "tiny-moe", seed=5, **CACHE_SHAPE)
    every = load_target(path, device=dev)
    want = tokens(every, static=True)
    report("all experts on the device, eager vs static", tokens(every, static=False), want)
    for mib in (0, 3, 5, 12):
        placed = load_target(path, device=dev, place=lambda m: place_experts(m, dev, mib, 64))
        plan = placed.expert_plan
        report(f"--expert-cache {mib} ({plan.on_device} of {plan.total} on the device), static",
               tokens(placed, static=True), want)
        report(f"--expert-cache {mib}, static, 8-row windows", tokens(placed, static=True, window=8),
               tokens(every, static=True, window=8))


def quantized_cases(dev, report) -> None:
    if dev != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        print("quantized experts: on the CPU only in Triton's interpreter (TRITON_INTERPRET=1); not run")
        return
    for quant in ("Q8_0", "Q4_K_M"):  # the same blocks twice: the second's experts dequantized (bit-exact)
        kept, ref = (random_target("tiny-moe", device=dev, quant=quant, quantized=True, seed=2, **QUANT_SHAPE)
                     for _ in range(2))
        for moe in sparse_layers(ref):
            moe.dequantize_experts()
        report(f"{quant} experts kept quantized vs dequantized, static", tokens(kept, static=True),
               tokens(ref, static=True))
    shape = {**QUANT_SHAPE, "moe_intermediate_size": 1024}  # experts of 0.42-0.49 MiB in Q4_K_M blocks
    ref = random_target("tiny-moe", device=dev, quant="Q4_K_M", quantized=True, seed=3, **shape)
    for moe in sparse_layers(ref):
        moe.dequantize_experts()
    want = tokens(ref, static=True)
    for by in ("static", "prefill"):
        kept = random_target("tiny-moe", device=dev, quant="Q4_K_M", quantized=True, seed=3, **shape)
        place_experts(kept, dev, 2, 64, by=by)  # 4 of 8 on the device
        plan = kept.expert_plan
        report(f"Q4_K_M experts, --expert-cache 2 --expert-placement {by} ({plan.on_device} of {plan.total} in "
               "blocks on the device, the rest dequantized in host memory) vs all dequantized, static",
               tokens(kept, static=True), want)


if __name__ == "__main__":
    sys.exit(main())
