"""The 1-row GEMV's configurations on a GPU: every projection of the dense 8B, hybrid 9B and MoE 30B-A3B
shapes, and the MoE layer's per-expert gate/up and down GEMVs (8 experts of 128, a different set each call;
the down GEMVs summing the slots themselves, and not, then summed by torch.compile's sum_slots),
timed in CUDA graphs (skinny_sweep.timed) over enough weight copies that nothing is served from L2. Prints
and writes, per configuration, microseconds per shape and the effective bandwidth; every configuration is
first checked against F.linear (the experts against ops.experts_routed).

    PYTHONPATH=src python3 tools/gemv_sweep.py --out bench/results/gemv-sweep-h200.json [--shapes 30b-a3b]
        [--experts-only]"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F

from strata.layers import ops, pdl
from strata.layers import triton_kernels as tk
from skinny_sweep import timed  # tools/, the script's own directory

DENSE = {  # (N, K) of a 1-row projection, per shape
    "8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (2 * 12288, 4096), "down": (4096, 12288)},
    "30b-a3b": {"qkv": (5120, 2048), "o": (2048, 4096), "router": (128, 2048)},
}
EXPERTS, INTER, HIDDEN, TOP_K = 128, 768, 2048, 8
BYTES = 1 << 28  # weight bytes cycled through per timing (several times L2)


def per_call(fn, calls: int):
    """fn(0..calls-1) as one step, returning the count (skinny_sweep.timed's contract): us per call."""
    def step() -> int:
        for i in range(calls):
            fn(i)
        return calls

    return timed(step)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", nargs="+", choices=list(DENSE), help="only these shapes' projections")
    ap.add_argument("--experts-only", action="store_true", help="only the experts, the GEMVs without the sum at "
                                                                 "their configurations")
    args = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    configs = [c for c in itertools.product((1, 2, 4, 8), (128, 256, 512, 1024), (1, 2, 4))
               if 64 * c[2] <= c[0] * c[1] <= 4096]
    result = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "configs": configs,
              "dense": {}, "experts": {}}
    for shape, projections in ({} if args.experts_only else DENSE).items():
        if args.shapes and shape not in args.shapes:
            continue
        for name, (n, k) in projections.items():
            copies = max(2, BYTES // (n * k * 2))
            ws = [torch.randn(n, k, device=dev, dtype=dt, generator=gen) * 0.02 for _ in range(copies)]
            x = torch.randn(1, k, device=dev, dtype=dt, generator=gen)
            for glu in ((False, True) if name == "gate_up" else (False,)):
                want = F.linear(x, ws[0]) if not glu else ops.silu_mul(F.linear(x, ws[0]))
                row = {}
                for c in configs:
                    got = tk.gemv(x, ws[0], glu=glu, config=c)
                    err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
                    if err > 2e-2:
                        row[str(c)] = {"error": err}
                        continue
                    us = per_call(lambda i: tk.gemv(x, ws[i % copies], glu=glu, config=c), 2 * copies)
                    row[str(c)] = {"us": us, "GBps": n * k * 2 / us / 1e3}
                key = f"{shape} {name}{' glu' if glu else ''} {n}x{k}"
                result["dense"][key] = row
                best = min((v["us"], c) for c, v in row.items() if "us" in v)
                print(key, "best", best, "now", row.get(str(tk.GEMV_GLU_CONFIG if glu else tk.GEMV_CONFIG)),
                      flush=True)
            del ws
    gate_up = torch.randn(2, EXPERTS, INTER, HIDDEN, device=dev, dtype=dt, generator=gen) * 0.02
    down = torch.randn(EXPERTS, HIDDEN, INTER, device=dev, dtype=dt, generator=gen) * 0.02
    h = torch.randn(1, HIDDEN, device=dev, dtype=dt, generator=gen)
    sets = [torch.randperm(EXPERTS, device=dev, generator=gen)[:TOP_K].sort().values.view(1, TOP_K)
            for _ in range(32)]
    weights = torch.full((1, TOP_K), 1.0 / TOP_K, device=dev, dtype=dt)
    want = ops.experts_routed(h, gate_up, down, weights, sets[0])
    saved = tk.EXPERT_GLU_CONFIG, tk.EXPERT_DOWN_CONFIG, tk.EXPERT_DOWN_SUM_CONFIG
    pdl.compiled(dev)
    compiled_sum = torch.compile(ops.sum_slots, dynamic=False, fullgraph=True)
    sum_configs = [c for c in itertools.product((1, 2, 4, 8, 16), (64, 128, 256), (1, 2, 4, 8))
                   if 8 <= TOP_K * c[0] * c[1] // (32 * c[2]) <= 64]
    for part in ("glu", "down", "down_sum"):
        row = {}
        now = saved[0] if part == "glu" else saved[1] if part == "down" else saved[2]
        for c in sum_configs if part == "down_sum" else [now] if args.experts_only else configs:
            tk.EXPERT_GLU_CONFIG, tk.EXPERT_DOWN_CONFIG, tk.EXPERT_DOWN_SUM_CONFIG = (
                (c, saved[1], saved[2]) if part == "glu" else (saved[0], c, saved[2]) if part == "down"
                else (saved[0], saved[1], c))
            reduce = None if part == "down_sum" else compiled_sum  # a reduce leaves the down GEMVs unsummed
            got = tk.experts(h, gate_up, down, weights, sets[0], reduce=reduce)
            err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
            if err > 2e-2:
                row[str(c)] = {"error": err}
                continue
            row[str(c)] = {"us_layer": per_call(lambda i: tk.experts(h, gate_up, down, weights, sets[i % 32],
                                                                     reduce=reduce), 32)}
        tk.EXPERT_GLU_CONFIG, tk.EXPERT_DOWN_CONFIG, tk.EXPERT_DOWN_SUM_CONFIG = saved
        result["experts"][part] = row
        best = min((v["us_layer"], c) for c, v in row.items() if "us_layer" in v)
        print("experts", part, "best", best, "now", row.get(str(now)), flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
