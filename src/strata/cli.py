"""The `strata` command line."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .errors import StrataError


def _ids(text: str, what: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise StrataError(f"{what}: expected comma-separated integers, got {text!r}") from None


def _device(name: str) -> str:
    import torch

    if name == "cuda" and not torch.cuda.is_available():
        raise StrataError("--device cuda: no CUDA device is available")
    return name


def _dtype(args):
    import torch

    from .models.weights import parse_dtype

    if args.dtype == "auto":
        return torch.bfloat16 if args.device == "cuda" else torch.float32
    return parse_dtype(args.dtype)


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="target model folder (Hugging Face layout); default: the embedded demo pair")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: float32 on cpu, bfloat16 on cuda")
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")


def add_prompt_set_args(p: argparse.ArgumentParser, first_only: bool) -> None:
    note = "; the first is used" if first_only else ""
    p.add_argument("--prompt-ids", action="append", help="comma-separated ids (repeatable)")
    p.add_argument("--prompts", help=f"prompts: a JSON list of strings (.json) or one per line{note}")


def add_decode_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dflash", help="DFlash drafter: a GGUF file or a Hugging Face folder "
                                    "(default with the demo target: the demo drafter)")
    p.add_argument("--no-dflash", action="store_true", help="target-only decoding, also for the demo pair")
    p.add_argument("--spec", type=int, default=None, help="verify window W (anchor + W-1 candidates)")
    p.add_argument("--dflash-window", type=int, default=32768, help="drafter attention window in context cells")
    p.add_argument("--prompt-lookup", type=int, metavar="N", help="prompt-lookup drafting with n-grams up to N")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--static", action="store_true",
                   help="fixed-shape verify/draft windows (the CUDA-graph layout; the default on a GPU)")
    p.add_argument("--eager", action="store_true",
                   help="on a GPU: dynamic shapes without CUDA graphs (the CPU's default layout)")
    p.add_argument("--no-graphs", action="store_true",
                   help="static layout without capturing CUDA graphs (the steps run eagerly)")
    p.add_argument("--no-compile", action="store_true",
                   help="CUDA graphs without torch.compile's fused elementwise kernels")
    p.add_argument("--no-triton", action="store_true",
                   help="CUDA graphs with torch.compile's kernels only, not Strata's Triton GEMV/attention kernels")
    p.add_argument("--attention", default="grouped", choices=["grouped", "sdpa"],
                   help="attention of the static steps: two matmuls per K/V head, or PyTorch SDPA")
    p.add_argument("--draft-sampling", default="sample", choices=["sample", "argmax"],
                   help="sampled decoding: draw DFlash candidates from q, or take q's argmax (one-hot q)")


def static_layout(args, target) -> bool:
    """The fixed-shape (CUDA-graph) layout: asked for with --static, the default on a GPU."""
    if args.static and args.eager:
        raise StrataError("--static and --eager are mutually exclusive")
    return args.static or (target.device.type == "cuda" and not args.eager)


def engine_options(args, target) -> dict:
    return dict(static=static_layout(args, target), graphs=not args.no_graphs, attention=args.attention,
                compile=not args.no_compile, triton=not args.no_triton)


def sampling_params(args):
    from .spec.sampling import SamplingParams

    return SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)


def resolve_demo(args) -> None:
    """No --model: the embedded demo pair (its drafter too, unless another drafter or none is asked for)."""
    from . import demo

    if args.model:
        return
    if not demo.available():
        raise StrataError("--model: no target model given and the embedded demo pair is not installed")
    args.model = str(demo.TARGET)
    args.using_demo = True
    if hasattr(args, "dflash") and not args.dflash and not args.no_dflash and args.prompt_lookup is None:
        args.dflash = str(demo.DRAFTER)


def load_target_and_tokenizer(args):
    from .models.decoder import load_target
    from .tokenizer import Tokenizer

    resolve_demo(args)
    if getattr(args, "max_model_len", None) is not None and args.max_model_len < 2:
        raise StrataError(f"--max-model-len must be >= 2, got {args.max_model_len}")
    if getattr(args, "no_dflash", False):
        args.dflash = None
    target = load_target(args.model, device=_device(args.device), dtype=_dtype(args))
    return target, Tokenizer.from_folder(Path(args.model))


def build_engine(args, target):
    from .spec.decode import Engine

    sampling_params(args)  # validate before any loading work
    drafter = None
    max_len = args.max_model_len or target.cfg.max_position_embeddings
    if args.dflash and args.prompt_lookup is not None:
        raise StrataError("--dflash and --prompt-lookup are mutually exclusive: choose one drafter")
    if args.prompt_lookup is not None:
        from .spec.prompt_lookup import PromptLookupDrafter

        if args.prompt_lookup < 1:
            raise StrataError(f"--prompt-lookup must be >= 1, got {args.prompt_lookup}")
        w = args.spec or 8
        if w < 2:
            raise StrataError(f"--spec {w}: must be >= 2")
        drafter = PromptLookupDrafter(args.prompt_lookup, max_window=w, device=target.device)
    elif args.dflash:
        drafter = load_dflash_for(args, target)
        check_window(args.spec, drafter)
    elif args.spec is not None:
        raise StrataError("--spec needs a drafter (--dflash or --prompt-lookup)")
    return Engine(target, drafter, window=args.spec, max_len=max_len, draft_sampling=args.draft_sampling,
                  **engine_options(args, target))


def stop_ids_for(args, target, tokenizer) -> set[int]:
    from .models.config import read_json

    ids = set(target.cfg.eos_token_ids)
    gen_cfg = Path(args.model) / "generation_config.json"
    if gen_cfg.is_file():
        eos = read_json(gen_cfg, "generation_config.json").get("eos_token_id")
        if eos is not None:
            ids |= set([eos] if isinstance(eos, int) else eos)
    if args.stop_ids:
        ids |= set(_ids(args.stop_ids, "--stop-ids"))
    return ids


def cmd_generate(args) -> int:
    from .tokenizer import StreamDecoder

    if args.text is not None:
        if args.prompt is not None:
            raise StrataError("give the prompt once: as an argument or with --prompt")
        args.prompt = args.text
    if (args.prompt is None) == (args.prompt_ids is None):
        raise StrataError("give exactly one of a prompt (TEXT or --prompt TEXT) or --prompt-ids 1,2,3")
    target, tokenizer = load_target_and_tokenizer(args)
    if args.prompt is not None:
        if tokenizer is None:
            raise StrataError(f"{args.model}: no tokenizer.json; use --prompt-ids")
        text = args.prompt
        if args.chat:
            text = tokenizer.apply_chat_template([{"role": "user", "content": text}])
        prompt_ids = tokenizer.encode(text)
    else:
        prompt_ids = _ids(args.prompt_ids, "--prompt-ids")
    params = sampling_params(args)
    engine = build_engine(args, target)
    stops = stop_ids_for(args, target, tokenizer)
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

    res = engine.generate(prompt_ids, args.max_new_tokens, stops, params, on_tokens=on_tokens)
    sys.stdout.write("\n")
    sys.stdout.flush()
    stats = res.stats()
    line = (f"prompt {len(prompt_ids)} tokens, new {res.new_tokens} tokens, prefill {res.prefill_s * 1e3:.1f} ms, "
            f"decode {res.tok_s:.1f} tok/s")
    if stats["rounds"] and engine.window > 1:
        line += f", tau {stats['tau']:.2f}, acceptance {stats['acceptance_rate']:.2f} (W={engine.window})"
    print(line, file=sys.stderr)
    if args.stats_json:
        write_json_atomic(Path(args.stats_json), stats)
    return 0


def write_json_atomic(path: Path, data) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)


def cmd_init_random(args) -> int:
    from .models.random_init import write_random_model

    out = write_random_model(args.out_dir, shape=args.shape, seed=args.seed)
    print(f"wrote a random {args.shape} model to {out}", file=sys.stderr)
    return 0


def cmd_convert_dflash(args) -> int:
    import time

    from .dflash.converter import convert_hf_to_gguf

    t0 = time.perf_counter()
    art = convert_hf_to_gguf(args.src, args.out, progress=not args.quiet)
    print(f"wrote {args.out}: {len(art.tensors)} BF16 tensors, {art.parameter_count:,} parameters, "
          f"read-back bit-exact ({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    return 0


def cmd_export_dflash(args) -> int:
    from .dflash.converter import export_gguf_to_hf

    art = export_gguf_to_hf(args.src, args.out_dir, progress=not args.quiet)
    print(f"wrote {args.out_dir}: config.json + model.safetensors, {len(art.tensors)} tensors, read-back bit-exact",
          file=sys.stderr)
    return 0


def cmd_inspect(args) -> int:
    from .dflash.inspect import inspect_path

    text, ok = inspect_path(args.path)
    print(text)
    return 0 if ok else 2


DEFAULT_PROMPTS = [
    "def quicksort(arr):",
    "import os\n\ndef list_python_files(root):",
    "class Stack:\n    def __init__(self):",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"",
]


def read_prompts_file(path: str) -> list[str]:
    """A .json file holds a list of strings; any other file holds one prompt per line."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise StrataError(f"--prompts {path}: {e.strerror}") from None
    if path.endswith(".json"):
        try:
            prompts = json.loads(text)
        except json.JSONDecodeError as e:
            raise StrataError(f"--prompts {path}: not valid JSON ({e})") from None
        if not isinstance(prompts, list) or not all(isinstance(p, str) and p for p in prompts) or not prompts:
            raise StrataError(f"--prompts {path}: expected a non-empty JSON list of non-empty strings")
        return prompts
    prompts = [ln for ln in text.splitlines() if ln.strip()]
    if not prompts:
        raise StrataError(f"--prompts {path}: no prompts in the file")
    return prompts


