"""What a kernel boundary costs in a CUDA graph, three ways: a chain of L kernels, each reading the 4096
floats the one before wrote (every program all of them, as a GEMV reads x) and streaming its own S bytes
of a buffer larger than L2 (a product's weights), replayed as one graph; us a kernel for
- plain: ordered launches;
- pdl: launched with PDL, each program waiting (griddepcontrol.wait) for the whole kernel before, as
  layers/pdl.py's settle does;
- flag: launched with PDL but never waiting on the grid: each program of a kernel, having stored its
  outputs, adds 1 to that kernel's counter (release, GPU scope); the next kernel's programs poll the counter
  (acquire) until every program of the one before has arrived. The counters are zeroed at the graph's start.
Its weights do not depend on the kernel before: each setting also runs with a program's first loads of them
issued before its wait (the rows marked early; in the last mode, before its polling).
- persist (with --persist P ...): the whole chain as one launch of resident programs, each link a phase that
  ends at a grid barrier (arrive: a release add to the phase's counter; wait: acquire polls until every program
  has arrived); between its arrival and its wait a program loads the first P blocks of its next phase's
  weights into registers (P = 0: none), so that they stream while the slowest program finishes, as a persistent
  layer kernel would have them. It runs only where its programs' registers let them all be resident at once
  (else its rows show -).

With --layer, each mode also runs a step: --layers layers of links that stream the listed MB in turn, as a
decode layer's kernels do (the norm, q/k/v, the rotation, attention, ... each a link), us a step against its
bytes at copy speed.

usage: python tools/boundary_micro.py [--kernels 200] [--programs 512] [--mbytes 0 4 10 40] [--persist 0 8]
       [--layer 0 14 0 3 0 9.4 0 56.6 0 28 --layers 36] [--out F.json]"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from skinny_sweep import timed  # tools/ is the script's directory

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from strata.bench.run import copy_bandwidth  # noqa: E402

X = tl.constexpr(4096)


@triton.jit
def _acquire(ptr):
    """The 32-bit counter at ptr, loaded as an acquire at GPU scope."""
    return tl.inline_asm_elementwise("ld.acquire.gpu.global.u32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _poll(ptr, target):
    """Spin until the counter at ptr reaches target (or 2**16 tries, tens of ms: a wrong count then shows in the
    check after the run, not as a hung device)."""
    seen = _acquire(ptr)
    tries = 0
    while (seen < target) & (tries < 65536):
        seen = _acquire(ptr)
        tries += 1


@triton.jit
def link_kernel(x_ptr, y_ptr, w_ptr, words, cnt_ptr, k, prev_programs, MODE: tl.constexpr, EARLY: tl.constexpr,
                BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    n = tl.num_programs(0)
    per = words // n
    lane = tl.arange(0, BLOCK)
    w = w_ptr + pid.to(tl.int64) * per
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    first = tl.zeros([BLOCK], dtype=tl.int32)
    if EARLY:
        first = tl.load(w + lane, mask=lane < per, other=0)
    if MODE == 1:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if MODE == 2:
        if k > 0:
            _poll(cnt_ptr + k - 1, prev_programs)
        tl.extra.cuda.gdc_launch_dependents()
    xs = tl.sum(tl.load(x_ptr + tl.arange(0, X)), axis=0)
    start = BLOCK if EARLY else 0
    acc += first
    for off in range(start, per, BLOCK):
        acc += tl.load(w + off + lane, mask=off + lane < per, other=0)
    s = tl.sum(acc, axis=0).to(tl.float32) * 1e-9 + xs * 0.5
    outs = X // n
    o = tl.arange(0, 16)
    tl.store(y_ptr + pid * outs + o, s + o.to(tl.float32), mask=o < outs)
    if MODE == 2:
        tl.debug_barrier()
        tl.atomic_add(cnt_ptr + k, 1, sem="release", scope="gpu")


@triton.jit
def _phase_ahead(w_ptr, words_ptr, base_ptr, k, pid, n, PRE: tl.constexpr, BLOCK: tl.constexpr):
    """Phase k's words a program, its first word and its first PRE blocks of BLOCK words, loaded."""
    per = tl.load(words_ptr + k) // n
    w = w_ptr + tl.load(base_ptr + k) + pid.to(tl.int64) * per
    lane = tl.arange(0, BLOCK)
    pre = ()
    for j in tl.static_range(PRE):
        pre += (tl.load(w + j * BLOCK + lane, mask=j * BLOCK + lane < per, other=0),)
    return per, w, pre


