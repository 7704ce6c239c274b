"""Make Strata's embedded demo pair: a small Qwen3-architecture code model trained from scratch on the
Python standard library's own source, and a DFlash drafter trained for it with `train-drafter`'s code.

Deterministic given --seed and the Python version whose stdlib is read (recorded in demo_meta.json).
A named set of modules is kept out of training for evaluation (HELD_OUT). Every DISTILL_EVERY-th of the
other files is kept out of the target's training too: the drafter's self-distillation prompts come from
them, so it learns how the target continues code it has never seen (the evaluation's regime) rather
than how it replays text it memorised. The target's own training files join that pool with every name
they define renamed (`rename_identifiers`): eight times the code, none of it verbatim what the target saw.

    python tools/make_demo.py OUT_DIR [--device cuda] [--target DIR] [--target-steps N] [--drafter-steps N] [--quick]

--target reuses a trained demo target (the shipped drafter was made on the shipped target this way).

OUT_DIR receives target/ (Hugging Face folder with tokenizer), drafter/ (reference HF format) and
demo_meta.json. `strata convert-dflash OUT_DIR/drafter src/strata/demo/drafter.gguf` makes the artifact
that ships."""

from __future__ import annotations

import argparse
import ast
import builtins
import io
import json
import keyword
import math
import random
import re
import shutil
import sys
import sysconfig
import time
import tokenize
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from strata.dflash.train import DrafterTrainer, TrainConfig, lr_at, self_distill  # noqa: E402
from strata.layers.modules import init_weights_  # noqa: E402
from strata.models.loader import load_model_config, unpack  # noqa: E402
from strata.models.random_init import qwen3_config  # noqa: E402

# Modules kept out of training: the evaluation set (stdlib-relative paths of files).
HELD_OUT = ["json/", "csv.py", "textwrap.py", "heapq.py", "bisect.py", "fractions.py", "statistics.py",
            "shlex.py", "difflib.py", "pprint.py", "calendar.py", "colorsys.py", "graphlib.py", "string.py"]
SKIP_DIRS = ("idlelib/", "lib2to3/", "tkinter/", "turtledemo/", "site-packages/", "ensurepip/",
             "__pycache__/", "config-", "pydoc_data/", "encodings/")
DISTILL_EVERY = 8
EOS = "<|endoftext|>"

TARGET_SHAPE = dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=6,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
                    tie_word_embeddings=True, rope_theta=10000.0, eos_token_id=0, bos_token_id=None,
                    torch_dtype="bfloat16")


