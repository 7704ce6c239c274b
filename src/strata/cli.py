"""The `strata` command line: each command turns its parsed options (cli_options.py) into specs and configs,\ncalls the library, and prints."""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path

from .cli_options import build_parser
from .errors import SettingError, StrataError
from .files import check_output, write_json_atomic
from .prompts import parse_ids


def pair_spec(args, model: str | None = None):
    from .pair import PairSpec

    return PairSpec(model=model or args.model, device=args.device, dtype=args.dtype, dflash=args.dflash,
                    no_dflash=args.no_dflash, prompt_lookup=args.prompt_lookup, mtp=args.mtp,
                    dflash_window=args.dflash_window,
                    expert_cache=getattr(args, "expert_cache", None),
                    expert_placement=getattr(args, "expert_placement", "static"),
                    check_tensors=getattr(args, "check_tensors", False),
                    stop_ids=tuple(parse_ids(args.stop_ids, "--stop-ids")) if getattr(args, "stop_ids", None) else ())


#: the options that set each EngineConfig field, as its errors are printed (SettingError)
FLAGS = {"max_len": "--max-model-len", "allow_long_context": "--allow-long-context", "window": "--spec",
         "tree": "--tree", "adaptive_window": "--adaptive-window", "draft_sampling": "--draft-sampling",
         "attention": "--attention", "backend": "--eager/--static/--no-graphs/--no-compile/--no-triton",
         "verify_windows": "--verify-windows", "auto_window": "--spec auto", "draft_p_min": "--draft-p-min",
         "max_num_seqs": "--max-num-seqs"}


def backend(args) -> str:
    """The layout options as one backend: the fixed-shape layout with --static and by default on a GPU, fused
    as far as the --no-* options allow (the lowest they name wins)."""
    lowered = [name for flag, name in (("no_graphs", "static"), ("no_compile", "graphs"),
                                       ("no_triton", "graphs+compile")) if getattr(args, flag)]
    if args.eager:
        if args.static or lowered:
            raise StrataError("--eager runs without the fixed-shape layout: it takes no --static or --no-* option")
        return "eager"
    if not (args.static or args.device == "cuda"):
        if lowered:
            raise StrataError("--no-graphs, --no-compile and --no-triton lower the fixed-shape layout: give "
                              "--static (on the CPU) or --device cuda")
        return "eager"
    return lowered[0] if lowered else "graphs+triton"


def engine_config(args, window: int | None = None):
    """The EngineConfig the options describe."""
    from .engine.config import EngineConfig

    auto = window == "auto"
    return EngineConfig(max_len=args.max_model_len, allow_long_context=args.allow_long_context,
                        window=None if auto else window, auto_window=auto, backend=backend(args),
                        attention=args.attention, draft_sampling=getattr(args, "draft_sampling", "sample"),
                        adaptive_window=getattr(args, "adaptive_window", False),
                        draft_p_min=getattr(args, "draft_p_min", 0.0),
                        tree=args.tree if isinstance(args.tree, int) else None)


def sampling_params(args):
    from .engine.sampling import SamplingParams

    return SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)


def inputs_of(args) -> list:
    """What a command reads, which its outputs must not overwrite: the target and drafter (the demo pair's
    when it runs) and the prompt files."""
    from .pair import resolve

    model, drafter, _ = resolve(pair_spec(args))
    return [model, drafter, getattr(args, "prompt_file", None), getattr(args, "prompts", None)]