@triton.jit
def persistent_kernel(x_ptr, w_ptr, words_ptr, base_ptr, cnt_ptr, phases, PRE: tl.constexpr, BLOCK: tl.constexpr):
    """link_kernel's chain of `phases` links as phases of one launch (the persist mode): x double-buffered
    (phase k reads half k % 2, writes the other); phase k streams words_ptr[k] words from base_ptr[k] (both
    listed one past the last phase, as 0)."""
    pid = tl.program_id(0)
    n = tl.num_programs(0)
    lane = tl.arange(0, BLOCK)
    outs = X // n
    o = tl.arange(0, 16)
    per, w, pre = _phase_ahead(w_ptr, words_ptr, base_ptr, 0, pid, n, PRE, BLOCK)
    for k in range(phases):
        xs = tl.sum(tl.load(x_ptr + (k % 2) * X + tl.arange(0, X)), axis=0)
        acc = tl.zeros([BLOCK], dtype=tl.int32)
        for j in tl.static_range(PRE):
            acc += pre[j]
        for off in range(PRE * BLOCK, per, BLOCK):
            acc += tl.load(w + off + lane, mask=off + lane < per, other=0)
        s = tl.sum(acc, axis=0).to(tl.float32) * 1e-9 + xs * 0.5
        tl.store(x_ptr + ((k + 1) % 2) * X + pid * outs + o, s + o.to(tl.float32), mask=o < outs)
        tl.debug_barrier()
        tl.atomic_add(cnt_ptr + k, 1, sem="release", scope="gpu")
        per, w, pre = _phase_ahead(w_ptr, words_ptr, base_ptr, k + 1, pid, n, PRE, BLOCK)
        _poll(cnt_ptr + k, n)


