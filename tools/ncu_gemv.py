"""The quantized 1-row GEMVs (layers/quant_kernels.py) on the Qwen3-8B shape's matrices, or with --rows 16 the
few-row GEMMs a verify window runs, each launched once inside a CUDA profiler range after its autotuning, for
Nsight Compute to read their memory and issue counters:

    ncu --clock-control none --profile-from-start off --kernel-name regex:"gemv|skinny" \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \
        python tools/ncu_gemv.py [--types Q4_K Q6_K Q8_0] [--matrices gate_up lm_head o] [--rows 1] \
            [--config "(64, 4, 3, 1)"]

gate_up runs fused (gate and up rows, silu(gate) * up), as the decoder calls it. --config runs every product
at that block shape (configs()'s) in place of autotuning it, which under Nsight Compute takes minutes: on
an H100 the 16-row Q4_K and Q6_K gate_up and down had not finished tuning after 170 s."""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from quant_sweep import NAMES, SHAPES  # noqa: E402
from strata.layers import quant_kernels as qk  # noqa: E402
from strata.layers.quant import random_blocks  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--types", nargs="+", default=["Q4_K", "Q6_K", "Q8_0"])
    ap.add_argument("--matrices", nargs="+", default=["gate_up", "lm_head", "o"])
    ap.add_argument("--rows", type=int, default=1, help="rows of x: 1 (the GEMVs) or up to 16 (the GEMMs)")
    ap.add_argument("--config", type=ast.literal_eval, default=None,
                    help="a block shape for every product (a tuple literal), in place of autotuning")
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    calls = []
    for name in args.types:
        for mat in args.matrices:
            n, k = SHAPES[mat]
            glu = mat == "gate_up"
            n = n // 2 if glu else n
            data = random_blocks(NAMES[name], 2 * n if glu else n, k, "cuda", gen)
            x = torch.randn(args.rows, k, device="cuda", dtype=torch.bfloat16)
            qk.matmul(x, data, NAMES[name], n, glu=glu, config=args.config)  # tuned here, outside the range
            calls.append((x, data, NAMES[name], n, glu))
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for x, data, qtype, n, glu in calls:
        qk.matmul(x, data, qtype, n, glu=glu, config=args.config)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