def prompts_from_args(args, tokenizer, vocab: int) -> list[list[int]]:
    """--prompt-ids (repeatable) / --prompts FILE (one text prompt per line) / a default set."""
    if getattr(args, "prompt_ids", None):
        return [_ids(p, "--prompt-ids") for p in args.prompt_ids]
    texts = read_prompts_file(args.prompts) if getattr(args, "prompts", None) else None
    if texts is None and getattr(args, "using_demo", False):
        from . import demo

        texts = read_prompts_file(str(demo.EVAL_PROMPTS))
    if texts is None and tokenizer is not None:
        texts = DEFAULT_PROMPTS
    if texts is not None:
        if tokenizer is None:
            raise StrataError(f"{args.model}: no tokenizer.json; use --prompt-ids")
        return [tokenizer.encode(t) for t in texts]
    import torch

    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (1, 7, 60)]


def check_window(w: int | None, drafter) -> None:
    if w is not None and not 2 <= w <= drafter.max_window:
        raise StrataError(f"--spec {w}: must be between 2 and the drafter's block size {drafter.max_window}")


def load_dflash_for(args, target):
    from .dflash.runtime import load_drafter

    if not args.dflash:
        raise StrataError("--dflash: no drafter given")
    max_len = args.max_model_len or target.cfg.max_position_embeddings
    return load_drafter(args.dflash, target, window_cells=args.dflash_window, max_len=max_len)


