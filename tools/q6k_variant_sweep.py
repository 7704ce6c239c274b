"""Time variants of skinny_q6k8 (tools/q6k_variants/NAME.py, each a skinny_q6k8_kernel run in quant_kernels'
namespace) on the device: 16-row products over random Q6_K blocks, cold; each variant's output compared with
v0's (main's kernel) at the same shape.

usage: OUT=DIR NAME=FILE.json python tools/q6k_variant_sweep.py v0,v1 64.4.2.1.0,64.4.2.4.102 lm_head,down,v
(shapes BLOCK_N.warps.stages.split.maxnreg, 0 = no cap)"""
import itertools, json, os, sys, time
from pathlib import Path
import torch, triton, triton.language as tl
sys.path.insert(0, 'src'); sys.path.insert(0, 'tools')
from strata.layers import quant_kernels as qk
from strata.layers.quant import random_blocks
from quant_sweep import timed

kernels = qk._build()
variants = {}
for name in sys.argv[1].split(','):
    g = dict(vars(qk)); g['triton'] = triton; g['tl'] = tl
    exec(compile(open(f'tools/q6k_variants/{name}.py').read(), os.path.abspath(f'tools/q6k_variants/{name}.py'), 'exec'), g)
    variants[name] = g['skinny_q6k8_kernel']
configs = [tuple(int(v) for v in c.split('.')) for c in sys.argv[2].split(',')]  # bn.warps.stages.split.maxnreg
mats = {"lm_head": (151936, 4096), "down": (4096, 12288), "v": (1024, 4096)}
rows = int(os.environ.get('ROWS', 16))
gen = torch.Generator(device="cuda").manual_seed(0)
src = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
copy = 2 * src.numel() / timed(lambda: src.clone())
print(f"{torch.cuda.get_device_name()} triton {triton.__version__} copy {copy / 1e9:.0f} GB/s", flush=True)
out = {"device": torch.cuda.get_device_name(), "copy_GBps": copy / 1e9, "rows": rows, "runs": []}
for mat in sys.argv[3].split(','):
    n, k = mats[mat]
    data = random_blocks(qk.Q6_K, n, k, "cuda", gen)
    copies = [data] + [data.clone() for _ in range(qk.cdiv(256 << 20, data.numel()) - 1)]
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    x8 = qk.quantize_x(x)
    ref = None
    for (bn, w, st, sp, reg), (vname, fn) in itertools.product(configs, variants.items()):
        if vname == 'v0':
            ref = None
        if not qk._split_fits("skinny_q6k8", bn, sp, n, k):
            continue
        y = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
        ws = torch.empty(max(1, 2 * 16 * sp * qk.cdiv(n, bn) * bn), dtype=torch.float32, device="cuda")
        opts = {"maxnreg": reg} if reg else {}
        def run(d=data):
            fn[(qk.cdiv(n, bn), sp)](*x8, d, y, ws, qk._counters(x.device), rows, n, k, d.stride(0) // 4, y.stride(0),
                                      GLU=False, BLOCK_N=bn, SPLIT=sp, ASM=True, STAGES=st, num_warps=w,
                                      num_stages=st, **opts)
        try:
            t0 = time.time()
            run()
            torch.cuda.synchronize()
            got = y.clone()
            turn = itertools.count()
            s = timed(lambda: run(copies[next(turn) % len(copies)]), calls=max(10, len(copies)))
        except Exception as e:
            print(f"{mat} {vname} {(bn, w, st, sp, reg)}: {type(e).__name__} {str(e)[:200]}", flush=True)
            continue
        if vname == 'v0':
            ref = got
        same = None if ref is None else bool(torch.equal(got, ref))
        out["runs"].append({"matrix": mat, "variant": vname, "config": [bn, w, st, sp, reg], "us": s * 1e6,
                            "GBps": data.numel() / s / 1e9, "identical_to_v0": same})
        print(f"{mat:8} {vname:4} {(bn, w, st, sp, reg)}: {s * 1e6:8.1f} us {data.numel() / s / 1e9:6.0f} GB/s "
              f"same={same}", flush=True)
    for vname in variants:
        best = min((r for r in out["runs"] if r["matrix"] == mat and r["variant"] == vname), key=lambda r: r["us"],
                   default=None)
        if best:
            print(f"BEST {mat} {vname}: {best['us']:.1f} us {best['config']}", flush=True)
Path(os.environ.get('OUT', '/tmp')).joinpath(os.environ.get('NAME', 'q6sweep.json')).write_text(json.dumps(out, indent=1))
