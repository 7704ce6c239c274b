"""GPU micro-benchmark of a gated DeltaNet layer between its projections, Qwen3.5-9B shape (16 key / 32 value
heads of 128, conv 4): the torch composition with fla-core's kernel (GatedDeltaNet.mix through the kernel
set) against delta_kernels' two launches at each (BV, warps) config, for decode (T=1) and a verify window.
Each variant first checks its outputs and end state against mix's; timings are CUDA graphs of 24 layers
(each with its own state, as in a step) replayed, per layer."""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from strata.layers import delta_kernels
from strata.layers.kernels import TritonKernels
from strata.layers.linear_attention import GatedDeltaNet

CONFIGS = [(None, 4), (None, 8), (None, 16), (64, 4), (32, 4), (16, 1), (16, 2), (8, 1)]


def layer_and_states(n: int, slots: int, dev, dtype):
    torch.manual_seed(0)
    layer = GatedDeltaNet(0, 4096, 16, 32, 128, 128, 4, 1e-6)
    with torch.no_grad():
        layer.conv_weight.normal_(0, 0.3)
        layer.dt_bias.normal_(0, 1)
        layer.A_log.uniform_(0, 2)
        layer.norm.weight.normal_(1, 0.1)
    layer = layer.to(dev, dtype)
    states = []
    for _ in range(n):
        s = layer.make_state(slots, dev, dtype)
        s.rec.normal_(0, 0.05)
        s.conv.normal_(0, 1)
        s.qk.normal_(0, 1)
        s.v.normal_(0, 1)
        s.gb[0].uniform_(-1, 0)
        s.gb[1].uniform_(0, 1)
        s.begin.fill_(96)
        s.end.fill_(96 + slots)
        states.append(s)
    return layer, states


def copy_state(dst, src):
    for name in ("conv", "rec", "qk", "v", "gb", "begin", "end"):
        getattr(dst, name).copy_(getattr(src, name))


def timed(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    ms = []
    for _ in range(5):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            g.replay()
        b.record()
        torch.cuda.synchronize()
        ms.append(a.elapsed_time(b) / reps)
    return statistics.median(ms)


@torch.inference_mode()
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--out")
    args = ap.parse_args()
    dev, dtype = torch.device("cuda"), torch.bfloat16
    kernels = TritonKernels()
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "layers": args.layers, "rows": {}}
    for t in args.rows:
        layer, states = layer_and_states(args.layers, 16, dev, dtype)
        ref_state = layer.make_state(16, dev, dtype)
        proj = torch.randn(t, layer.channels + 32 * 128 + 64, device=dev, dtype=dtype)
        first = torch.tensor(96 + 16, device=dev)  # at the end: decode's case
        rollback = torch.tensor(96 + 5, device=dev)  # 5 kept rows replayed
        row = {}
        init = layer.make_state(16, dev, dtype)
        copy_state(init, states[0])  # the timings advance the states: every check starts from this copy
        cases = {"at_end": first, "rollback": rollback, "fresh": torch.tensor(0, device=dev)}
        wants = {}
        for name, f in cases.items():
            copy_state(ref_state, init)
            wants[name] = (layer.mix(proj, f, ref_state, kernels), ref_state.rec.clone(), ref_state.conv.clone())
        row["fla_mix_us"] = 1e3 * timed(lambda: [layer.mix(proj, first, s, kernels) for s in states]) / args.layers
        row["fla_mix_rollback_us"] = 1e3 * timed(
            lambda: [layer.mix(proj, rollback, s, kernels) for s in states]) / args.layers
        for cfg in CONFIGS:
            entry = {}
            try:
                for name, f in cases.items():
                    copy_state(ref_state, init)
                    got = delta_kernels.gated_delta_net(layer, proj, f, ref_state, kernels.gated_rms_norm, config=cfg)
                    w, wr, wc = wants[name]
                    entry[name + "_out_rel_err"] = ((got.float() - w.float()).abs().max() / w.float().abs().max()).item()
                    entry[name + "_rec_rel_err"] = ((ref_state.rec - wr).abs().max() / wr.abs().max()).item()
                    entry[name + "_conv_equal"] = bool(ref_state.conv.equal(wc))
                entry["us"] = 1e3 * timed(lambda: [delta_kernels.gated_delta_net(
                    layer, proj, first, s, kernels.gated_rms_norm, config=cfg) for s in states]) / args.layers
                entry["rollback_us"] = 1e3 * timed(lambda: [delta_kernels.gated_delta_net(
                    layer, proj, rollback, s, kernels.gated_rms_norm, config=cfg) for s in states]) / args.layers
            except Exception as e:  # noqa: BLE001 - a config that fails is reported
                entry["error"] = f"{type(e).__name__}: {e}"[:200]
            row[str(cfg)] = entry
            print(t, cfg, entry, flush=True)
        print(t, "fla mix", row["fla_mix_us"], row["fla_mix_rollback_us"], flush=True)
        result["rows"][str(t)] = row
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
