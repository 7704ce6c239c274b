"""Check Strata's hybrid GGUF targets (qwen35, qwen35moe, qwen3next) against llama.cpp itself: tiny checkpoints that
transformers writes (tests/hybrid_layout.py's shapes, the demo's vocabulary), converted by llama.cpp's own
convert_hf_to_gguf.py (F32; a Qwen3.5 one also with an MTP block) and quantized by llama-quantize (Q8_0, Q4_K_M,
Q3_K_M). Per file:
- F32: the converter's tensors equal tests/hybrid_layout.to_gguf's bit for bit (the layout the CI tests write), and
  Strata's greedy text equals llama-completion's (llama.cpp decodes F32 files exactly), also on the converter's
  files with --fuse-qkv --fuse-gate-up-exps;
- quantized: Strata's greedy tokens equal transformers' on the values the file holds (gguf.quants' dequantization,
  read back into the checkpoint's names by hybrid_layout.from_gguf); llama.cpp is no exact reference there, as its
  CPU path quantizes activations;
- the MTP file: Strata skips the block and decodes as the file without it;
- `strata init-random --quant` files (models/random_gguf.py: a tiny qwen35 and qwen35moe in Q8_0, a qwen35 of
  256-wide rows in Q3_K_M and IQ3_XXS): llama-completion loads and decodes them (its text beside Strata's, for
  information: it quantizes activations).
Prints one line per check and exits 1 on any difference. Never from CI (llama.cpp is built by
../shared/tools/build_llamacpp.sh; its converter needs ../shared/tools/lcpp_convert.py for the demo's vocabulary).

usage: python tools/llamacpp_hybrid_check.py LLAMA_CPP_SOURCE_DIR LLAMA_CPP_BIN_DIR LCPP_CONVERT_PY"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import gguf
import torch
from gguf import quants
from safetensors.torch import load_file, save_file

root = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(root / "src"), str(root / "tests")]

from strata.engine.decode import Engine  # noqa: E402
from strata.models.loader import load_target  # noqa: E402
from strata.pair import tokenizer_of  # noqa: E402

from conftest import add_mtp_block, write_hf_model  # noqa: E402
from hybrid_layout import ARCH, COMMON, SHAPES, from_gguf, to_gguf  # noqa: E402

TEXTS = ["def quicksort(arr):", "import os\nimport sys\n", "class Stack:\n    def push(self, x):",
         "for i in range(10):"]
NEW = 24
failures = []


def check(ok: bool, line: str) -> None:
    print(("ok   " if ok else "FAIL ") + line, flush=True)
    if not ok:
        failures.append(line)


def checkpoint(folder: Path, family: str, mtp: bool = False) -> Path:
    write_hf_model(folder, family, seed=41, vocab=4096, **COMMON, **SHAPES[family])
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(root / "src/strata/demo/target" / name, folder / name)
    if mtp:  # an MTP block as Qwen3.5 checkpoints carry it (its values unread: Strata skips it here)
        add_mtp_block(folder, passthrough=0.0)
    return folder


def convert(src: Path, convert_py: str, folder: Path, out: Path, mtp: bool, *flags: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(src / "gguf-py")}
    args = [sys.executable, convert_py, str(src / "convert_hf_to_gguf.py"), str(folder), "--outtype", "f32",
            "--outfile", str(out), *flags] + ([] if mtp else ["--no-mtp"])
    subprocess.run(args, env=env, check=True, capture_output=True)


def values(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a GGUF file as gguf's reader and dequantizer give it, in float32."""
    out = {}
    for t in gguf.GGUFReader(path).tensors:
        shape = tuple(int(d) for d in reversed(t.shape))
        data = t.data if t.tensor_type == gguf.GGMLQuantizationType.F32 else quants.dequantize(t.data, t.tensor_type)
        out[t.name] = torch.from_numpy(data.reshape(shape).copy()).float()
    return out


def llama_completion(bins: Path, path: Path, text: str) -> str:
    """Its greedy continuation's text (it ends the output with a blank line; a token may end mid-character)."""
    out = subprocess.run([str(bins / "llama-completion"), "-m", str(path), "-no-cnv", "--temp", "0", "-n", str(NEW),
                          "-p", text, "--no-warmup", "-t", "2", "--no-display-prompt", "--simple-io"],
                         capture_output=True, timeout=300, stdin=subprocess.DEVNULL, check=True)
    return out.stdout.decode("utf-8", errors="replace").removesuffix("\n\n")