def cmd_parity(args) -> int:
    from .dflash.tools import format_parity, run_parity

    target, tokenizer = load_target_and_tokenizer(args)
    drafter = load_dflash_for(args, target)
    w = args.spec or drafter.max_window
    check_window(w, drafter)
    prompt = prompts_from_args(args, tokenizer, target.cfg.vocab_size)[0]
    plant = None
    if args.plant_bug:
        layer, _, stage = args.plant_bug.rpartition(":")
        plant = (int(layer) if layer else -1, stage)
    rows, first = run_parity(drafter, prompt, w, plant)
    print(format_parity(rows, first))
    return 0 if first is None else 1


def cmd_taps(args) -> int:
    import numpy as np

    from .dflash.tools import taps_check

    target, tokenizer = load_target_and_tokenizer(args)
    layers = _ids(args.layers, "--layers") if args.layers else None
    if layers is None:
        layers = load_dflash_for(args, target).tap_layers if args.dflash else list(range(target.cfg.num_layers))
    bad = [l for l in layers if not 0 <= l < target.cfg.num_layers]
    if bad:
        raise StrataError(f"--layers: layer {bad[0]} outside the target's 0..{target.cfg.num_layers - 1}")
    prompt = prompts_from_args(args, tokenizer, target.cfg.vocab_size)[0]
    seq = prompt + target_continuation(target, prompt, args.new_tokens)
    prefix = max(1, len(prompt))
    worst = 1.0
    for w in args.windows:
        cos, err = taps_check(target, layers, seq, prefix, w)
        worst = min(worst, float(cos.min()))
        print(f"W={w}: {len(seq) - prefix} positions, cosine min {cos.min():.8f} median {np.median(cos):.8f}, "
              f"max abs {err:.3e}")
    ok = worst >= args.min_cos
    print(f"taps (HF ids) {layers}: {'OK' if ok else 'FAIL'} (min cosine {worst:.8f}, threshold {args.min_cos})")
    return 0 if ok else 1