def stdlib_files(root: Path | None = None) -> tuple[list[Path], list[Path], list[Path]]:
    """(target training files, held-out files, self-distillation files). The held-out modules' own tests
    are kept out of everything too."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    their_tests = ["test/test_" + h.removesuffix(".py").removesuffix("/") for h in HELD_OUT]
    train, held = [], []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if any(part in rel for part in SKIP_DIRS) or any(rel.startswith(t) for t in their_tests):
            continue
        if any(rel == h or rel.startswith(h) for h in HELD_OUT):
            held.append(path)
        else:
            train.append(path)
    distill = train[DISTILL_EVERY - 1::DISTILL_EVERY]
    return [p for i, p in enumerate(train) if (i + 1) % DISTILL_EVERY], held, distill


def eval_prompts(paths, count=24, context_chars=300) -> list[str]:
    """Prompts cut from the held-out modules: some code, then a `def` line to complete."""
    found = []
    for path in paths:
        text = path.read_text(encoding="utf-8", errors="replace")
        starts = [i for i in range(len(text)) if text.startswith("\ndef ", i) or text.startswith("\n    def ", i)]
        for i in starts[1::max(1, len(starts) // 3)][:3]:
            end = text.index("\n", i + 1)
            found.append(text[max(0, i - context_chars): end + 1])
    step = max(1, len(found) // count)
    return found[::step][:count]


def def_prompts(tok, texts, length: int) -> list[list[int]]:
    """The demo's use: code, then a `def` line to complete. Every def line of the texts, with the
    `length` tokens that end with it."""
    out = []
    for text in texts:
        for m in re.finditer(r"\n(?:    )?def [^\n]*\n", text):
            ids = tok.encode(text[max(0, m.start() - 16 * length): m.end()], add_special_tokens=False).ids
            if len(ids) >= length:
                out.append(ids[-length:])
    return out


KEEP_NAMES = set(keyword.kwlist) | set(keyword.softkwlist) | set(dir(builtins)) | {"self", "cls"}


def defined_names(text: str) -> set[str]:
    """Names the file itself binds (functions, classes, arguments, assignment targets, stored attributes):
    the ones a rename keeps consistent, while the library API the file uses stays as it is."""
    out = set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SyntaxWarning)
        tree = ast.parse(text)
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(n.name)
        elif isinstance(n, ast.arg):
            out.add(n.arg)
        elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            out.add(n.id)
        elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
            out.add(n.attr)
    return {x for x in out if x not in KEEP_NAMES and not x.startswith("__")}


def rename_identifiers(text: str, own: set[str], pool: list[str], rng: random.Random) -> str | None:
    """The file with each name it defines (`own`) replaced, consistently, by another name from the corpus:
    code the target has not memorised, in the style it knows. None when the file does not tokenize."""
    try:
        toks = [t for t in tokenize.generate_tokens(io.StringIO(text).readline) if t.type == tokenize.NAME]
    except (SyntaxError, ValueError, tokenize.TokenError):
        return None
    names = sorted(own)
    mapping = dict(zip(names, rng.sample(pool, len(names)))) if len(names) <= len(pool) else {}
    line_start = [0]
    for line in text.splitlines(keepends=True):
        line_start.append(line_start[-1] + len(line))
    out, last = [], 0
    for t in toks:
        if t.string in mapping:
            a, b = line_start[t.start[0] - 1] + t.start[1], line_start[t.end[0] - 1] + t.end[1]
            out += [text[last:a], mapping[t.string]]
            last = b
    out.append(text[last:])
    return "".join(out)


def renamed_copies(texts: list[str], seed: int) -> list[str]:
    """One renamed copy of every file that parses; the new names are drawn from the names the corpus defines
    at least twice."""
    parsed, counts = [], {}
    for text in texts:
        try:
            own = defined_names(text)
        except (SyntaxError, ValueError):
            continue
        parsed.append((text, own))
        for name in own:
            counts[name] = counts.get(name, 0) + 1
    pool = sorted(n for n, k in counts.items() if k >= 2 and n.isascii())
    rng = random.Random(seed)
    return [r for r in (rename_identifiers(t, own, pool, rng) for t, own in parsed) if r is not None]


def read(paths):
    return [p.read_text(encoding="utf-8", errors="replace") for p in paths]


def train_tokenizer(texts, vocab_size):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok


def encode_all(tok, texts) -> torch.Tensor:
    eos = tok.token_to_id(EOS)
    ids = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def batches(ids: torch.Tensor, seq_len: int, batch: int, gen: torch.Generator):
    starts = torch.randint(0, len(ids) - seq_len - 1, (batch,), generator=gen)
    return torch.stack([ids[s:s + seq_len + 1] for s in starts.tolist()])


@torch.no_grad()
def eval_loss(model, ids, seq_len, device, n=32):
    gen = torch.Generator().manual_seed(999)
    chunk = batches(ids, seq_len, n, gen).to(device)
    with autocast(device):
        logits = model.forward_batch(chunk[:, :-1]).logits
    return float(F.cross_entropy(logits.float().flatten(0, 1), chunk[:, 1:].flatten()))


def autocast(device):
    return torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda" else torch.autocast("cpu", enabled=False)


def train_target(out: Path, train_ids, held_ids, args, shape) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(qwen3_config(**shape), indent=2))
    fam, cfg = load_model_config(out)
    torch.manual_seed(args.seed)
    model = init_weights_(fam.build(cfg)).tie_weights_()
    model = model.to(args.device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.target_lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(args.seed)
    log, t0 = [], time.time()
    best, best_state = float("inf"), None
    for step in range(args.target_steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.target_steps, args.target_lr, 0.04)
        chunk = batches(train_ids, args.seq_len, args.target_batch, gen).to(args.device)
        with autocast(args.device):
            logits = model.forward_batch(chunk[:, :-1]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), chunk[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if (step + 1) % max(1, args.target_steps // 20) == 0 or step + 1 == args.target_steps:
            model.eval()
            held = eval_loss(model, held_ids, args.seq_len, args.device)
            entry = {"step": step + 1, "train_loss": float(loss.detach()), "held_out_loss": held,
                     "seconds": round(time.time() - t0, 1)}
            if held < best:  # keep the checkpoint that generalises best: the small corpus invites overfitting
                best, best_state = held, {k: v.detach().clone() for k, v in model.state_dict().items()}
                entry["best"] = True
            model.train()
            log.append(entry)
            print("target", entry, flush=True)
    from safetensors.torch import save_file

    state = {k: v.to("cpu", torch.bfloat16).contiguous() for k, v in unpack(best_state, fam.hf_layout(cfg)).items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return {"log": log, "held_out_loss": best, "held_out_ppl": math.exp(best)}


def quick_gate(out: Path, prompts: list[str], device: str) -> dict:
    """`strata gate`'s measurement (float32, greedy, W = 8, 64 new tokens) straight after training."""
    from tokenizers import Tokenizer

    from strata.dflash.drafter import load_drafter
    from strata.checks.gate import gate, gate_report
    from strata.engine.config import EngineConfig
    from strata.models.loader import load_target

    target = load_target(out / "target", device=device, dtype=torch.float32)
    drafter = load_drafter(out / "drafter", target, max_len=1024)
    tok = Tokenizer.from_file(str(out / "target" / "tokenizer.json"))
    ids = [tok.encode(p, add_special_tokens=False).ids for p in prompts]
    report = gate_report(list(gate(target, drafter, ids, [8], 64, config=EngineConfig(max_len=1024))), len(ids), 64)
    return {"tau": report["windows"]["8"]["tau"], "identical": len(ids) - report["failures"], "prompts": len(ids)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target-steps", type=int, default=1500)
    ap.add_argument("--target-batch", type=int, default=64)
    ap.add_argument("--target-lr", type=float, default=2e-3)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--drafter-steps", type=int, default=7000)
    ap.add_argument("--drafter-layers", type=int, default=7)
    ap.add_argument("--drafter-batch", type=int, default=64)
    ap.add_argument("--drafter-lr", type=float, default=6e-4)
    ap.add_argument("--num-sequences", type=int, default=73728)
    ap.add_argument("--variant", default="dflash", choices=["dflash", "dflash2", "dspark"], help="the drafter's kind")
    ap.add_argument("--distill-cache", metavar="FILE", help="the self-distilled sequences: read if there, else saved")
    ap.add_argument("--drafter-init", metavar="DRAFTER",
                    help="start the drafter from this one's weights (its shape wins over --drafter-layers)")
    ap.add_argument("--renamed", action=argparse.BooleanOptionalAction, default=True,
                    help="also distil on the target's training files with the names they define renamed")
    ap.add_argument("--target", dest="reuse_target", metavar="DIR",
                    help="reuse this demo target (and its tokenizer) instead of training one")
    ap.add_argument("--stdlib", help="the standard library folder to read (default: this Python's)")
    ap.add_argument("--quick", action="store_true", help="a tiny run to check the script on a CPU")
    args = ap.parse_args()
    shape = dict(TARGET_SHAPE)
    if args.quick:
        shape.update(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3, head_dim=16)
        args.target_steps, args.drafter_steps, args.seq_len, args.num_sequences = 20, 20, 64, 64
        args.target_batch = args.drafter_batch = 4
    out = Path(args.out)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    train_files, held_files, distill_files = stdlib_files(args.stdlib)
    if args.quick:
        train_files, held_files, distill_files = train_files[:40], held_files[:4], distill_files[:6]
    train_texts, held_texts = read(train_files), read(held_files)
    t0 = time.time()
    if args.reuse_target:
        from tokenizers import Tokenizer

        shutil.copytree(args.reuse_target, out / "target", dirs_exist_ok=True)
        tok = Tokenizer.from_file(str(out / "target" / "tokenizer.json"))
    else:
        tok = train_tokenizer(train_texts, shape["vocab_size"])
        (out / "target").mkdir(parents=True, exist_ok=True)
        tok.save(str(out / "target" / "tokenizer.json"))
        (out / "target" / "tokenizer_config.json").write_text(
            json.dumps({"eos_token": EOS, "model_max_length": 2048}, indent=2))
        (out / "target" / "generation_config.json").write_text(json.dumps({"eos_token_id": tok.token_to_id(EOS)}))
    shape["eos_token_id"] = tok.token_to_id(EOS)
    train_ids, held_ids = encode_all(tok, train_texts), encode_all(tok, held_texts)
    distill_texts = read(distill_files)
    if args.renamed:
        distill_texts += renamed_copies(train_texts, args.seed)
    distill_ids = encode_all(tok, distill_texts)
    print(f"tokenizer: {time.time() - t0:.1f}s, train tokens {len(train_ids):,}, held-out tokens {len(held_ids):,}, "
          f"distillation tokens {len(distill_ids):,}", flush=True)
    if args.reuse_target:
        from strata.models.loader import load_target

        reused = load_target(out / "target", device=args.device, dtype=torch.float32)
        target_info = {"reused": str(args.reuse_target),
                       "held_out_loss": eval_loss(reused, held_ids, args.seq_len, args.device)}
        target_info["held_out_ppl"] = math.exp(target_info["held_out_loss"])
        del reused
    else:
        target_info = train_target(out / "target", train_ids, held_ids, args, shape)

    from strata.models.loader import load_target

    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    target = load_target(out / "target", device=args.device, dtype=dtype)
    layers = target.cfg.num_layers
    taps = sorted({1, layers // 2, layers - 2}) if layers >= 4 else [0, layers - 1]
    tc = TrainConfig(layers=args.drafter_layers, block_size=8, taps=taps, steps=args.drafter_steps,
                     batch_size=args.drafter_batch, lr=args.drafter_lr, prompt_len=96, gen_len=160,
                     num_sequences=args.num_sequences,
                     seed=args.seed, eval_every=max(1, args.drafter_steps // 10), save_every=10 ** 9,
                     variant=args.variant, init_from=args.drafter_init)
    corpus = distill_ids.tolist()
    t1 = time.time()
    starts = def_prompts(tok, distill_texts, tc.prompt_len)
    random.Random(args.seed).shuffle(starts)
    if args.distill_cache and Path(args.distill_cache).is_file():
        seqs = torch.load(args.distill_cache, weights_only=True)
    else:
        seqs = self_distill(target, corpus, tc, args.device, progress=False,
                            prompts=starts[: tc.num_sequences // 2]).cpu()
        if args.distill_cache:
            torch.save(seqs, args.distill_cache)
    print(f"self-distillation: {len(seqs)} sequences ({min(len(starts), tc.num_sequences // 2)} from def lines) in "
          f"{time.time() - t1:.1f}s", flush=True)
    trainer = DrafterTrainer(target, tc, out / "drafter", args.device)
    trainer.set_data(seqs)
    history = trainer.fit(progress=False)
    for h in history:
        print("drafter", h, flush=True)
    (out / "drafter" / "checkpoint.pt").unlink(missing_ok=True)
    (out / "drafter" / "distill.pt").unlink(missing_ok=True)
    prompts = eval_prompts(held_files)
    gate_tau = quick_gate(out, prompts, args.device)
    print(f"gate on the held-out prompts (float32, W=8, 64 tokens): {gate_tau}", flush=True)
    meta = {"python": sys.version.split()[0], "stdlib": args.stdlib or "this Python's", "torch": torch.__version__,
            "seed": args.seed, "held_out_modules": HELD_OUT, "train_files": len(train_files),
            "held_out_files": len(held_files), "distill_files": len(distill_files), "distill_every": DISTILL_EVERY,
            "train_tokens": len(train_ids), "held_out_tokens": len(held_ids), "distill_tokens": len(distill_ids),
            "gate": gate_tau, "target_shape": shape,
            "target": target_info, "drafter_taps": taps, "drafter_layers": args.drafter_layers,
            "drafter_log": history, "args": vars(args), "seconds": round(time.time() - t0, 1)}
    (out / "eval_prompts.json").write_text(json.dumps(prompts, indent=1))
    (out / "demo_meta.json").write_text(json.dumps(meta, indent=2))
    print(f"done in {time.time() - t0:.1f}s", flush=True)


if __name__ == "__main__":
    main()