def load(args, drafter: bool = True, window: int | None = None, prompt=None):
    """(pair, engine config) after every option was checked; prompt: load_pair's hook, so that the prompt is
    checked too before the weights load."""
    from .pair import load_pair

    config = engine_config(args, window)
    spec = pair_spec(args)
    pair = load_pair(spec, config, drafter, prompt)
    from .models.loader import dequantized_report

    note = dequantized_report(pair.target, pair.model_dir)
    if note:
        print(note, file=sys.stderr)
    if pair.target.expert_plan is not None:
        print(pair.target.expert_plan.report(), file=sys.stderr)
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
    from .pair import text_tokenizer
    from .tokenizer import StreamDecoder

    stats_json = args.stats_json and check_output(args.stats_json, what="--stats-json", inputs=inputs_of(args))
    text = prompt_text(args)
    params = sampling_params(args)
    engine_config(args).check_sampling(params)

    def prompt(tokenizer, no_tokenizer: str) -> list[int]:
        if text is None:
            return parse_ids(args.prompt_ids, "--prompt-ids")
        tokenizer = text_tokenizer(tokenizer, no_tokenizer)
        if args.chat:
            return tokenizer.encode_chat([{"role": "user", "content": text}])
        return tokenizer.encode_prompt(text)

    pair, config = load(args, window=args.spec, prompt=prompt)
    prompt_ids = pair.prompt_ids
    tokenizer = pair.tokenizer
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

    res = engine.generate(prompt_ids, args.max_new_tokens, pair.stop_ids, params, on_tokens=on_tokens)
    sys.stdout.write((stream.finish() if tokenizer is not None and not args.ids else "") + "\n")
    sys.stdout.flush()
    stats = res.stats()
    line = f"prompt {len(prompt_ids)} tokens, new {res.new_tokens} tokens, prefill {res.prefill_s * 1e3:.1f} ms, "
    line += f"decode {res.tok_s:.1f} tok/s" if stats["rounds"] else "no decode round"
    if stats["rounds"] and engine.window > 1:
        line += f", tau {stats['tau']:.2f}, acceptance {stats['acceptance_rate']:.2f} (W={engine.window}"
        line += ")" if res.tree is None else f", tree of {res.tree} nodes)"
        if engine.policy is not None and not engine.config.auto_window:
            line += f"; adaptive window, now {engine.policy.best()}"
        elif engine.policy is not None:
            line += f"; auto window, {1 + stats['drafted'] / stats['rounds']:.2f} on average"
    if res.limit == "context":
        line += f"; stopped at the end of the context ({engine.max_len} tokens, --max-model-len)"
    print(line, file=sys.stderr)
    plan = pair.target.expert_plan
    if plan is not None and plan.moved is not None:
        print(f"experts: the prompt's prefill moved {plan.moved} onto the device (--expert-placement prefill)",
              file=sys.stderr)
        stats["experts_moved"] = plan.moved
    if stats_json:
        import torch

        write_json_atomic(stats_json, {**stats, "threads": torch.get_num_threads()})
    return 0


def cmd_init_random(args) -> int:
    from .models.random_init import write_random_model

    if args.quant is not None:
        return init_random_gguf(args)
    out = check_output(args.out_dir, folder=True)
    if out.is_dir() and any(out.iterdir()) and not args.force:
        raise StrataError(f"{args.out_dir}: exists and is not empty (add --force to write the model there, "
                          f"replacing its config.json and weights)")
    stale = sorted(p for p in out.glob("*.safetensors*") if p.name != "model.safetensors") if out.is_dir() else []
    for path in stale:  # other weights there would load in place of (or beside) the new ones
        path.unlink()
    if stale:
        print(f"removed {', '.join(p.name for p in stale)}: weights of the model that was there", file=sys.stderr)
    write_random_model(out, shape=args.shape, seed=args.seed)
    print(f"wrote a random {args.shape} model to {args.out_dir}", file=sys.stderr)
    return 0


def init_random_gguf(args) -> int:
    import torch

    from .models.random_gguf import write_random_gguf

    out = check_output(args.out_dir)
    if out.exists() and not args.force:
        raise StrataError(f"{args.out_dir}: exists (add --force to replace it)")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise StrataError("--device cuda: no CUDA device is available")
    counts = write_random_gguf(out, args.shape, args.quant, args.seed, args.device)
    types = ", ".join(f"{n} {name}" for name, n in sorted(counts.items()))
    print(f"wrote a random {args.shape} {args.quant} GGUF to {args.out_dir} ({out.stat().st_size / 2 ** 30:.2f} GiB; "
          f"tensors: {types})", file=sys.stderr)
    return 0


def cmd_convert_dflash(args) -> int:
    import time

    from .dflash.converter import convert_hf_to_gguf

    t0 = time.perf_counter()
    art = convert_hf_to_gguf(args.src, args.out, args.target, args.tokenizer_pre, progress=not args.quiet,
                             qtype=args.qtype)
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
    from .models.inspect import describe_target

    target = describe_target(args.path) if args.model is None else None
    if target is not None:  # a target model: its shape and its MTP block
        print(target)
        return 0
    text, ok = inspect_path(args.path, args.model)
    print(text)
    return 0 if ok else 2


def dflash_pair(args, window: int | None = None, kinds: tuple[str, ...] = ("dflash",)):
    """The pair and engine settings of a command that needs a drafter of these kinds."""
    pair, config = load(args, window=window)
    if pair.drafter is None or pair.drafter.name not in kinds:
        raise StrataError("--dflash: no drafter given" + (" (or --mtp)" if "mtp" in kinds else ""))
    return pair, config


