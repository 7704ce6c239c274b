"""The `strata` command line's options: one function per group of options, one parser per command, each
command given only the options it uses."""

from __future__ import annotations

import argparse

from .models.shapes import SHAPES

#: the llama.cpp file types of --quant (layers/quant.py's RECIPES)
QUANTS = ["Q8_0", "Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K", "IQ4_XS", "Q3_K_M", "IQ3_XXS"]


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
                   help="CPU threads (default: OMP_NUM_THREADS if set, else 1 on the CPU: on the CPUs measured, more "
                        "threads were no faster for models up to 0.7 GB and 4-6x slower while another process was "
                        "busy; every core with --device cuda, where they run the experts kept on the CPU)")
    g.add_argument("--check-tensors", action="store_true",
                   help="scan every weight for NaN / inf at load (quantized blocks: their scales), and refuse a "
                        "model that has any")
    g.add_argument("--expert-cache", type=int, metavar="MIB",
                   help="mixture-of-experts targets: MiB of experts kept on the device, the rest in host memory run "
                        "by the CPU (0: every expert on the CPU; default: what the GPU has left after the other "
                        "weights, the KV cache, the drafter and a workspace; on the CPU every expert stays)")
    g.add_argument("--expert-placement", default="static", metavar="WHICH",  # PairSpec checks it
                   help="with --expert-cache: which experts the device keeps: each layer's lowest-numbered "
                        "(static, the default: a pinned budget always places the same), or those the first "
                        "prompt's prefill routes to most (prefill: more of each token's experts on the device "
                        "when routing is skewed, as a trained router's is)")


