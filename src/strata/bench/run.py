"""One benchmark run, everything side by side on the same weights and prompt: the copy bandwidth and
the weight-streaming floor, Strata target-only, DFlash with an oracle drafter and with the real (or a
random) drafter, the per-round split, startup, and transformers' generate when it is installed."""

from __future__ import annotations

import platform
import statistics
import time
from dataclasses import replace

import torch

from ..engine.config import EngineConfig
from ..engine.decode import Engine
from ..engine.drafter import OracleDrafter
from ..engine.stats import Acceptance
from ..layers.kernels import TritonKernels
from ..layers.kernels import quantized as qk
from ..layers.quant import QuantWeight, weight_bytes
from ..models.loader import unpack
from ..models.placement import sparse_layers
from ..models.registry import family
from .peer import PEERS


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device, nbytes: int, reps: int = 10) -> float:
    """Bytes per second of a buffer copy, reads and writes both counted (the PERF-NOTES convention)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * src.numel() * 4 / statistics.median(times)


def bytes_per_token(model, context: int) -> int:
    """Bytes one decode step must read: every weight (quantized ones as stored) except the embedding table,
    of which it reads one row, and a mixture-of-experts layer's experts, of which it reads the top-k; and
    the K/V of `context` cached positions (a linear-attention layer: its recurrent state)."""
    from ..layers.quant import QuantWeight

    cfg = model.cfg
    total = weight_bytes(model)
    for moe in sparse_layers(model):  # dense layers (mlp_only_layers) read their whole MLP
        resident = moe.gate_up_proj.nbytes + moe.down_proj.nbytes  # parameters or QuantExperts
        total += moe.top_k * moe.expert_bytes - resident
    emb = model.embed_tokens.weight
    if not cfg.tie_word_embeddings:
        table = emb.nbytes if isinstance(emb, QuantWeight) else emb.numel() * emb.element_size()
        total -= table - table // cfg.vocab_size
    attention_layers = cfg.num_layers - (len(cfg.linear.layers) if cfg.linear is not None else 0)
    kv = 2 * attention_layers * context * cfg.num_kv_heads * cfg.head_dim * torch.tensor([], dtype=model.dtype).element_size()
    if cfg.linear is not None:  # a linear-attention layer reads its recurrent state (float32) instead of K/V
        lin = cfg.linear
        kv += len(lin.layers) * lin.v_heads * lin.k_dim * lin.v_dim * 4
    return total + kv


#: the largest relative error a quantized product may have against its blocks dequantized (product_check);
#: int8 x alone rounds it by about 1e-2
PRODUCT_TOLERANCE = 0.05


def product_check(model, rows: tuple[int, ...], sample_rows: int = 256, seed: int = 0) -> dict:
    """Each GGML type among the model's quantized matrices, through the kernels the decode runs (on a GPU:
    the compiled code, which the CPU tests' interpreter never runs), against the same blocks dequantized:
    the relative error of x @ W^T over the first sample_rows rows of one matrix of that type, for each row
    count. A product beyond PRODUCT_TOLERANCE stops the bench before anything is timed."""
    import gguf

    first = {}
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, QuantWeight):
                for seg in value.segments:
                    first.setdefault(seg.qtype, (seg.data, value.cols))
    gen = torch.Generator(device=model.device).manual_seed(seed)
    errors = {}
    for qtype, (data, cols) in sorted(first.items()):
        data = data[:sample_rows]
        w = qk.dequantize(data, qtype, cols).float()
        for m in rows:
            x = torch.randn(m, cols, generator=gen, device=data.device).to(model.dtype)
            want = x.float() @ w.T
            got = qk.matmul(x, data, qtype, data.shape[0]).float()
            errors[f"{gguf.GGMLQuantizationType(qtype).name}-{m}"] = \
                ((got - want).abs().max() / want.abs().max()).item()
    wrong = [f"{name} rows: {err:.2e}" for name, err in errors.items() if not err <= PRODUCT_TOLERANCE]
    if wrong:
        raise RuntimeError(f"quantized products off their dequantized blocks (relative error, expected <= "
                           f"{PRODUCT_TOLERANCE}): {', '.join(wrong)}")
    return errors


def timed_runs(engine: Engine, prompt: list[int], new_tokens: int, runs: int) -> dict:
    t0 = time.perf_counter()
    engine.generate(prompt, new_tokens)  # warm-up (captures the CUDA graphs on a GPU)
    sync(engine.target.device)
    warmup_s = time.perf_counter() - t0
    results = []
    for _ in range(runs):
        sync(engine.target.device)
        results.append(engine.generate(prompt, new_tokens))
    tok_s = [r.tok_s for r in results]
    best = results[tok_s.index(statistics.median(tok_s))] if runs % 2 else results[0]
    st = best.stats()
    rounds = max(st["rounds"], 1)
    return {"tok_s": statistics.median(tok_s), "tok_s_runs": tok_s, "tau": st["tau"], "rounds": st["rounds"],
            "new_tokens": st["new_tokens"], "per_position_acceptance": st["per_position_acceptance"],
            "ms_per_round": 1e3 * best.decode_s / rounds, "output_ids": best.output_ids, "warmup_s": warmup_s}


def round_split(engine: Engine, prompt: list[int], new_tokens: int) -> dict:
    engine.config = replace(engine.config, profile=True)
    try:
        res = engine.generate(prompt, new_tokens)
    finally:
        engine.config = replace(engine.config, profile=False)
    rounds = max(len(res.accept_lengths), 1)
    return {"draft_ms": 1e3 * res.draft_s / rounds, "verify_ms": 1e3 * res.verify_s / rounds,
            "other_ms": 1e3 * (res.decode_s - res.draft_s - res.verify_s) / rounds}


def hf_generate(target, prompt: list[int], new_tokens: int, modes: list[str], runs: int) -> dict:
    """transformers' generate on the very same weights (built from Strata's config and state dict)."""
    if target.device.type != "cuda":
        from ..layers.kernels.fla import transformers_in_torch

        transformers_in_torch()
    try:
        import transformers
    except ImportError:
        return {"skipped": "transformers is not installed"}
    if target.host_experts:
        return {"skipped": "experts in host memory (an expert cache): transformers' model is built from the "
                           "device's weights"}
    cfg = target.cfg
    peer = PEERS[cfg.family]
    if isinstance(peer, str):
        return {"skipped": peer}
    common = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                  num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                  num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
                  max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=cfg.tie_word_embeddings,
                  rope_theta=cfg.rope.theta, attention_bias=cfg.attention_bias, eos_token_id=None,
                  bos_token_id=None, pad_token_id=None)
    state = peer.state(unpack(target.state_dict(), family(cfg.family).hf_layout(cfg)), cfg)
    hf_cfg = transformers.AutoConfig.for_model(peer.model_type, **common, **peer.config(cfg))
    with torch.device(target.device):
        model = getattr(transformers, peer.cls)._from_config(hf_cfg, dtype=target.dtype)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [m for m in missing if not m.startswith("lm_head")]:
        return {"skipped": f"state dict mismatch: missing {missing[:3]}, unexpected {unexpected[:3]}"}
    model = model.eval()
    ids = torch.tensor([prompt], device=target.device)
    mask = torch.ones_like(ids)
    out = {"version": transformers.__version__}
    for mode in modes:
        kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, attention_mask=mask)
        if mode == "static":
            kwargs["cache_implementation"] = "static"
        try:
            t0 = time.perf_counter()
            with torch.inference_mode():
                first = model.generate(ids, **kwargs)
            sync(target.device)
            first_s = time.perf_counter() - t0
            times = []
            for _ in range(runs):
                t0 = time.perf_counter()
                with torch.inference_mode():
                    model.generate(ids, **kwargs)
                sync(target.device)
                times.append(time.perf_counter() - t0)
            out[mode] = {"tok_s": new_tokens / statistics.median(times), "first_call_s": first_s,
                         "output_ids": first[0, len(prompt):].tolist()}
        except Exception as e:  # noqa: BLE001 - a peer that fails is reported, not fatal
            out[mode] = {"error": f"{type(e).__name__}: {e}"[:300]}
    return out


def graph_profile(engine: Engine, reps: int = 20) -> dict:
    """Kernel time vs wall time of each captured step, replayed back to back: how far a step is from
    its kernels' own time (launch gaps), and which kernels dominate."""
    graphs = engine.runner.graphs
    if not graphs.graphs:
        return {}
    from torch.profiler import ProfilerActivity, profile

    out = {}
    for key, (parts, _) in graphs.graphs.items():
        name = "-".join(str(k) for k in key) if isinstance(key, tuple) else str(key)
        graphs.replay(key)
        sync(engine.target.device)
        t0 = time.perf_counter()
        for _ in range(reps):
            graphs.replay(key)
        sync(engine.target.device)
        wall_ms = 1e3 * (time.perf_counter() - t0) / reps
        entry = {"wall_ms": wall_ms, "segments": (len(parts) + 1) // 2}
        try:
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(reps):
                    graphs.replay(key)
                sync(engine.target.device)
            kernels = [e for e in prof.key_averages() if getattr(e, "device_type", None) is not None
                       and str(e.device_type).endswith("CUDA")]
            total = sum(_device_us(e) for e in kernels) / reps
            top = sorted(kernels, key=_device_us, reverse=True)[:16]
            entry.update({"kernel_ms": total / 1e3, "kernels": sum(e.count for e in kernels) // reps,
                          "gap_ms": max(0.0, wall_ms - total / 1e3),
                          "top": [{"kernel": e.key[:80], "ms": _device_us(e) / reps / 1e3,
                                   "count": e.count // reps} for e in top]})
        except Exception as e:  # noqa: BLE001 - a profiler that cannot see graph kernels is reported
            entry["profiler_error"] = f"{type(e).__name__}: {e}"[:200]
        out[name] = entry
    return out


def _device_us(event) -> float:
    for name in ("self_device_time_total", "self_cuda_time_total", "device_time_total", "cuda_time_total"):
        if hasattr(event, name):
            return float(getattr(event, name))
    return 0.0


def library_versions() -> dict:
    """The versions of the libraries whose kernels a run uses, where installed."""
    import importlib.metadata

    out = {"cuda": torch.version.cuda} if torch.version.cuda else {}
    for name in ("triton", "transformers"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def run_bench(target, drafter, prompt: list[int], new_tokens: int, window: int, config: EngineConfig = EngineConfig(),
              runs: int = 3, hf_modes: tuple = ("eager",), startup: dict | None = None, profile: bool = False) -> dict:
    """config.backend: eager, or the fixed-shape layout (CUDA graphs on a GPU unless "static"). Target-only is
    measured as a 1-row decode and, in the static layout, also padded to W rows: the identity
    reference for DFlash in bfloat16 and the cost of a verify window. When Strata's Triton kernels are in
    use, target-only is also measured with torch.compile's kernels alone, in the same run."""
    device = target.device
    static, graphs, compile = config.static, config.graphs, config.compile
    bw = copy_bandwidth(device, (1 << 30) if device.type == "cuda" else (256 << 20))
    wbytes = weight_bytes(target)
    token_bytes = bytes_per_token(target, len(prompt) + new_tokens // 2)
    floor_s = token_bytes / bw
    max_len = len(prompt) + new_tokens + window + 1
    result = {
        "env": {"torch": torch.__version__, "python": platform.python_version(), **library_versions(),
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
                "dtype": str(target.dtype).removeprefix("torch.")},
        "shape": {"layers": target.cfg.num_layers, "hidden": target.cfg.hidden_size, "heads": target.cfg.num_heads,
                  "kv_heads": target.cfg.num_kv_heads, "head_dim": target.cfg.head_dim,
                  "intermediate": target.cfg.intermediate_size, "vocab": target.cfg.vocab_size},
        "prompt_len": len(prompt), "new_tokens": new_tokens, "window": window, "runs": runs, "static": static,
        "backend": config.backend,
        "cuda_graphs": static and graphs and device.type == "cuda", "attention": config.attention,
        "compiled_kernels": static and graphs and compile and device.type == "cuda",
        "copy_bandwidth_GBps": bw / 1e9, "weight_bytes": wbytes, "bytes_per_token": token_bytes,
        "floor_all_weights_tok_s": bw / wbytes, "floor_ms_per_token": 1e3 * floor_s,
        "floor_tok_s": 1 / floor_s, "startup_s": dict(startup or {}),
    }
    if device.type == "cuda":
        result["product_check"] = product_check(target, (1, window) if static and window > 1 else (1,))
    opts = replace(config, max_len=max_len, window=None, pad_rows=1)
    base_engine = Engine(target, config=opts)
    result["triton_kernels"] = isinstance(base_engine.runner.kernels, TritonKernels)
    base = timed_runs(base_engine, prompt, new_tokens, runs)
    result["startup_s"]["first_call_s"] = base["warmup_s"]
    result["startup_s"]["capture_s"] = base_engine.runner.graphs.capture_s
    base["ms_per_round"] = 1e3 / base["tok_s"] if base["tok_s"] else 0.0
    result["target_only"] = base
    if target.host_experts:  # weight_bytes and the floors count the device's weights
        result["host_weight_bytes"] = sum(m.host_gate_up.nbytes + m.host_down.nbytes for m in sparse_layers(target))
        result["expert_cache"] = {"placement": target.expert_plan.report(),
                                  "split": expert_split(base_engine, prompt, new_tokens)}
    reference = base
    engines = {"target_only": base_engine}
    if result["triton_kernels"]:
        plain = timed_runs(Engine(target, config=opts, backend="graphs+compile"), prompt, new_tokens, runs)
        plain["identical_to_target_only"] = plain.pop("output_ids") == base["output_ids"]
        result["target_only_without_triton"] = plain
    if static and window > 1:
        padded_engine = Engine(target, config=opts, pad_rows=window)
        padded = timed_runs(padded_engine, prompt, new_tokens, runs)
        padded["ms_per_round"] = 1e3 / padded["tok_s"] if padded["tok_s"] else 0.0
        padded["identical_to_target_only"] = padded["output_ids"] == base["output_ids"]
        result["target_only_padded"] = padded
        reference = padded
        engines["target_only_padded"] = padded_engine
    oracle_engine = Engine(target, OracleDrafter(prompt + reference["output_ids"], window, device),
                           config=replace(opts, draft_p_min=0.0), window=window)  # an oracle rates nothing
    result["dflash_oracle"] = timed_runs(oracle_engine, prompt, new_tokens, runs)
    result["dflash_oracle"]["split"] = round_split(oracle_engine, prompt, new_tokens)
    if drafter is not None:
        engine = Engine(target, drafter, config=opts, window=window)
        result["dflash"] = timed_runs(engine, prompt, new_tokens, runs)
        result["dflash"]["split"] = round_split(engine, prompt, new_tokens)
        result["dflash"]["identical_to_target_only"] = result["dflash"]["output_ids"] == reference["output_ids"]
        result["dflash"]["drafter"] = drafter.name
        split = result["dflash"]["split"]  # its round at the oracle's acceptance: what a trained drafter could reach
        result["dflash"]["tok_s_at_oracle_tau"] = 1e3 * result["dflash_oracle"]["tau"] / sum(split.values())
        engines["dflash"] = engine
    result["dflash_oracle"]["identical_to_target_only"] = \
        result["dflash_oracle"]["output_ids"] == reference["output_ids"]
    if target.recurrent and drafter is not None:
        result["rollback"] = rollback_cost(engines["dflash"])
    if profile and device.type == "cuda":
        result["profile"] = {name: graph_profile(e) for name, e in engines.items()}
    if hf_modes:
        result["hf"] = hf_generate(target, prompt, new_tokens, list(hf_modes), max(1, runs // 2))
        for r in result["hf"].values():
            if isinstance(r, dict) and "output_ids" in r:
                r["identical_to_strata"] = r["output_ids"] == base["output_ids"]
    t = result["target_only"]["tok_s"]
    decode_ms = 1e3 / t if t else 0.0
    result["ratios"] = {
        "target_only_vs_floor": t / result["floor_tok_s"],
        "oracle_vs_target_only": result["dflash_oracle"]["tok_s"] / t if t else 0.0,
    }
    if "target_only_without_triton" in result and result["target_only_without_triton"]["tok_s"]:
        result["ratios"]["triton_vs_compiled_only"] = t / result["target_only_without_triton"]["tok_s"]
    if "target_only_padded" in result and decode_ms:
        result["ratios"]["verify_window_vs_decode"] = result["target_only_padded"]["ms_per_round"] / decode_ms
    if drafter is not None:
        result["ratios"]["dflash_vs_target_only"] = result["dflash"]["tok_s"] / t if t else 0.0
        if decode_ms:
            result["ratios"]["draft_vs_decode"] = result["dflash"]["split"]["draft_ms"] / decode_ms
    for mode, r in (result.get("hf") or {}).items():
        if isinstance(r, dict) and "tok_s" in r:
            result["ratios"][f"target_only_vs_hf_{mode}"] = t / r["tok_s"]
    for section in ("target_only", "target_only_padded", "dflash_oracle", "dflash"):
        if section in result:
            result[section].pop("output_ids", None)
    for r in (result.get("hf") or {}).values():
        if isinstance(r, dict):
            r.pop("output_ids", None)
    return result


def rollback_cost(engine: Engine, reps: int = 20) -> dict:
    """Recurrent targets: what a round's rollback of the linear-attention states costs, after a generate, on
    the steps' own path, in every layer at once. With Strata's DeltaNet kernel a verify's first launch
    chooses the start state: replay_ms is that launch's recurrence part from a rollback of W-1 kept rows (the
    most a round replays), at_end_ms the same from the end state (a round that accepted everything), so a
    rollback costs at most their difference. Without it, replay_ms is the kernel set's delta rule over the
    kept rows. snapshot_writes_ms: writing W per-position states per layer instead (what keeping a snapshot
    per verified row would add to every verify). ms, in CUDA graphs on a GPU."""
    from ..layers.kernels import delta as delta_kernels
    from ..layers.linear_attention import LinearState

    layers = [(layer.mixer, engine.runner.cache.layers[layer.index]) for layer in engine.target.layers
              if isinstance(engine.runner.cache.layers[layer.index], LinearState)]
    if not layers:
        return {}
    kernels, dev = engine.runner.kernels, engine.target.device
    states = [s for _, s in layers]
    fused = isinstance(kernels, TritonKernels) and "gated_delta_net" not in kernels._failed and dev.type == "cuda"
    rows = torch.tensor(states[0].slots - 1, device=dev)
    buffers = [torch.empty(s.slots, *s.rec.shape[1:], device=dev, dtype=s.rec.dtype) for s in states]

    def replay():
        for layer, s in layers:
            if fused:
                delta_kernels.start_state(layer, s.begin + rows, s)
            else:
                kernels.delta_rule(s.qk[0], s.qk[1], s.v, s.gb[0], s.gb[1], s.rec[0], rows, s.tiled)

    def at_end():  # start_state never moves begin or end
        for layer, s in layers:
            delta_kernels.start_state(layer, s.end, s)

    def snapshots():
        for s, b in zip(states, buffers):
            b.copy_(s.rec[1].expand_as(b))

    out = {"layers": len(states), "rows": states[0].slots - 1, "fused_kernel": fused,
           "state_bytes_per_layer": states[0].rec[0].numel() * states[0].rec.element_size()}
    steps = (("replay_ms", replay), ("snapshot_writes_ms", snapshots)) + ((("at_end_ms", at_end),) if fused else ())
    for name, fn in steps:
        fn()
        sync(dev)
        if dev.type == "cuda":
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            fn = graph.replay
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        sync(dev)
        out[name] = 1e3 * (time.perf_counter() - t0) / reps
    return out


def verify_sweep(target, prompt: list[int], new_tokens: int, windows, config: EngineConfig) -> dict:
    """What a verify step costs by window W: target-only decoding padded to W rows (the static layout's
    verify shapes), ms per step and its ratio to the 1-row step, each after a warm-up run."""
    opts = replace(config, max_len=len(prompt) + new_tokens + max(windows) + 1, window=None)
    steps = {}
    for w in sorted(set(windows) | {1}):
        engine = Engine(target, config=replace(opts, pad_rows=w))
        engine.generate(prompt, new_tokens)
        sync(target.device)
        runs = [engine.generate(prompt, new_tokens) for _ in range(3)]
        steps[w] = 1e3 * statistics.median(r.decode_s / max(len(r.accept_lengths), 1) for r in runs)
    return {"static": config.static, "ms_per_step": {str(w): ms for w, ms in steps.items()},
            "vs_decode": {str(w): ms / steps[1] for w, ms in steps.items()}}


def expert_split(engine: Engine, prompt: list[int], new_tokens: int) -> dict:
    """Where a decoded token's time goes with experts in host memory: waiting for the device up to each
    routing read, the CPU's experts (with their copies), and the rest (the device's work after the last
    read, launches, the loop), in ms per token. The prefill's share is taken out by a 1-token run."""
    moes = [moe for moe in sparse_layers(engine.target) if moe.host_experts]

    def run(n: int):
        for moe in moes:
            moe.timing.clear()
        res = engine.generate(prompt, n)
        return res, [sum(m.timing.get(k, 0.0) for m in moes) for k in ("routing_read", "host_experts")]

    _, (read1, host1) = run(1)
    res, (read, host) = run(new_tokens)
    tokens = max(res.new_tokens - 1, 1)
    total = 1e3 * res.decode_s / tokens
    read, host = 1e3 * (read - read1) / tokens, 1e3 * (host - host1) / tokens
    return {"ms_per_token": total, "routing_read_ms": read, "host_experts_ms": host, "rest_ms": total - read - host}


def decode_set(engine, prompts: list[list[int]], new_tokens: int) -> tuple[Acceptance, int, float, list[list[int]]]:
    """Every prompt decoded by one engine: the acceptance over all rounds, the tokens and seconds of all decoding,
    the outputs."""
    acc, tokens, secs, outputs = Acceptance(), 0, 0.0, []
    for p in prompts:
        sync(engine.target.device)
        r = engine.generate(p, new_tokens)
        acc, tokens, secs = acc.merge(r.acceptance), tokens + r.new_tokens, secs + r.decode_s
        outputs.append(r.output_ids)
    return acc, tokens, secs, outputs


def tree_sweep(target, drafter, prompts: list[list[int]], new_tokens: int, window: int, budgets,
               config: EngineConfig = EngineConfig(), profile: bool = False) -> dict:
    """The chain and a tree of each budget on a prompt set at one window: tau over every round, tokens/s
    over every prompt's decoding, the round's draft / verify split, and whether each tree's outputs equal
    the chain's. On a GPU the set runs once untimed first (each kv_len bucket captures its graphs); with
    profile, each captured step (the tree's verify among them) is replayed alone and timed."""
    opts = replace(config, window=window, pad_rows=1)
    out = {"prompts": len(prompts), "new_tokens": new_tokens, "window": window, "budgets": {}}
    chain_outputs = None
    for n in (None, *budgets):
        engine = Engine(target, drafter, config=opts, tree=n)
        for p in (prompts if target.device.type == "cuda" else prompts[:1]):
            engine.generate(p, new_tokens if target.device.type == "cuda" else 2)
        acc, tokens, secs, outputs = decode_set(engine, prompts, new_tokens)
        row = {"nodes": n or window - 1, "verify_rows": (n or window - 1) + 1, "tau": acc.tau, "rounds": acc.rounds,
               "tok_s": tokens / secs if secs else 0.0, "per_position_acceptance": acc.per_position,
               **round_split(engine, prompts[0], new_tokens)}
        if profile and target.device.type == "cuda":
            row["profile"] = graph_profile(engine)
        if n is None:
            chain_outputs = outputs
            out["chain"] = row
        else:
            row["identical_to_chain"] = outputs == chain_outputs
            row["tau_vs_chain"] = acc.tau / out["chain"]["tau"] if out["chain"]["tau"] else 0.0
            row["tok_s_vs_chain"] = row["tok_s"] / out["chain"]["tok_s"] if out["chain"]["tok_s"] else 0.0
            out["budgets"][str(n)] = row
    return out
