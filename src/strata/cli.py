"""The `strata` command line: parsing arguments into specs and configs, and printing results."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from pathlib import Path

from .errors import StrataError
from .files import check_output, write_json_atomic
from .prompts import parse_ids


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", metavar="DIR", help="target model folder (Hugging Face layout); default: the embedded "
                                                 "demo pair")
    g.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where to run (default: cpu)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and activations; auto: float32 on cpu, bfloat16 on cuda")
    g.add_argument("--max-model-len", type=int, default=None, metavar="N",
                   help="context length in tokens (default and maximum: the model's max_position_embeddings)")
    g.add_argument("--allow-long-context", action="store_true",
                   help="allow --max-model-len past the model's trained context")
    g.add_argument("--threads", type=int, metavar="N",
                   help="CPU threads (default: OMP_NUM_THREADS if set, else 1: on the CPUs measured, more threads "
                        "were no faster for models up to 0.7 GB and 4-6x slower while another process was busy)")


def add_drafter_args(p: argparse.ArgumentParser, spec: bool = True, lookup: bool = True) -> None:
    g = p.add_argument_group("drafter")
    g.add_argument("--dflash", metavar="DRAFTER", help="DFlash drafter: a GGUF file or a Hugging Face folder "
                                                       "(default with the demo target: the demo drafter)")
    g.add_argument("--no-dflash", action="store_true", help="target-only decoding, also for the demo pair")
    if spec:
        g.add_argument("--spec", type=int, default=None, metavar="W",
                       help="verify window W: the anchor + W-1 candidates (default: the drafter's block size)")
    g.add_argument("--dflash-window", type=int, default=32768, metavar="CELLS",
                   help="context cells a drafter layer attends to before its block (default 32768)")
    if lookup:
        g.add_argument("--prompt-lookup", type=int, metavar="N",
                       help="prompt-lookup drafting with n-grams up to N (instead of a DFlash drafter)")
    if not spec:
        p.set_defaults(spec=None)
    if not lookup:
        p.set_defaults(prompt_lookup=None)


def add_sampling_args(p: argparse.ArgumentParser, server: bool = False) -> None:
    g = p.add_argument_group("sampling" + (" (defaults of requests that omit them)" if server else ""))
    g.add_argument("--temperature", type=float, default=None if server else 0.0,
                   help="0 = greedy" + (" (default: OpenAI's 1.0)" if server else " (default)"))
    g.add_argument("--top-k", type=int, default=None if server else 0, help="keep the k likeliest tokens; 0 = off")
    g.add_argument("--top-p", type=float, default=None if server else 1.0,
                   help="keep the smallest set of tokens whose mass reaches p; 1 = off")
    g.add_argument("--seed", type=int, default=None, help="seed of the sampler: the same seed gives the same output")
    g.add_argument("--draft-sampling", default="sample", choices=["sample", "argmax"],
                   help="sampled decoding: draw DFlash candidates from q, or take q's argmax (one-hot q)")


def add_layout_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("layout")
    g.add_argument("--static", action="store_true",
                   help="fixed-shape verify/draft windows (the CUDA-graph layout; the default on a GPU)")
    g.add_argument("--eager", action="store_true",
                   help="on a GPU: dynamic shapes without CUDA graphs (the CPU's default layout)")
    g.add_argument("--no-graphs", action="store_true",
                   help="static layout without capturing CUDA graphs (the steps run eagerly)")
    g.add_argument("--no-compile", action="store_true",
                   help="CUDA graphs without torch.compile's fused elementwise kernels")
    g.add_argument("--no-triton", action="store_true",
                   help="CUDA graphs with torch.compile's kernels only, not Strata's Triton GEMV/attention kernels")
    g.add_argument("--attention", default="grouped", choices=["grouped", "sdpa"],
                   help="attention of the static steps: two matmuls per K/V head, or PyTorch SDPA")


def add_prompt_set_args(p: argparse.ArgumentParser, first_only: bool) -> None:
    note = "; the first is used" if first_only else ""
    p.add_argument("--prompt-ids", action="append", metavar="IDS", help="comma-separated token ids (repeatable)")
    p.add_argument("--prompts", metavar="FILE", help=f"prompts: a JSON list of strings (.json) or one per line{note}")


def pair_spec(args, model: str | None = None):
    from .engine.loader import PairSpec

    return PairSpec(model=model or args.model, device=args.device, dtype=args.dtype, dflash=args.dflash,
                    no_dflash=args.no_dflash, prompt_lookup=args.prompt_lookup, dflash_window=args.dflash_window)


def engine_config(args, window: int | None = None):
    """The EngineConfig the options describe: the fixed-shape (CUDA-graph) layout when asked for with
    --static, and by default on a GPU."""
    from .engine.config import EngineConfig

    if args.static and args.eager:
        raise StrataError("--static and --eager are mutually exclusive")
    return EngineConfig(max_len=args.max_model_len, allow_long_context=args.allow_long_context, window=window,
                        static=args.static or (args.device == "cuda" and not args.eager), graphs=not args.no_graphs,
                        compile=not args.no_compile, triton=not args.no_triton, attention=args.attention,
                        draft_sampling=getattr(args, "draft_sampling", "sample"))


def sampling_params(args):
    from .engine.sampling import SamplingParams

    return SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)


def stop_ids(args, pair) -> set[int]:
    return pair.stop_ids | set(parse_ids(args.stop_ids, "--stop-ids") if args.stop_ids else [])


def load(args, drafter: bool = True, window: int | None = None):
    """(pair, engine config) after every option was checked."""
    from .engine.loader import load_pair

    config = engine_config(args, window)
    spec = pair_spec(args)
    pair = load_pair(spec, config, drafter)
    return pair, config


def prompt_text(args) -> str | None:
    """The prompt from exactly one of TEXT, --prompt, --prompt-file (or '-'), or None with --prompt-ids."""
    given = [x for x in (args.text, args.prompt, args.prompt_file, args.prompt_ids) if x is not None]
    if len(given) != 1:
        raise StrataError("give exactly one of a prompt (TEXT, --prompt TEXT or --prompt-file PATH) or "
                          "--prompt-ids 1,2,3")
    if args.prompt_file is None:
        return args.text if args.text is not None else args.prompt
    try:
        if args.prompt_file == "-":
            return sys.stdin.read()
        return Path(args.prompt_file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise StrataError(f"--prompt-file {args.prompt_file}: {getattr(e, 'strerror', None) or e}") from None


def cmd_generate(args) -> int:
    from .engine.decode import Engine
    from .files import check_output
    from .tokenizer import StreamDecoder

    text = prompt_text(args)
    params = sampling_params(args)
    if args.stats_json:
        check_output(args.stats_json, what="--stats-json")
    pair, config = load(args, window=args.spec)
    tokenizer = pair.tokenizer
    if text is not None:
        if tokenizer is None:
            raise StrataError(f"{pair.model_dir}: no tokenizer.json; use --prompt-ids")
        if args.chat:
            text = tokenizer.apply_chat_template([{"role": "user", "content": text}])
        prompt_ids = tokenizer.encode(text)
    else:
        prompt_ids = parse_ids(args.prompt_ids, "--prompt-ids")
    engine = Engine(pair.target, pair.drafter, config)
    if tokenizer is not None and not args.ids:
        stream = StreamDecoder(tokenizer)

        def on_tokens(ids):
            sys.stdout.write(stream.push(ids))
            sys.stdout.flush()
    else:
        first = [True]

        def on_tokens(ids):
            sys.stdout.write(("" if first[0] else ",") + ",".join(map(str, ids)))
            first[0] = False
            sys.stdout.flush()

    res = engine.generate(prompt_ids, args.max_new_tokens, stop_ids(args, pair), params, on_tokens=on_tokens)
    sys.stdout.write("\n")
    sys.stdout.flush()
    stats = res.stats()
    line = f"prompt {len(prompt_ids)} tokens, new {res.new_tokens} tokens, prefill {res.prefill_s * 1e3:.1f} ms, "
    line += f"decode {res.tok_s:.1f} tok/s" if stats["rounds"] else "no decode round"
    if stats["rounds"] and engine.window > 1:
        line += f", tau {stats['tau']:.2f}, acceptance {stats['acceptance_rate']:.2f} (W={engine.window})"
    if res.limit == "context":
        line += f"; stopped at the end of the context ({engine.max_len} tokens, --max-model-len)"
    print(line, file=sys.stderr)
    if args.stats_json:
        import torch

        write_json_atomic(Path(args.stats_json), {**stats, "threads": torch.get_num_threads()})
    return 0


def cmd_init_random(args) -> int:
    from .models.random_init import write_random_model

    check_output(args.out_dir, folder=True)
    out = write_random_model(args.out_dir, shape=args.shape, seed=args.seed)
    print(f"wrote a random {args.shape} model to {out}", file=sys.stderr)
    return 0


def cmd_convert_dflash(args) -> int:
    import time

    from .dflash.converter import convert_hf_to_gguf

    t0 = time.perf_counter()
    art = convert_hf_to_gguf(args.src, args.out, args.target, args.tokenizer_pre, progress=not args.quiet)
    types = sorted(set(art.types.values()))
    print(f"wrote {args.out}: {len(art.tensors)} tensors ({', '.join(types)}), {art.parameter_count:,} parameters, "
          f"vocabulary of {len(art.vocab.tokens)} tokens, read-back bit-exact ({time.perf_counter() - t0:.1f} s)",
          file=sys.stderr)
    return 0


def cmd_export_dflash(args) -> int:
    from .dflash.converter import export_gguf_to_hf

    art = export_gguf_to_hf(args.src, args.out_dir, progress=not args.quiet)
    print(f"wrote {args.out_dir}: config.json + model.safetensors, {len(art.tensors)} tensors, read-back bit-exact",
          file=sys.stderr)
    return 0


def cmd_inspect(args) -> int:
    from .dflash.inspect import inspect_path

    text, ok = inspect_path(args.path, args.model)
    print(text)
    return 0 if ok else 2


def dflash_pair(args, window: int | None = None):
    pair, config = load(args, window=window)
    if pair.drafter is None or pair.drafter.name != "dflash":
        raise StrataError("--dflash: no drafter given")
    return pair, config


def cmd_parity(args) -> int:
    from .dflash.tools import format_parity, run_parity
    from .prompts import prompt_set

    pair, config = dflash_pair(args, args.spec)
    w = config.window_for(pair.drafter)
    prompt = prompt_set(pair, args.prompt_ids, args.prompts)[0]
    plant = None
    if args.plant_bug:
        layer, _, stage = args.plant_bug.rpartition(":")
        plant = (int(layer) if layer else -1, stage)
    rows, first = run_parity(pair.drafter, prompt, w, plant, config)
    print(format_parity(rows, first))
    return 0 if first is None else 1


def cmd_taps(args) -> int:
    import numpy as np

    from .dflash.tools import taps_check
    from .engine.decode import Engine
    from .prompts import prompt_set

    pair, config = load(args, drafter=not args.layers)
    target = pair.target
    n_layers = target.cfg.num_layers
    layers = parse_ids(args.layers, "--layers") if args.layers else (
        getattr(pair.drafter, "tap_layers", None) or list(range(n_layers)))
    bad = [layer for layer in layers if not 0 <= layer < n_layers]
    if bad:
        raise StrataError(f"--layers: layer {bad[0]} outside the target's 0..{n_layers - 1}")
    prompt = prompt_set(pair, args.prompt_ids, args.prompts)[0]
    seq = prompt + Engine(target, max_len=len(prompt) + args.new_tokens + 1).generate(prompt, args.new_tokens).output_ids
    worst = 1.0
    for w in args.windows:
        cos, err = taps_check(target, layers, seq, max(1, len(prompt)), w, config)
        worst = min(worst, float(cos.min()))
        print(f"W={w}: {len(seq) - len(prompt)} positions, cosine min {cos.min():.8f} median {np.median(cos):.8f}, "
              f"max abs {err:.3e}")
    ok = worst >= args.min_cos
    print(f"taps (HF ids) {layers}: {'OK' if ok else 'FAIL'} (min cosine {worst:.8f}, threshold {args.min_cos})")
    return 0 if ok else 1


def cmd_gate(args) -> int:
    from .dflash.tools import gate, gate_report
    from .prompts import prompt_set

    if args.stats_json:
        check_output(args.stats_json, what="--stats-json")
    pair, config = dflash_pair(args)
    windows = args.spec_list or [pair.drafter.max_window]
    for w in windows:
        replace(config, window=w).window_for(pair.drafter)
    prompts = prompt_set(pair, args.prompt_ids, args.prompts)
    records = []
    for rec in gate(pair.target, pair.drafter, prompts, windows, args.max_new_tokens, stop_ids(args, pair), config):
        records.append(rec)
        st = rec.dflash.acceptance
        print(f"prompt {rec.prompt} W={rec.window}: "
              f"{'identical' if rec.identical else 'DIFFERENT at ' + str(rec.first_difference)}"
              f", tau {st.tau:.2f}, acceptance {st.acceptance_rate:.2f}")
    report = gate_report(records, len(prompts), args.max_new_tokens)
    for w, agg in report["windows"].items():
        print(f"W={w}: tau {agg['tau']:.3f} over {agg['rounds']} rounds; acceptance by position "
              + " ".join(f"{p:.2f}" for p in agg["per_position_acceptance"]))
    print(f"gate: {'PASS' if report['failures'] == 0 else 'FAIL'} "
          f"({len(records) - report['failures']}/{len(records)} identical)")
    if args.stats_json:
        write_json_atomic(Path(args.stats_json), report)
    return 0 if report["failures"] == 0 else 1


def cmd_train_drafter(args) -> int:
    from .dflash.train import TrainConfig, train
    from .engine.loader import PairSpec, load_pair

    check_output(args.out, folder=True, what="--out")
    pair = load_pair(PairSpec(model=args.target, device=args.device, dtype=args.dtype), drafter=False)
    if pair.tokenizer is None:
        raise StrataError(f"{args.target}: no tokenizer.json (needed to read --data)")
    tc = TrainConfig(layers=args.layers, block_size=args.block_size,
                     taps=parse_ids(args.taps, "--taps") if args.taps else None, steps=args.steps,
                     batch_size=args.batch_size, lr=args.lr, prompt_len=args.prompt_len, gen_len=args.gen_len,
                     num_sequences=args.num_sequences, seed=args.seed, eval_every=args.eval_every,
                     save_every=args.save_every, temperature=args.temperature)
    trainer = train(pair.target, pair.tokenizer, tc, Path(args.out), args.device, args.data, args.resume,
                    progress=not args.quiet)
    last = trainer.history[-1] if trainer.history else {}
    print(f"wrote {args.out}: {tc.layers}-layer drafter, block {tc.block_size}, taps {trainer.cfg.target_layer_ids}; "
          f"held-out loss {last.get('held_out_loss', float('nan')):.3f}, tau estimate "
          f"{last.get('tau_estimate', float('nan')):.2f}", file=sys.stderr)
    return 0


def cmd_serve(args) -> int:
    import logging

    from .engine.decode import Engine
    from .serve.app import Server, ServerConfig
    from .serve.listener import serve_forever

    for name, value, low in (("--max-queue", args.max_queue, 1), ("--max-body-bytes", args.max_body_bytes, 1),
                             ("--timeout", args.timeout, 0.1), ("--shutdown-timeout", args.shutdown_timeout, 0)):
        if value < low:
            raise StrataError(f"{name} must be >= {low}, got {value}")
    defaults = {k: getattr(args, k) for k in ("temperature", "top_k", "top_p", "seed") if getattr(args, k) is not None}
    if defaults:
        from .engine.sampling import SamplingParams

        SamplingParams(**{"temperature": 1.0, **defaults})  # bad defaults are refused before loading
    pair, config = load(args, window=args.spec)
    engine = Engine(pair.target, pair.drafter, config)
    name = args.served_model_name or ("strata-demo" if pair.using_demo else pair.model_dir.name)
    api_key = args.api_key or os.environ.get("STRATA_API_KEY") or None
    server = Server(engine, pair.tokenizer, ServerConfig(
        name, stop_ids(args, pair), max_queue=args.max_queue, api_key=api_key, max_body_bytes=args.max_body_bytes,
        timeout=args.timeout, loopback=args.host in ("127.0.0.1", "localhost", "::1"), defaults=defaults))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    print(f"strata serve: model '{name}' ({engine.drafter.name} drafter, W={engine.window}) on "
          f"http://{args.host}:{args.port}{'' if api_key is None else ' (API key required)'}", file=sys.stderr,
          flush=True)
    serve_forever(server, args.host, args.port, args.shutdown_timeout, args.timeout)
    return 0


def cmd_bench(args) -> int:
    from .bench.command import BenchSpec, run_command, summary, write

    bench = BenchSpec(shape=args.shape, drafter_layers=args.drafter_layers, block_size=args.block_size,
                      prompt_len=args.prompt_len, prompt=args.prompt, new_tokens=args.new_tokens, runs=args.runs,
                      hf=args.hf, profile=args.profile, quant=args.quant)
    out = check_output(args.out, what="--out") if args.out else None
    result = run_command(pair_spec(args), engine_config(args, args.spec), bench, "strata " + " ".join(sys.argv[1:]))
    for line in summary(result):
        print(line, file=sys.stderr)
    if out is not None:
        write(result, out)
        print(f"wrote {out} and {out.with_suffix('.png')}", file=sys.stderr)
    return 0
def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(prog="strata", description="Fast, lossless LLM decoding with DFlash drafters")
    parser.add_argument("--version", action="version", version=f"strata {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    g = sub.add_parser("generate", help="generate from a prompt (target-only or speculative)")
    g.add_argument("text", nargs="?", help="the prompt (same as --prompt)")
    g.add_argument("--prompt", help="the prompt text")
    g.add_argument("--prompt-file", metavar="PATH", help="read the prompt text from a file ('-': standard input)")
    g.add_argument("--prompt-ids", metavar="IDS", help="the prompt as comma-separated token ids")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    g.add_argument("--ids", action="store_true", help="print token ids even when a tokenizer exists")
    g.add_argument("--max-new-tokens", type=int, default=128, metavar="N",
                   help="tokens to generate at most (default 128; the context's end also stops it)")
    g.add_argument("--stop-ids", metavar="IDS", help="extra stop token ids, comma-separated")
    g.add_argument("--stats-json", metavar="FILE", help="write generation statistics to this file")
    add_model_args(g)
    add_drafter_args(g)
    add_sampling_args(g)
    add_layout_args(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("convert-dflash", help="reference Hugging Face DFlash drafter -> llama.cpp GGUF "
                                              "(2-D BF16, 1-D F32, the target's vocabulary)")
    c.add_argument("src", help="the drafter's Hugging Face folder (config.json + safetensors)")
    c.add_argument("out", help="the GGUF file to write")
    c.add_argument("--target", help="the target model (folder with tokenizer.json, or GGUF file) whose vocabulary "
                                    "the drafter carries; needed when the drafter folder has no tokenizer.json")
    c.add_argument("--tokenizer-pre", metavar="NAME", help="llama.cpp's pre-tokenizer name, when it cannot be told "
                                                           "from tokenizer.json (gpt-2, qwen2, llama-bpe, ...)")
    c.add_argument("--quiet", action="store_true", help="no progress bars")
    c.set_defaults(func=cmd_convert_dflash)

    e = sub.add_parser("export-dflash", help="DFlash drafter (any accepted GGUF, quantized too) -> reference "
                                             "Hugging Face folder")
    e.add_argument("src", help="the drafter: a GGUF file (or a Hugging Face folder)")
    e.add_argument("out_dir", help="the folder to write (new or empty)")
    e.add_argument("--quiet", action="store_true", help="no progress bars")
    e.set_defaults(func=cmd_export_dflash)

    i = sub.add_parser("inspect", help="describe and validate a DFlash drafter (GGUF file or HF folder)")
    i.add_argument("path", help="the drafter: a GGUF file or a Hugging Face folder")
    i.add_argument("--model", help="a target model folder: check that the drafter fits it (sizes, taps, "
                                   "vocabulary, mask id)")
    i.set_defaults(func=cmd_inspect)

    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    sv.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    sv.add_argument("--max-queue", type=int, default=64, metavar="N",
                    help="requests admitted at once (running and waiting); more get HTTP 429 (default 64)")
    sv.add_argument("--served-model-name", metavar="NAME", help="the model id clients use (default: the folder name)")
    sv.add_argument("--stop-ids", metavar="IDS", help="extra stop token ids, comma-separated")
    sv.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (default: $STRATA_API_KEY; none: open)")
    sv.add_argument("--max-body-bytes", type=int, default=8 << 20, metavar="N",
                    help="largest request body accepted; larger ones get HTTP 413 (default 8 MiB)")
    sv.add_argument("--timeout", type=float, default=30.0, metavar="S",
                    help="seconds a client may take to send a request's headers and body, and an idle "
                         "keep-alive connection is kept (default 30)")
    sv.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="S",
                    help="seconds in-flight requests get to finish after SIGTERM (default 30)")
    add_model_args(sv)
    add_drafter_args(sv)
    add_sampling_args(sv, server=True)
    add_layout_args(sv)
    sv.set_defaults(func=cmd_serve)

    be = sub.add_parser("bench", help="Strata target-only vs DFlash vs HF generate vs the bandwidth floor")
    be.add_argument("--shape", choices=["tiny", "qwen3-4b", "qwen3-8b"], help="random weights of a named shape")
    be.add_argument("--quant", choices=["Q8_0", "Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K", "IQ4_XS"],
                    help="with --shape: random valid GGUF blocks of this llama.cpp file type, kept quantized")
    be.add_argument("--drafter-layers", type=int, metavar="N", help="a random DFlash drafter of this many layers")
    be.add_argument("--block-size", type=int, default=16, help="block size of the random drafter (default 16)")
    be.add_argument("--prompt-len", type=int, default=512, metavar="N", help="random prompt tokens (without --prompt)")
    be.add_argument("--prompt", help="a text prompt instead of random tokens (models with a tokenizer)")
    be.add_argument("--new-tokens", type=int, default=256, metavar="N", help="tokens generated per run (default 256)")
    be.add_argument("--runs", type=int, default=3, help="timed runs per method (median reported)")
    be.add_argument("--hf", default="eager", help="transformers generate modes: eager,static or none")
    be.add_argument("--out", metavar="FILE", help="write the result JSON here, and a PNG plot beside it "
                                                  "(without it the results are only printed)")
    be.add_argument("--profile", action="store_true", help="GPU: kernel time vs wall time of each captured step")
    add_model_args(be)
    add_drafter_args(be)
    add_layout_args(be)
    be.set_defaults(func=cmd_bench)

    pa = sub.add_parser("parity", help="one proposal, runtime vs the NumPy reference, stage by stage")
    add_prompt_set_args(pa, first_only=True)
    pa.add_argument("--plant-bug", metavar="LAYER:STAGE",
                    help="self-test: perturb LAYER:STAGE (e.g. 0:q_roped, :logits) in the runtime")
    add_model_args(pa)
    add_drafter_args(pa, lookup=False)
    add_layout_args(pa)
    pa.set_defaults(func=cmd_parity)

    ta = sub.add_parser("taps", help="taps from prefill vs taps from verify windows, per position")
    add_prompt_set_args(ta, first_only=True)
    ta.add_argument("--layers", metavar="IDS", help="HF layer ids to tap (default: the drafter's, else all)")
    ta.add_argument("--windows", type=int, nargs="+", default=[1, 4, 8], metavar="W",
                    help="verify window sizes to compare (default 1 4 8)")
    ta.add_argument("--new-tokens", type=int, default=32, metavar="N",
                    help="tokens generated after the prompt and checked (default 32)")
    ta.add_argument("--min-cos", type=float, default=0.9999, help="lowest cosine that passes (default 0.9999)")
    add_model_args(ta)
    add_drafter_args(ta, spec=False, lookup=False)
    add_layout_args(ta)
    ta.set_defaults(func=cmd_taps)

    ga = sub.add_parser("gate", help="greedy identity gate: target-only vs DFlash, token for token")
    add_prompt_set_args(ga, first_only=False)
    ga.add_argument("--spec-list", type=int, nargs="+", metavar="W", help="windows W to gate (default: the block size)")
    ga.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="tokens per prompt (default 64)")
    ga.add_argument("--stop-ids", metavar="IDS", help="extra stop token ids, comma-separated")
    ga.add_argument("--stats-json", metavar="FILE", help="write the gate's statistics to this file")
    add_model_args(ga)
    add_drafter_args(ga, spec=False, lookup=False)
    add_layout_args(ga)
    ga.set_defaults(func=cmd_gate)

    tr = sub.add_parser("train-drafter", help="train a DFlash drafter for a target by self-distillation")
    tr.add_argument("--target", required=True, help="target model folder (with tokenizer.json)")
    tr.add_argument("--data", nargs="+", required=True, metavar="FILE", help="text files the prompts are cut from")
    tr.add_argument("--out", required=True, metavar="DIR", help="output folder (reference Hugging Face format)")
    tr.add_argument("--layers", type=int, default=2, help="drafter layers (default 2)")
    tr.add_argument("--block-size", type=int, default=8, help="block size B: the largest verify window (default 8)")
    tr.add_argument("--taps", metavar="IDS", help="target layer ids (HF convention), comma-separated")
    tr.add_argument("--steps", type=int, default=2000, help="optimisation steps (default 2000)")
    tr.add_argument("--batch-size", type=int, default=32, help="sequences per step (default 32)")
    tr.add_argument("--lr", type=float, default=6e-4, help="peak learning rate (default 6e-4)")
    tr.add_argument("--prompt-len", type=int, default=64, help="prompt tokens per distilled sequence (default 64)")
    tr.add_argument("--gen-len", type=int, default=192, help="tokens the target writes per sequence (default 192)")
    tr.add_argument("--num-sequences", type=int, default=2048, help="distilled sequences (default 2048)")
    tr.add_argument("--temperature", type=float, default=0.0, help="self-distillation sampling temperature")
    tr.add_argument("--eval-every", type=int, default=200, metavar="N", help="held-out evaluation every N steps")
    tr.add_argument("--save-every", type=int, default=500, metavar="N", help="checkpoint every N steps")
    tr.add_argument("--seed", type=int, default=0, help="seed of data, initialisation and anchors")
    tr.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    tr.add_argument("--quiet", action="store_true", help="no progress bars")
    tr.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where to train (default: cpu)")
    tr.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                    help="the target's weights; auto: float32 on cpu, bfloat16 on cuda")
    tr.add_argument("--threads", type=int, metavar="N", help="CPU threads (default: OMP_NUM_THREADS if set, else 1)")
    tr.set_defaults(func=cmd_train_drafter)

    r = sub.add_parser("init-random", help="write a random-weight model of a named shape (HF layout)")
    r.add_argument("out_dir", help="the folder to write")
    r.add_argument("--shape", default="tiny", choices=["tiny", "qwen3-4b", "qwen3-8b"], help="the shape (default tiny)")
    r.add_argument("--seed", type=int, default=0, help="seed of the weights")
    r.set_defaults(func=cmd_init_random)
    return parser


def set_threads(args) -> None:
    """--threads, else OMP_NUM_THREADS (torch reads it), else one thread."""
    threads = getattr(args, "threads", None)
    if threads is not None and threads < 1:
        raise StrataError(f"--threads must be >= 1, got {threads}")
    if threads is None and (os.environ.get("OMP_NUM_THREADS") or not hasattr(args, "threads")):
        return
    import torch

    torch.set_num_threads(threads or 1)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        set_threads(args)
        return args.func(args)
    except StrataError as e:
        print(f"strata: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("strata: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except Exception as e:  # noqa: BLE001 - the last line of defence: one line, exit 1
        if os.environ.get("STRATA_DEBUG"):
            raise
        print(f"strata: internal error: {type(e).__name__}: {e} (set STRATA_DEBUG=1 for a traceback)",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
