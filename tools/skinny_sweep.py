"""Sweep the skinny GEMM's (BLOCK_N, BLOCK_K, num_warps, num_stages) at given row counts against cuBLAS
over a decoder's projections (GPU only; writes JSON). Each call is captured in a CUDA graph over enough
weight copies to defeat L2; median of several replays. Used to choose SKINNY_CONFIGS and SKINNY_MAX_ROWS.

    python tools/skinny_sweep.py --rows 16 33 64 --out skinny.json"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, "src")
from strata.layers import triton_kernels as tk  # noqa: E402

#: Qwen3-8B: (name, N, K, glu, calls per decoder step)
SHAPES = [("qkv", 6144, 4096, False, 36), ("o", 4096, 4096, False, 36), ("gate_up", 2 * 12288, 4096, True, 36),
          ("down", 4096, 12288, False, 36), ("lm_head", 151936, 4096, False, 1)]


def timed(fn, reps: int = 10) -> float:
    """us per fn() call, fn captured in a graph."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        n = fn()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3 / n)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[33])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dev = torch.device("cuda")
    configs = [c for c in itertools.product((32, 64, 128), (64, 128, 256), ((4, 3), (4, 4), (8, 3)))]
    configs = [(n, k, w, s) for n, k, (w, s) in configs]
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "shapes": SHAPES, "rows": {}}
    for rows in args.rows:
        per = {}
        for name, n, k, glu, count in SHAPES:
            copies = max(1, (400 << 20) // (n * k * 2))
            ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5 for _ in range(copies)]
            x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)

            def cublas():
                for w in ws:
                    y = F.linear(x, w)
                    if glu:
                        y = F.silu(y[:, :n // 2]) * y[:, n // 2:]
                return len(ws)

            ref = F.linear(x.float(), ws[0].float())
            if glu:
                ref = F.silu(ref[:, :n // 2]) * ref[:, n // 2:]
            entry = {"cublas_us": timed(cublas), "configs": {}}
            for cfg in configs:
                def ours(cfg=cfg):
                    for w in ws:
                        tk.skinny(x, w, glu=glu, config=cfg)
                    return len(ws)
                try:
                    err = ((tk.skinny(x, ws[0], glu=glu, config=cfg).float() - ref).abs().max() /
                           ref.abs().max()).item()
                    entry["configs"][str(cfg)] = {"us": timed(ours), "rel_err": err}
                except Exception as e:  # noqa: BLE001 - a config that does not fit is recorded and skipped
                    entry["configs"][str(cfg)] = {"error": f"{type(e).__name__}"[:60]}
            per[name] = entry
            del ws
            torch.cuda.empty_cache()
        totals = {}
        for cfg in map(str, configs):
            try:
                totals[cfg] = sum(per[s[0]]["configs"][cfg]["us"] * s[4] for s in SHAPES)
            except KeyError:
                pass
        best = min(totals, key=totals.get)
        cublas_total = sum(per[s[0]]["cublas_us"] * s[4] for s in SHAPES)
        result["rows"][str(rows)] = {"per_shape": per, "total_us": totals, "best_config": best,
                                     "best_total_us": totals[best], "cublas_total_us": cublas_total,
                                     "best_per_shape": {s[0]: min((v["us"], c) for c, v in per[s[0]]["configs"].items()
                                                                  if "us" in v) for s in SHAPES}}
        print(f"rows {rows}: cuBLAS {cublas_total / 1e3:.2f} ms/step, best {best} {totals[best] / 1e3:.2f} ms/step",
              flush=True)
        for s in SHAPES:
            us, c = result["rows"][str(rows)]["best_per_shape"][s[0]]
            print(f"  {s[0]}: cuBLAS {per[s[0]]['cublas_us']:.1f} us, best {c} {us:.1f} us", flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