def link_words(mbytes: float, programs: int) -> int:
    """A link's words: mbytes of int32, a whole number for each program (at least one)."""
    return max(int(mbytes * 2 ** 20) // 4 // programs * programs, programs)


def link_bases(sizes: list[int], total: int) -> list[int]:
    """Each link's first word in a buffer of `total`: one after another, from 0 again where one would not fit."""
    bases, at = [], 0
    for size in sizes:
        at = 0 if at + size > total else at
        bases.append(at)
        at += size
    return bases


def run_persistent(w: torch.Tensor, sizes: list[int], programs: int, pre: int, reps: int) -> float | None:
    """us a link of the chain of links of `sizes` words, run as one persistent launch; None where its programs
    would not all be resident at once (by their registers: the barrier would never open)."""
    words = torch.tensor([*sizes, 0], dtype=torch.int32, device="cuda")
    bases = torch.tensor([*link_bases(sizes, w.numel()), 0], dtype=torch.int64, device="cuda")
    x = torch.zeros(2 * X, device="cuda")
    cnt = torch.zeros(len(sizes), dtype=torch.int32, device="cuda")
    compiled = persistent_kernel.warmup(x, w, words, bases, cnt, len(sizes), PRE=pre, BLOCK=512, num_warps=4,
                                        grid=(programs,))
    compiled._init_handles()
    props = torch.cuda.get_device_properties(0)
    regs = -(-max(compiled.n_regs, 1) // 8) * 8  # a thread's registers, as allocated (in eights)
    per_sm = min(getattr(props, "regs_per_multiprocessor", 65536) // (regs * 4 * 32), 16)
    if programs > per_sm * props.multi_processor_count:
        return None

    def chain() -> int:
        cnt.zero_()
        persistent_kernel[(programs,)](x, w, words, bases, cnt, len(sizes), PRE=pre, BLOCK=512, num_warps=4)
        return len(sizes)

    us = timed(chain, reps)
    assert bool((cnt == programs).all()), "a phase's barrier gave up: fewer programs resident than launched?"
    return us


def run(w: torch.Tensor, sizes: list[int], programs: int, mode: int, early: bool, reps: int) -> float:
    """us a link of the chain of links of `sizes` words, a launch each."""
    bases = link_bases(sizes, w.numel())
    xs = [torch.zeros(X, device="cuda") for _ in range(2)]
    cnt = torch.zeros(len(sizes), dtype=torch.int32, device="cuda")
    opts = {"launch_pdl": True} if mode else {}

    def chain() -> int:
        cnt.zero_()
        for k, (size, base) in enumerate(zip(sizes, bases)):
            link_kernel[(programs,)](xs[k % 2], xs[(k + 1) % 2], w[base:], size, cnt, k, programs, MODE=mode,
                                     EARLY=early, BLOCK=512, num_warps=4, **opts)
        return len(sizes)

    us = timed(chain, reps)
    assert int(cnt[-1]) == (programs if mode == 2 else 0)
    return us


def timings(w: torch.Tensor, sizes: list[int], programs: int, early: bool, persist: list[int],
            reps: int) -> dict:
    """us a link of the chain of links of `sizes` words in each mode: plain, pdl, flag and (not early) persist_P
    for each P in persist (None where its programs would not all be resident)."""
    us = {name: run(w, sizes, programs, mode, early, reps) for mode, name in ((0, "plain"), (1, "pdl"), (2, "flag"))}
    for pre in [] if early else persist:
        us[f"persist_{pre}"] = run_persistent(w, sizes, programs, pre, reps)
    return us


def shown(values: dict, spec: str) -> str:
    """name value pairs for a printed line, - for a mode that did not run."""
    return "  ".join(f"{k} {'-' if v is None else format(v, spec)}" for k, v in values.items())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernels", type=int, default=200)
    ap.add_argument("--programs", type=int, nargs="+", default=[132, 512])
    ap.add_argument("--mbytes", type=float, nargs="+", default=[0, 4, 10, 40])
    ap.add_argument("--persist", type=int, nargs="*", default=[],
                    help="also the persist mode with these counts of 512-word blocks loaded ahead (e.g. 0 8)")
    ap.add_argument("--layer", type=float, nargs="*", default=[],
                    help="also a chain of --layers layers whose links stream these MB each in turn (a decode "
                         "layer's kernels: e.g. 0 14 0 3 0 9.4 0 56.6 0 28), us a step")
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    bw = copy_bandwidth("cuda", 2 ** 30) / 1e9
    w = torch.ones(2 ** 29, dtype=torch.int32, device="cuda")  # 2 GiB: a chain's weights come from memory
    rows = []
    print(f"{torch.cuda.get_device_name()}, copy {bw:.0f} GB/s, {args.kernels} kernels a graph, us a kernel")
    for programs in args.programs:
        for mb in args.mbytes:
            sizes = [link_words(mb, programs)] * args.kernels
            for early in (False, True):
                us = timings(w, sizes, programs, early, args.persist, args.reps)
                rows.append({"programs": programs, "mbytes": mb, "early": early,
                             "bytes_us": mb * 2 ** 20 / bw / 1e3, **us})
                print(f"programs {programs:4d} MB {mb:5.1f} early {int(early)}  "
                      f"{shown({'bytes': rows[-1]['bytes_us'], **us}, '6.2f')}", flush=True)
    steps = []
    if args.layer:
        print(f"a step of {args.layers} layers of links of {args.layer} MB, us a step")
    for programs in args.programs if args.layer else []:
        sizes = [link_words(mb, programs) for mb in args.layer] * args.layers
        us = {k: None if v is None else v * len(sizes)
              for k, v in timings(w, sizes, programs, False, args.persist, args.reps).items()}
        steps.append({"programs": programs, "bytes_us": sum(sizes) * 4 / bw / 1e3, "links": len(sizes), **us})
        print(f"programs {programs:4d}  {shown({'bytes_us': steps[-1]['bytes_us'], **us}, '8.1f')}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_GBps": bw, "kernels": args.kernels,
                       "torch": torch.__version__, "triton": triton.__version__, "command": " ".join(sys.argv),
                       "rows": rows, "layer_mbytes": args.layer, "layers": args.layers, "steps": steps}, f,
                      indent=1)


if __name__ == "__main__":
    main()