def spec_window(text: str) -> int | str:
    """--spec: a window W, or auto."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a window (an integer) or auto, got {text!r}") from None


def add_drafter_args(p: argparse.ArgumentParser, spec: bool = True, lookup: bool = True, tree: str | None = "one",
                     mtp: bool = True) -> None:
    """tree: "one" budget, "many" (bench's sweep) or None (commands that verify no tree)."""
    g = p.add_argument_group("drafter")
    g.add_argument("--dflash", metavar="DRAFTER", help="DFlash drafter: a GGUF file or a Hugging Face folder "
                                                       "(default with the demo target: the demo drafter)")
    g.add_argument("--no-dflash", action="store_true", help="target-only decoding, also for the demo pair")
    if spec:
        g.add_argument("--spec", type=spec_window, default=None, metavar="W|auto",
                       help="verify window W: the anchor + W-1 candidates (default: the drafter's block size); "
                            "auto: each round the window up to the block size that the drafter's confidence in its "
                            "candidates and each window's measured cost predict pays best (DFlash drafters)")
        g.add_argument("--draft-p-min", type=float, default=0.0, metavar="P",
                       help="end a DFlash draft before its first candidate the drafter rates below P (llama.cpp's "
                            "--spec-draft-p-min: DFlash's top-10 probability, DFlash2's among its candidates, "
                            "DSpark's confidence head); default 0: off")
        g.add_argument("--adaptive-window", action="store_true",
                       help="verify each round the window up to W (powers of two, and W) with the most tokens per "
                            "second expected from the acceptance so far and each window's measured cost (for "
                            "targets whose verify cost grows with its rows, as MoE; the output is unchanged)")
    g.add_argument("--dflash-window", type=int, default=32768, metavar="CELLS",
                   help="context cells a drafter layer attends to before its block (default 32768)")
    if lookup:
        g.add_argument("--prompt-lookup", type=int, metavar="N",
                       help="prompt-lookup drafting with n-grams up to N (instead of a DFlash drafter)")
    if mtp:
        g.add_argument("--mtp", action="store_true",
                       help="draft with the model's own MTP block (Qwen3.5 / Qwen3.6 / Qwen3-Next checkpoints and "
                            "their GGUF files), as llama.cpp's --spec-type draft-mtp: --spec W drafts W-1 tokens a "
                            "round, one after another (default W 4)")
    else:
        p.set_defaults(mtp=False)
    if tree == "one":
        g.add_argument("--tree", type=int, metavar="N",
                       help="tree verification: a draft tree of N nodes from each DFlash pass (greedy only; "
                            "default: the chain)")
    elif tree == "many":
        g.add_argument("--tree", type=int, nargs="+", metavar="N",
                       help="also measure tree verification with these node budgets (DFlash drafter)")
    else:
        p.set_defaults(tree=None)
    if not spec:
        p.set_defaults(spec=None, adaptive_window=False, draft_p_min=0.0)
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


def build_parser(commands) -> argparse.ArgumentParser:
    """commands: the module holding the cmd_* functions the parsers dispatch to."""
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
    g.set_defaults(func=commands.cmd_generate)

    c = sub.add_parser("convert-dflash", help="reference Hugging Face DFlash drafter -> llama.cpp GGUF "
                                              "(2-D BF16, 1-D F32, the target's vocabulary)")
    c.add_argument("src", help="the drafter's Hugging Face folder (config.json + safetensors)")
    c.add_argument("out", help="the GGUF file to write")
    c.add_argument("--target", help="the target model (folder with tokenizer.json, or GGUF file) whose vocabulary "
                                    "the drafter carries; needed when the drafter folder has no tokenizer.json")
    c.add_argument("--tokenizer-pre", metavar="NAME", help="llama.cpp's pre-tokenizer name, when it cannot be told "
                                                           "from tokenizer.json (gpt-2, qwen2, llama-bpe, ...)")
    c.add_argument("--type", default="BF16", choices=["BF16", "Q8_0"], dest="qtype",
                   help="the matrices' type: BF16 (llama.cpp's converter's), or Q8_0 (what llama-quantize makes of "
                        "that, byte for byte; kept in its blocks on a GPU)")
    c.add_argument("--quiet", action="store_true", help="no progress bars")
    c.set_defaults(func=commands.cmd_convert_dflash)

    e = sub.add_parser("export-dflash", help="DFlash drafter (any accepted GGUF, quantized too) -> reference "
                                             "Hugging Face folder")
    e.add_argument("src", help="the drafter: a GGUF file (or a Hugging Face folder)")
    e.add_argument("out_dir", help="the folder to write (new or empty)")
    e.add_argument("--quiet", action="store_true", help="no progress bars")
    e.set_defaults(func=commands.cmd_export_dflash)

    i = sub.add_parser("inspect", help="describe and validate a DFlash drafter (GGUF file or HF folder), or describe "
                                      "a target model (its shape, experts and MTP block)")
    i.add_argument("path", help="the drafter or the target model: a GGUF file or a Hugging Face folder")
    i.add_argument("--model", help="a target model folder: check that the drafter fits it (sizes, taps, "
                                   "vocabulary, mask id)")
    i.set_defaults(func=commands.cmd_inspect)

    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    sv.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    sv.add_argument("--max-num-seqs", type=int, default=1, metavar="N",
                    help="decode up to N requests together (continuous batching, vLLM's name; target-only so far: "
                         "dense attention-only targets, --no-dflash); each request's tokens are the same as served "
                         "alone (default 1: one at a time)")
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
    sv.set_defaults(func=commands.cmd_serve)

    be = sub.add_parser("bench", help="Strata target-only vs DFlash vs HF generate vs the bandwidth floor")
    be.add_argument("--shape", choices=list(SHAPES), help="random weights of a named shape")
    be.add_argument("--quant", choices=QUANTS,
                    help="with --shape: random valid GGUF blocks of this llama.cpp file type, kept "
                         "quantized on a GPU, dequantized on the CPU (as a GGUF file is)")
    be.add_argument("--drafter-layers", type=int, metavar="N", help="a random DFlash drafter of this many layers")
    be.add_argument("--block-size", type=int, default=16, help="block size of the random drafter (default 16)")
    be.add_argument("--drafter-variant", default="dflash", choices=["dflash", "dflash2", "dspark"],
                    help="the random drafter's kind (DFlash2: convolutions and selector; DSpark: Markov and "
                         "confidence heads)")
    be.add_argument("--drafter-type", default="BF16", choices=["BF16", "Q8_0"],
                    help="the random drafter's matrices as convert-dflash --type stores them (Q8_0: kept in "
                         "its blocks on a GPU)")
    be.add_argument("--prompt-len", type=int, default=512, metavar="N", help="random prompt tokens (without --prompt)")
    be.add_argument("--prompt", help="a text prompt instead of random tokens (models with a tokenizer)")
    be.add_argument("--new-tokens", type=int, default=256, metavar="N", help="tokens generated per run (default 256)")
    be.add_argument("--window-sweep", action="store_true",
                    help="DFlash at each fixed window (powers of two up to W, and W) and under --spec auto on the "
                         "prompt set (--prompts; default: the demo's held-out prompts): tok/s, tau, the best fixed "
                         "window against auto (--spec auto turns it on)")
    be.add_argument("--verify-windows", type=int, nargs="+", metavar="W",
                    help="also measure the target's step over each of these windows (target-only padded to W rows: "
                         "what a verify of W tokens costs), plotted against W")
    be.add_argument("--prompts", metavar="FILE", help="the sweeps' prompts: a JSON list of strings or one per "
                                                      "line (default: the demo's held-out prompts, else the bench's)")
    be.add_argument("--runs", type=int, default=3, help="timed runs per method (median reported)")
    be.add_argument("--hf", default="eager", help="transformers generate modes: eager,static or none")
    be.add_argument("--out", metavar="FILE", help="write the result JSON here, and a PNG plot beside it "
                                                  "(without it the results are only printed)")
    be.add_argument("--profile", action="store_true", help="GPU: kernel time vs wall time of each captured step")
    add_model_args(be)
    add_drafter_args(be, tree="many")
    add_layout_args(be)
    be.set_defaults(func=commands.cmd_bench)

    pa = sub.add_parser("parity", help="one proposal, runtime vs the NumPy reference, stage by stage")
    add_prompt_set_args(pa, first_only=True)
    pa.add_argument("--plant-bug", metavar="LAYER:STAGE",
                    help="self-test: perturb LAYER:STAGE (e.g. 0:q_roped, :logits) in the runtime")
    add_model_args(pa)
    add_drafter_args(pa, lookup=False, tree=None, mtp=False)
    add_layout_args(pa)
    pa.set_defaults(func=commands.cmd_parity)

    ta = sub.add_parser("taps", help="taps from prefill vs taps from verify windows, per position")
    add_prompt_set_args(ta, first_only=True)
    ta.add_argument("--layers", metavar="IDS", help="HF layer ids to tap (default: the drafter's, else all)")
    ta.add_argument("--windows", type=int, nargs="+", default=[1, 4, 8], metavar="W",
                    help="verify window sizes to compare (default 1 4 8)")
    ta.add_argument("--new-tokens", type=int, default=32, metavar="N",
                    help="tokens generated after the prompt and checked (default 32)")
    ta.add_argument("--min-cos", type=float, default=0.9999, help="lowest cosine that passes (default 0.9999)")
    add_model_args(ta)
    add_drafter_args(ta, spec=False, lookup=False, tree=None, mtp=False)
    add_layout_args(ta)
    ta.set_defaults(func=commands.cmd_taps)

    ga = sub.add_parser("gate", help="greedy identity gate: target-only vs DFlash, token for token")
    add_prompt_set_args(ga, first_only=False)
    ga.add_argument("--spec-list", type=int, nargs="+", metavar="W", help="windows W to gate (default: the block size)")
    ga.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="tokens per prompt (default 64)")
    ga.add_argument("--stop-ids", metavar="IDS", help="extra stop token ids, comma-separated")
    ga.add_argument("--stats-json", metavar="FILE", help="write the gate's statistics to this file")
    add_model_args(ga)
    add_drafter_args(ga, spec=False, lookup=False)
    add_layout_args(ga)
    ga.set_defaults(func=commands.cmd_gate)

    tr = sub.add_parser("train-drafter", help="train a DFlash drafter for a target by self-distillation")
    tr.add_argument("--target", required=True, help="target model folder (with tokenizer.json)")
    tr.add_argument("--data", nargs="+", required=True, metavar="FILE", help="text files the prompts are cut from")
    tr.add_argument("--out", required=True, metavar="DIR", help="output folder (reference Hugging Face format)")
    tr.add_argument("--layers", type=int, default=2, help="drafter layers (default 2)")
    tr.add_argument("--block-size", type=int, default=8, help="block size B: the largest verify window (default 8)")
    tr.add_argument("--taps", metavar="IDS", help="target layer ids (HF convention), comma-separated")
    tr.add_argument("--variant", default="dflash", choices=["dflash", "dflash2", "dspark"],
                    help="dflash2: convolutions and a candidate selector; dspark: Markov and confidence heads")
    tr.add_argument("--init-from", metavar="DRAFTER", help="start from this drafter's weights (GGUF or folder; "
                    "its layers, block size and taps replace --layers, --block-size and --taps)")
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
    tr.set_defaults(func=commands.cmd_train_drafter)

    r = sub.add_parser("init-random", help="write a random-weight model of a named shape (a Hugging Face folder, "
                                           "or with --quant a llama.cpp GGUF file)")
    r.add_argument("out_dir", help="the folder to write (new or empty), or with --quant the GGUF file")
    r.add_argument("--quant", choices=QUANTS,
                   help="write a GGUF file in llama.cpp's layout instead: random valid blocks of the types this "
                        "llama.cpp file type gives each matrix (for llama-bench and strata bench --model on one file)")
    r.add_argument("--force", action="store_true", help="write into a folder that is not empty, replacing its "
                                                         "config.json and weights")
    r.add_argument("--shape", default="tiny", choices=list(SHAPES), help="the shape (default tiny)")
    r.add_argument("--seed", type=int, default=0, help="seed of the weights")
    r.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="with --quant: where the random values are drawn (cuda: a 35B shape in seconds rather than "
                        "minutes; other values than the CPU's for the same seed)")
    r.set_defaults(func=commands.cmd_init_random)
    return parser