def cmd_parity(args) -> int:
    from .checks.parity import format_parity, run_parity
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

    from .checks.taps import taps_check
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
    from .checks.gate import gate, gate_report
    from .prompts import prompt_set

    stats_json = args.stats_json and check_output(args.stats_json, what="--stats-json", inputs=inputs_of(args))
    pair, config = dflash_pair(args, kinds=("dflash", "mtp"))
    windows = args.spec_list or [pair.drafter.window]
    for w in windows:
        replace(config, window=w).window_for(pair.drafter)
    prompts = prompt_set(pair, args.prompt_ids, args.prompts)
    records = []
    for rec in gate(pair.target, pair.drafter, prompts, windows, args.max_new_tokens, pair.stop_ids, config):
        records.append(rec)
        st = rec.dflash.acceptance
        print(f"prompt {rec.prompt} W={rec.window}: "
              f"{'identical' if rec.identical else 'DIFFERENT at ' + str(rec.first_difference)}"
              f", tau {st.tau:.2f}, acceptance {st.acceptance_rate:.2f}")
    report = gate_report(records, len(prompts), args.max_new_tokens)
    for w, agg in report["windows"].items():
        print(f"W={w}{'' if config.tree is None else f', tree of {config.tree} nodes'}: tau {agg['tau']:.3f} over "
              f"{agg['rounds']} rounds; acceptance by position "
              + " ".join(f"{p:.2f}" for p in agg["per_position_acceptance"]))
    print(f"gate: {'PASS' if report['failures'] == 0 else 'FAIL'} "
          f"({len(records) - report['failures']}/{len(records)} identical)")
    if stats_json:
        write_json_atomic(stats_json, report)
    return 0 if report["failures"] == 0 else 1


def cmd_train_drafter(args) -> int:
    from .dflash.train import TrainConfig, train
    from .pair import PairSpec, load_pair

    check_output(args.out, folder=True, what="--out", inputs=[args.target, *args.data])
    pair = load_pair(PairSpec(model=args.target, device=args.device, dtype=args.dtype), drafter=False)
    pair.text_tokenizer("needed to read --data")
    tc = TrainConfig(layers=args.layers, block_size=args.block_size,
                     taps=parse_ids(args.taps, "--taps") if args.taps else None, steps=args.steps,
                     batch_size=args.batch_size, lr=args.lr, prompt_len=args.prompt_len, gen_len=args.gen_len,
                     num_sequences=args.num_sequences, seed=args.seed, eval_every=args.eval_every,
                     save_every=args.save_every, temperature=args.temperature, variant=args.variant,
                     init_from=args.init_from)
    trainer = train(pair.target, pair.tokenizer, tc, Path(args.out), args.device, args.data, args.resume,
                    progress=not args.quiet)
    last = trainer.history[-1] if trainer.history else {}
    cfg = trainer.cfg
    print(f"wrote {args.out}: {cfg.num_layers}-layer {cfg.variant} drafter, block {cfg.block_size}, taps "
          f"{cfg.target_layer_ids}; "
          f"held-out loss {last.get('held_out_loss', float('nan')):.3f}, tau estimate "
          f"{last.get('tau_estimate', float('nan')):.2f}", file=sys.stderr)
    return 0