def target_continuation(target, prompt: list[int], n: int) -> list[int]:
    from .spec.decode import Engine

    return Engine(target, max_len=len(prompt) + n + 1).generate(prompt, n).output_ids


def cmd_gate(args) -> int:
    from .dflash.tools import gate

    target, tokenizer = load_target_and_tokenizer(args)
    drafter = load_dflash_for(args, target)
    windows = args.spec_list or [drafter.max_window]
    for w in windows:
        check_window(w, drafter)
    prompts = prompts_from_args(args, tokenizer, target.cfg.vocab_size)
    stops = stop_ids_for(args, target, tokenizer)
    max_len = args.max_model_len or target.cfg.max_position_embeddings
    failures, summary = 0, {}
    records = []
    for rec in gate(target, drafter, prompts, windows, args.max_new_tokens, stops, max_len,
                    **engine_options(args, target)):
        st = rec["dflash"].stats()
        records.append({"prompt": rec["prompt"], "window": rec["window"], "identical": rec["identical"],
                        "first_difference": rec["first_difference"], "tau": st["tau"],
                        "acceptance_rate": st["acceptance_rate"], "new_tokens": st["new_tokens"],
                        "per_position_acceptance": st["per_position_acceptance"],
                        "accept_lengths": st["accept_lengths"]})
        failures += not rec["identical"]
        agg = summary.setdefault(rec["window"], {"committed": 0, "rounds": 0, "acc": [0] * (rec["window"] - 1),
                                                 "drafted": [0] * (rec["window"] - 1)})
        agg["committed"] += sum(st["accept_lengths"])
        agg["rounds"] += st["rounds"]
        res = rec["dflash"]
        agg["acc"] = [a + b for a, b in zip(agg["acc"], res.per_position_accepted)]
        agg["drafted"] = [a + b for a, b in zip(agg["drafted"], res.per_position_drafted)]
        print(f"prompt {rec['prompt']} W={rec['window']}: {'identical' if rec['identical'] else 'DIFFERENT at ' + str(rec['first_difference'])}"
              f", tau {st['tau']:.2f}, acceptance {st['acceptance_rate']:.2f}")
    out = {"prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "failures": failures, "windows": {}}
    for w, agg in summary.items():
        tau = agg["committed"] / agg["rounds"] if agg["rounds"] else 0.0
        per_pos = [a / d if d else 0.0 for a, d in zip(agg["acc"], agg["drafted"])]
        out["windows"][str(w)] = {"tau": tau, "per_position_acceptance": per_pos}
        print(f"W={w}: tau {tau:.3f} over {agg['rounds']} rounds; acceptance by position "
              + " ".join(f"{p:.2f}" for p in per_pos))
    out["records"] = records
    print(f"gate: {'PASS' if failures == 0 else 'FAIL'} ({len(records) - failures}/{len(records)} identical)")
    if args.stats_json:
        write_json_atomic(Path(args.stats_json), out)
    return 0 if failures == 0 else 1


def cmd_train_drafter(args) -> int:
    import torch

    from .dflash.train import DrafterTrainer, TrainConfig, read_corpus, self_distill

    args.model = args.target
    target, tokenizer = load_target_and_tokenizer(args)
    if tokenizer is None:
        raise StrataError(f"{args.target}: no tokenizer.json (needed to read --data)")
    tc = TrainConfig(layers=args.layers, block_size=args.block_size,
                     taps=_ids(args.taps, "--taps") if args.taps else None, steps=args.steps,
                     batch_size=args.batch_size, lr=args.lr, prompt_len=args.prompt_len, gen_len=args.gen_len,
                     num_sequences=args.num_sequences, seed=args.seed, eval_every=args.eval_every,
                     save_every=args.save_every, temperature=args.temperature)
    if tc.block_size < 2:
        raise StrataError(f"--block-size must be >= 2, got {tc.block_size}")
    out = Path(args.out)
    trainer = DrafterTrainer(target, tc, out, args.device)
    data_path = out / "distill.pt"
    resumed = args.resume and trainer.load_checkpoint()
    if resumed and data_path.is_file():
        trainer.set_data(torch.load(data_path, weights_only=True))
    else:
        seqs = self_distill(target, read_corpus(args.data, tokenizer), tc, args.device).cpu()
        out.mkdir(parents=True, exist_ok=True)
        torch.save(seqs, data_path)
        trainer.set_data(seqs)
    history = trainer.fit(progress=not args.quiet)
    last = history[-1] if history else {}
    print(f"wrote {out}: {tc.layers}-layer drafter, block {tc.block_size}, taps {trainer.cfg.target_layer_ids}; "
          f"held-out loss {last.get('held_out_loss', float('nan')):.3f}, tau estimate "
          f"{last.get('tau_estimate', float('nan')):.2f}", file=sys.stderr)
    return 0


def cmd_serve(args) -> int:
    import logging

    from .serve.app import Server, serve_forever

    if args.max_queue < 1:
        raise StrataError(f"--max-queue must be >= 1, got {args.max_queue}")
    target, tokenizer = load_target_and_tokenizer(args)
    engine = build_engine(args, target)
    name = args.served_model_name or ("strata-demo" if getattr(args, "using_demo", False) else Path(args.model).name)
    server = Server(engine, tokenizer, name, stop_ids_for(args, target, tokenizer), max_queue=args.max_queue)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    print(f"strata serve: model '{name}' ({engine.drafter.name} drafter, W={engine.window}) on "
          f"http://{args.host}:{args.port}", file=sys.stderr, flush=True)
    serve_forever(server, args.host, args.port, args.shutdown_timeout)
    return 0


def cmd_bench(args) -> int:
    import time

    import torch

    from .bench.plot import plot
    from .bench.run import random_drafter, run_bench, sync
    from .models.random_init import random_target

    device = _device(args.device)
    if args.prompt_len < 1 or args.new_tokens < 1:
        raise StrataError("--prompt-len and --new-tokens must be >= 1")
    t0 = time.perf_counter()
    if args.shape:
        if args.model:
            raise StrataError("give --model or --shape, not both")
        target = random_target(args.shape, device=device, dtype=_dtype(args))
        label, tokenizer = args.shape, None
    else:
        target, tokenizer = load_target_and_tokenizer(args)
        label = "demo" if getattr(args, "using_demo", False) else Path(args.model).name
    sync(device)
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    if args.dflash:
        drafter = load_dflash_for(args, target)
    elif args.drafter_layers:
        drafter = random_drafter(target, args.drafter_layers, args.block_size)
    else:
        drafter = None
    sync(device)
    drafter_s = time.perf_counter() - t0
    window = args.spec or (drafter.max_window if drafter else 8)
    if drafter is not None:
        check_window(window, drafter)
    if args.prompt is not None:
        if tokenizer is None:
            raise StrataError("--prompt needs a model with a tokenizer (random --shape weights have none)")
        prompt = tokenizer.encode(args.prompt)
        if not prompt:
            raise StrataError("--prompt: the text encodes to no tokens")
    else:
        gen = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, target.cfg.vocab_size, (args.prompt_len,), generator=gen).tolist()
    hf = [] if args.hf == "none" else args.hf.split(",")
    result = run_bench(target, drafter, prompt, args.new_tokens, window, runs=args.runs, hf_modes=tuple(hf),
                       profile=args.profile, **engine_options(args, target),
                       startup={"load_target_s": load_s, "load_drafter_s": drafter_s})
    result["model"] = label
    result["drafter"] = (args.dflash or (f"random {args.drafter_layers}-layer" if args.drafter_layers else None))
    result["command"] = "strata " + " ".join(sys.argv[1:])
    out = Path(args.out or f"bench/results/bench-{label}-{device}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out, result)
    plot(result, out.with_suffix(".png"))
    t = result["target_only"]
    print(f"floor {result['floor_tok_s']:.1f} tok/s ({result['copy_bandwidth_GBps']:.1f} GB/s copy, "
          f"{result['weight_bytes'] / 1e6:.1f} MB weights)", file=sys.stderr)
    print(f"target-only {t['tok_s']:.1f} tok/s ({result['ratios']['target_only_vs_floor']:.2f} of floor)",
          file=sys.stderr)
    if "target_only_without_triton" in result:
        print(f"target-only without Strata's Triton kernels {result['target_only_without_triton']['tok_s']:.1f} tok/s "
              f"(the kernels: x{result['ratios']['triton_vs_compiled_only']:.2f})", file=sys.stderr)
    o = result["dflash_oracle"]
    print(f"DFlash oracle W={window}: {o['tok_s']:.1f} tok/s, tau {o['tau']:.2f}, "
          f"x{result['ratios']['oracle_vs_target_only']:.2f}; round: draft {o['split']['draft_ms']:.2f} ms, "
          f"verify {o['split']['verify_ms']:.2f} ms, other {o['split']['other_ms']:.2f} ms", file=sys.stderr)
    if "dflash" in result:
        d = result["dflash"]
        print(f"DFlash W={window}: {d['tok_s']:.1f} tok/s, tau {d['tau']:.2f}, "
              f"x{result['ratios']['dflash_vs_target_only']:.2f}; round: draft {d['split']['draft_ms']:.2f} ms, "
              f"verify {d['split']['verify_ms']:.2f} ms", file=sys.stderr)
    for mode, r in (result.get("hf") or {}).items():
        if isinstance(r, dict) and "tok_s" in r:
            print(f"HF generate ({mode}): {r['tok_s']:.1f} tok/s (first call {r['first_call_s']:.1f} s)",
                  file=sys.stderr)
        elif isinstance(r, dict) and "error" in r:
            print(f"HF generate ({mode}): {r['error']}", file=sys.stderr)
    print(f"wrote {out} and {out.with_suffix('.png')}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="strata", description="Fast, lossless LLM decoding with DFlash drafters")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate from a prompt (target-only or speculative)")
    add_model_args(g)
    add_decode_args(g)
    g.add_argument("text", nargs="?", help="the prompt (same as --prompt)")
    g.add_argument("--prompt")
    g.add_argument("--prompt-ids")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    g.add_argument("--ids", action="store_true", help="print token ids even when a tokenizer exists")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--stop-ids", help="extra stop token ids, comma-separated")
    g.add_argument("--stats-json", help="write generation statistics to this file")
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("convert-dflash", help="reference Hugging Face DFlash drafter -> llama.cpp GGUF (BF16)")
    c.add_argument("src")
    c.add_argument("out")
    c.add_argument("--quiet", action="store_true", help="no progress bars")
    c.set_defaults(func=cmd_convert_dflash)

    e = sub.add_parser("export-dflash", help="DFlash GGUF -> reference Hugging Face folder")
    e.add_argument("src")
    e.add_argument("out_dir")
    e.add_argument("--quiet", action="store_true", help="no progress bars")
    e.set_defaults(func=cmd_export_dflash)

    i = sub.add_parser("inspect", help="describe and validate a DFlash drafter (GGUF file or HF folder)")
    i.add_argument("path")
    i.set_defaults(func=cmd_inspect)

    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_model_args(sv)
    add_decode_args(sv)
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--max-queue", type=int, default=64, help="requests admitted at once; more get HTTP 429")
    sv.add_argument("--served-model-name", help="the model id clients use (default: the folder name)")
    sv.add_argument("--stop-ids", help="extra stop token ids, comma-separated")
    sv.add_argument("--shutdown-timeout", type=float, default=30.0,
                    help="seconds in-flight requests get to finish after SIGTERM")
    sv.set_defaults(func=cmd_serve)

    be = sub.add_parser("bench", help="Strata target-only vs DFlash vs HF generate vs the bandwidth floor")
    add_model_args(be)
    add_decode_args(be)
    be.add_argument("--shape", choices=["tiny", "qwen3-4b", "qwen3-8b"], help="random weights of a named shape")
    be.add_argument("--drafter-layers", type=int, help="a random DFlash drafter of this many layers")
    be.add_argument("--block-size", type=int, default=16, help="block size of the random drafter")
    be.add_argument("--prompt-len", type=int, default=512, help="random prompt tokens (without --prompt)")
    be.add_argument("--prompt", help="a text prompt instead of random tokens (models with a tokenizer)")
    be.add_argument("--new-tokens", type=int, default=256)
    be.add_argument("--runs", type=int, default=3, help="timed runs per method (median reported)")
    be.add_argument("--hf", default="eager", help="transformers generate modes: eager,static or none")
    be.add_argument("--out", help="result JSON (a PNG plot is written beside it)")
    be.add_argument("--profile", action="store_true", help="GPU: kernel time vs wall time of each captured step")
    be.set_defaults(func=cmd_bench)

    pa = sub.add_parser("parity", help="one proposal, runtime vs the NumPy reference, stage by stage")
    add_model_args(pa)
    add_decode_args(pa)
    add_prompt_set_args(pa, first_only=True)
    pa.add_argument("--plant-bug", help="self-test: perturb LAYER:STAGE (e.g. 0:q_roped, :logits) in the runtime")
    pa.set_defaults(func=cmd_parity)

    ta = sub.add_parser("taps", help="taps from prefill vs taps from verify windows, per position")
    add_model_args(ta)
    add_decode_args(ta)
    add_prompt_set_args(ta, first_only=True)
    ta.add_argument("--layers", help="HF layer ids to tap (default: the drafter's, else all)")
    ta.add_argument("--windows", type=int, nargs="+", default=[1, 4, 8])
    ta.add_argument("--new-tokens", type=int, default=32)
    ta.add_argument("--min-cos", type=float, default=0.9999)
    ta.set_defaults(func=cmd_taps)

    ga = sub.add_parser("gate", help="greedy identity gate: target-only vs DFlash, token for token")
    add_model_args(ga)
    add_decode_args(ga)
    add_prompt_set_args(ga, first_only=False)
    ga.add_argument("--spec-list", type=int, nargs="+", help="windows W to gate (default: the block size)")
    ga.add_argument("--max-new-tokens", type=int, default=64)
    ga.add_argument("--stop-ids", help="extra stop token ids, comma-separated")
    ga.add_argument("--stats-json", help="write the gate's statistics to this file")
    ga.set_defaults(func=cmd_gate)

    tr = sub.add_parser("train-drafter", help="train a DFlash drafter for a target by self-distillation")
    tr.add_argument("--target", required=True, help="target model folder (with tokenizer.json)")
    tr.add_argument("--data", nargs="+", required=True, help="text files the prompts are cut from")
    tr.add_argument("--out", required=True, help="output folder (reference Hugging Face format)")
    tr.add_argument("--layers", type=int, default=2)
    tr.add_argument("--block-size", type=int, default=8)
    tr.add_argument("--taps", help="target layer ids (HF convention), comma-separated")
    tr.add_argument("--steps", type=int, default=2000)
    tr.add_argument("--batch-size", type=int, default=32)
    tr.add_argument("--lr", type=float, default=6e-4)
    tr.add_argument("--prompt-len", type=int, default=64)
    tr.add_argument("--gen-len", type=int, default=192)
    tr.add_argument("--num-sequences", type=int, default=2048)
    tr.add_argument("--temperature", type=float, default=0.0, help="self-distillation sampling temperature")
    tr.add_argument("--eval-every", type=int, default=200)
    tr.add_argument("--save-every", type=int, default=500)
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    tr.add_argument("--quiet", action="store_true")
    tr.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    tr.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    tr.set_defaults(func=cmd_train_drafter)

    r = sub.add_parser("init-random", help="write a random-weight model of a named shape (HF layout)")
    r.add_argument("out_dir")
    r.add_argument("--shape", default="tiny", choices=["tiny", "qwen3-4b", "qwen3-8b"])
    r.add_argument("--seed", type=int, default=0)
    r.set_defaults(func=cmd_init_random)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
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
