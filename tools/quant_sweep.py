"""Sweep the quantized GEMV and few-row GEMM kernels (layers/kernels/quantized.py) on the Qwen3-8B shape's
matrices of random valid GGUF blocks, on a CUDA device: achieved GB/s (bytes of blocks read per call
over its time) for each type and configuration, against the device's copy bandwidth.

usage: python tools/quant_sweep.py [--types Q4_K Q6_K Q8_0] [--rows 1 16] [--out FILE.json] [--set MODULE.NAME=VALUE]"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from strata.layers.kernels import quantized as qk  # noqa: E402
from strata.layers.kernels.common import cdiv  # noqa: E402
from strata.layers.kernels.qtypes import IQ4_XS, Q4_0, Q4_K, Q5_K, Q6_K, Q8_0  # noqa: E402
from strata.layers.quant import random_blocks  # noqa: E402
from pdl_ab import set_constants  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
          "lm_head": (151936, 4096)}
NAMES = {"Q8_0": Q8_0, "Q4_0": Q4_0, "Q4_K": Q4_K, "Q5_K": Q5_K, "Q6_K": Q6_K, "IQ4_XS": IQ4_XS}


def timed(fn, reps: int = 20, calls: int = 10) -> float:
    """Median seconds per call of fn, replayed `calls` at a time from a CUDA graph, as the decode step's
    graph runs them: launch costs out, back-to-back kernels in."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--types", nargs="+", default=["Q4_K", "Q6_K", "Q8_0"])
    ap.add_argument("--matrices", nargs="+", default=list(SHAPES))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--cold", action="store_true",
                    help="cycle through copies of each matrix (256 MB or more in all), so that its blocks come from "
                         "memory as a decode step's do, not from L2")
    ap.add_argument("--fused-gate-up", action="store_true",
                    help="gate_up as the decoder calls it: gate and up rows fused, silu(gate) * up (by default one "
                         "product of all its rows)")
    ap.add_argument("--out")
    ap.add_argument("--set", nargs="+", default=[], metavar="MODULE.NAME=VALUE",
                    help="module constants set first (e.g. a shorter strata.layers.kernels.tuning.LANE_K_CONFIGS)")
    args = ap.parse_args()
    set_constants(args.set)
    gen = torch.Generator(device="cuda").manual_seed(0)
    src = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    copy = 2 * src.numel() / timed(lambda: src.clone())
    results = {"copy_GBps": copy / 1e9, "set": args.set, "cold": args.cold, "runs": []}
    print(f"copy bandwidth {copy / 1e9:.0f} GB/s")
    for name in args.types:
        qtype = NAMES[name]
        for mat in args.matrices:
            n, k = SHAPES[mat]
            data = random_blocks(qtype, n, k, "cuda", gen)
            dense = qk.dequantize(data, qtype, k)
            glu = args.fused_gate_up and mat == "gate_up"
            if glu:
                n //= 2
            copies = [data] + [data.clone() for _ in range(cdiv(256 << 20, data.numel()) - 1 if args.cold else 0)]
            turn = itertools.count()
            for m in args.rows:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                want = x.float() @ dense.T
                if glu:
                    want = torch.nn.functional.silu(want[:, :n]) * want[:, n:]
                err = ((qk.matmul(x, data, qtype, n, glu=glu).float() - want).abs().max() / want.abs().max()).item()
                results.setdefault("relative_error", {})[f"{name}-{mat}-{m}"] = err
                configs = qk.configs(qtype, m, k, n)
                best = None
                for cfg in configs:
                    try:
                        s = timed(lambda: qk.matmul(x, copies[next(turn) % len(copies)], qtype, n, glu=glu,
                                                    config=cfg), calls=max(10, len(copies)))
                        cfg_err = ((qk.matmul(x, data, qtype, n, glu=glu, config=cfg).float() - want).abs().max()
                                   / want.abs().max()).item()
                    except Exception as e:  # noqa: BLE001 - a configuration the compiler refuses
                        print(f"{name} {mat} m={m} {cfg}: {type(e).__name__}")
                        continue
                    gbps = data.numel() / s / 1e9
                    results["runs"].append({"type": name, "matrix": mat, "glu": glu, "rows": m, "config": cfg,
                                            "us": s * 1e6,
                                            "GBps": gbps, "relative_error": cfg_err})
                    if cfg_err > 0.05:
                        print(f"{name} {mat} m={m} {cfg}: WRONG, relative error {cfg_err:.2e}")
                    if best is None or gbps > best[1]:
                        best = (cfg, gbps, s)
                print(f"{name:6} {mat:8} m={m:2}: best {best[0]} {best[2] * 1e6:8.1f} us {best[1]:7.0f} GB/s "
                      f"({best[1] * 1e9 / copy:.2f} of copy), rel err {err:.1e}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
