"""Time and peak memory of converting a large DFlash drafter (5 layers, hidden 2560, ~0.5B params).

Usage: python tools/convert_bench.py WORK_DIR"""

import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import write_hf_drafter  # noqa: E402

from strata.dflash.converter import convert_hf_to_gguf  # noqa: E402

work = Path(sys.argv[1])
src = write_hf_drafter(work / "hf", layers=5, hidden=2560, heads=32, kv_heads=8, head_dim=128, intermediate=9728,
                       taps=(1, 9, 17, 25, 33), num_target_layers=36, vocab=151936, dtype=torch.bfloat16)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
art = convert_hf_to_gguf(src, work / "d.gguf", progress=False)
dt = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(f"params {art.parameter_count:,} tensors {len(art.tensors)} convert {dt:.1f} s "
      f"peak RSS {peak / 1024:.0f} MiB (after writing the source: {before / 1024:.0f} MiB) "
      f"file {(work / 'd.gguf').stat().st_size / 2**20:.0f} MiB")