def strata_text(target, tok, text: str) -> tuple[list[int], str]:
    prompt = tok.encode_prompt(text)
    ids = Engine(target, max_len=256).generate(prompt, NEW).output_ids
    return ids, tok.decode(ids)


def main() -> None:
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    src, bins, convert_py = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    import transformers

    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        for family in ARCH:
            folder = checkpoint(d / family, family)
            f32 = d / f"{family}-F32.gguf"
            convert(src, convert_py, folder, f32, mtp=False)
            cfg = json.loads((folder / "config.json").read_text())
            theirs, ours = values(f32), to_gguf(load_file(folder / "model.safetensors"), cfg, family)
            same = theirs.keys() == ours.keys() and all(torch.equal(theirs[k], ours[k]) for k in ours)
            check(same, f"{family}: llama.cpp's converter writes the tensors tests/hybrid_layout.py writes "
                        f"({len(theirs)} tensors)")
            target, tok = load_target(f32), tokenizer_of(f32)[0]
            fused = d / f"{family}-F32-fused.gguf"
            convert(src, convert_py, folder, fused, False, "--fuse-qkv", "--fuse-gate-up-exps")
            fused_target = load_target(fused)
            for text in TEXTS:
                ids, mine = strata_text(target, tok, text)
                check(llama_completion(bins, f32, text) == mine, f"{family} F32 {text!r}: Strata's text equals "
                                                                  f"llama-completion's ({NEW} tokens)")
                check(strata_text(fused_target, tok, text)[1] == mine == llama_completion(bins, fused, text),
                      f"{family} F32 --fuse-qkv --fuse-gate-up-exps {text!r}: Strata's text as the parts' file and "
                      f"llama-completion's")
            for ftype in ("Q8_0", "Q4_K_M", "Q3_K_M"):
                path = d / f"{family}-{ftype}.gguf"
                subprocess.run([str(bins / "llama-quantize"), str(f32), str(path), ftype], check=True,
                               capture_output=True)
                kinds = sorted({t.tensor_type.name for t in gguf.GGUFReader(path).tensors})
                ref = d / f"{family}-{ftype}-ref"
                ref.mkdir()
                shutil.copy(folder / "config.json", ref / "config.json")
                save_file({k: v.contiguous() for k, v in from_gguf(values(path), cfg, family).items()},
                          str(ref / "model.safetensors"))
                model = transformers.AutoModelForCausalLM.from_pretrained(ref).eval()
                target = load_target(path)
                for text in TEXTS:
                    prompt = tok.encode_prompt(text)
                    want = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, min_new_tokens=NEW,
                                          do_sample=False)[0, len(prompt):].tolist()
                    got = Engine(target, max_len=256).generate(prompt, NEW).output_ids
                    check(got == want, f"{family} {ftype} ({', '.join(kinds)}) {text!r}: Strata's tokens equal "
                                       f"transformers' on the file's values")
        folder = checkpoint(d / "mtp", "qwen3_5", mtp=True)
        with_mtp, without = d / "mtp.gguf", d / "no-mtp.gguf"
        convert(src, convert_py, folder, with_mtp, mtp=True)
        convert(src, convert_py, folder, without, mtp=False)
        nextn = gguf.GGUFReader(with_mtp).fields.get("qwen35.nextn_predict_layers")
        tok = tokenizer_of(with_mtp)[0]
        a, b = load_target(with_mtp), load_target(without)
        for text in TEXTS[:2]:
            check(nextn is not None and strata_text(a, tok, text) == strata_text(b, tok, text),
                  f"qwen3_5 with an MTP block (nextn_predict_layers): decodes as the file without it {text!r}")
        from strata.models.random_gguf import write_random_gguf
        from test_gguf_hybrid import TINY_HYBRID_MOE

        wide = dict(hidden_size=256, intermediate_size=256, head_dim=64, linear_key_head_dim=64,
                    linear_value_head_dim=64)
        for arch, recipe, overrides in (("qwen35", "Q8_0", {}), ("qwen35moe", "Q8_0", TINY_HYBRID_MOE),
                                        ("qwen35", "Q3_K_M", wide), ("qwen35", "IQ3_XXS", wide)):
            path = d / f"random-{arch}-{recipe}.gguf"
            write_random_gguf(path, "tiny-hybrid", recipe, **overrides)
            tok = tokenizer_of(path)[0]
            theirs = llama_completion(bins, path, "hello")
            mine = strata_text(load_target(path), tok, "hello")[1]
            check(len(theirs) > 0, f"init-random {arch} {recipe}: llama-completion loads and decodes it ({theirs!r}; "
                                   f"Strata: {mine!r})")
    print(f"{len(failures)} failed")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
