"""The MoE expert kernels of a verify window on the GPU, per layer of the Qwen3-30B-A3B shape (128 experts,
top-8, intermediate 768, hidden 2048, bf16, random routing): one GEMV per (row, expert) assignment vs each
expert hit once for all its rows (triton_kernels._experts_grouped), each checked against ops.experts_grouped.
Captured in a CUDA graph, 10 calls a replay; sets EXPERT_GROUP_MIN_ROWS.

    python tools/expert_kernels_micro.py"""

import sys

import torch

sys.path.insert(0, "src")
from strata.layers import ops, triton_kernels as tk  # noqa: E402

torch.manual_seed(0)
E, I, H = 128, 768, 2048
dev = "cuda"
gate_up = torch.randn(2, E, I, H, device=dev, dtype=torch.bfloat16) * 0.02
down = torch.randn(E, H, I, device=dev, dtype=torch.bfloat16) * 0.02
router = torch.randn(E, H, device=dev, dtype=torch.bfloat16)
for n in (2, 4, 8, 16):
    h = torch.randn(n, H, device=dev, dtype=torch.bfloat16)
    w, e = ops.route(h, router, 8, True)
    ref = ops.experts_grouped(h, gate_up, down, w, e)
    line = f"n={n} distinct {e.unique().numel()}:"
    for grouped in (False, True):
        out = tk.experts(h, gate_up, down, w, e, grouped=grouped)
        err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(10):
                tk.experts(h, gate_up, down, w, e, grouped=grouped)
        g.replay()
        torch.cuda.synchronize()
        s, f = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(5):
            g.replay()
        f.record()
        f.synchronize()
        line += f" {'grouped' if grouped else 'per-assignment'} {s.elapsed_time(f) * 1e3 / 50:.1f} us/layer (err {err:.1e});"
    print(line, flush=True)