def check_batching(args) -> None:
    """--max-num-seqs N > 1 before anything loads: what batched serving runs so far (target-only, dense
    attention-only targets)."""
    from .models.loader import load_model_config
    from .pair import resolve

    spec = pair_spec(args)
    model, dflash, _ = resolve(spec)
    if dflash or spec.prompt_lookup is not None or spec.mtp:
        raise StrataError(f"--max-num-seqs {args.max_num_seqs}: batched serving runs target-only so far; add "
                          f"--no-dflash (or serve one sequence at a time)")
    from .engine.batch import refuse_unless_batchable

    cfg = load_model_config(model)[1]
    try:
        refuse_unless_batchable(cfg, args.max_num_seqs, engine_config(args).context(cfg), spec.torch_device(),
                                spec.torch_dtype())
    except SettingError as e:
        raise StrataError(e.named(FLAGS)) from None


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
    if args.tree is not None:
        defaults.setdefault("temperature", 0.0)  # a tree verifies greedy requests only
    if defaults:
        from .engine.sampling import SamplingParams

        SamplingParams(**{"temperature": 1.0, **defaults})  # bad defaults are refused before loading
    if args.max_num_seqs < 1:
        raise StrataError(f"--max-num-seqs must be >= 1, got {args.max_num_seqs}")
    if args.max_num_seqs > 1:
        check_batching(args)
    pair, config = load(args, window=args.spec)
    engine = Engine(pair.target, pair.drafter, config)
    batch = None
    if args.max_num_seqs > 1:
        from .engine.batch import BatchEngine

        batch = BatchEngine(pair.target, args.max_num_seqs, engine.max_len)
    name = args.served_model_name or ("strata-demo" if pair.using_demo else pair.model_dir.name)
    api_key = args.api_key or os.environ.get("STRATA_API_KEY") or None
    server = Server(engine, pair.tokenizer, ServerConfig(
        name, pair.stop_ids, max_queue=args.max_queue, api_key=api_key, max_body_bytes=args.max_body_bytes,
        timeout=args.timeout, loopback=args.host in ("127.0.0.1", "localhost", "::1"), defaults=defaults,
        setting_names=FLAGS), batch)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    print(f"strata serve: model '{name}' ({engine.drafter.name} drafter, W={engine.window}) on "
          f"http://{args.host}:{args.port}{'' if api_key is None else ' (API key required)'}", file=sys.stderr,
          flush=True)
    serve_forever(server, args.host, args.port, args.shutdown_timeout, args.timeout)
    return 0


def cmd_bench(args) -> int:
    from .bench.command import BenchSpec, run_command, summary, write

    bench = BenchSpec(shape=args.shape, drafter_layers=args.drafter_layers, drafter_variant=args.drafter_variant,
                      drafter_type=args.drafter_type, block_size=args.block_size,
                      prompt_len=args.prompt_len, prompt=args.prompt, new_tokens=args.new_tokens, runs=args.runs,
                      hf=args.hf, profile=args.profile, quant=args.quant, trees=tuple(args.tree or ()),
                      prompts=args.prompts, windows=tuple(args.verify_windows or ()),
                      window_sweep=args.window_sweep or args.spec == "auto")
    out = None
    if args.out is not None:  # every file checked before any timing
        given = Path(args.out)
        if given.suffix == ".png" or not given.name:
            raise StrataError(f"--out {args.out!r}: expected the JSON's file name (its plot goes beside it as .png)")
        named = (given, given.with_suffix(".png"), given.parent / "index.jsonl")
        inputs = inputs_of(args)
        out = [check_output(path, what=what, inputs=inputs)
               for path, what in zip(named, ("--out", "--out's plot", "--out's index"))]
    result = run_command(pair_spec(args), engine_config(args, args.spec), bench, "strata " + " ".join(sys.argv[1:]))
    for line in summary(result):
        print(line, file=sys.stderr)
    if out is not None:
        write(result, *out)
        print(f"wrote {named[0]} and {named[1]}, and its line in {named[2]}", file=sys.stderr)
    return 0
def set_threads(args) -> None:
    """--threads, else OMP_NUM_THREADS (torch reads it), else one thread on the CPU and every core with a
    GPU (whose CPU work is the experts an expert cache leaves in host memory)."""
    threads = getattr(args, "threads", None)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if threads is not None and not 1 <= threads <= cpus:
        raise StrataError(f"--threads must be between 1 and the {cpus} CPUs this process may use, got {threads}")
    if threads is None and (os.environ.get("OMP_NUM_THREADS") or not hasattr(args, "threads")):
        return
    import torch

    torch.set_num_threads(threads or (cpus if getattr(args, "device", "cpu") == "cuda" else 1))


def one_line(e: Exception) -> str:
    """An error's message on one line (a library's may span several)."""
    return " ".join(str(e).split())


def main(argv: list[str] | None = None) -> int:
    parser = build_parser(sys.modules[__name__])
    args = parser.parse_args(argv)
    try:
        set_threads(args)
        return args.func(args)
    except SettingError as e:
        print(f"strata: error: {one_line(e.named(FLAGS))}", file=sys.stderr)
        return 2
    except StrataError as e:
        print(f"strata: error: {one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("strata: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except Exception as e:  # noqa: BLE001 - the last line of defence: one line, exit 1
        if os.environ.get("STRATA_DEBUG"):
            raise
        print(f"strata: internal error: {type(e).__name__}: {one_line(e)} (set STRATA_DEBUG=1 for a traceback)",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
