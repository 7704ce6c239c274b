"""Check Strata's GGUF vocabularies against llama.cpp's own tokenizer: the vocabulary files and texts of
tests/test_gguf_target.py (those Strata writes from tokenizer folders among them), each text tokenized by
llama.cpp's llama-tokenize and by Strata, bare (--no-bos; `Tokenizer.encode`) and as a prompt (the BOS /
EOS llama.cpp adds; `Tokenizer.encode_prompt`), and the end-of-generation tokens llama.cpp lists against
`Tokenizer.end_ids`. Never from CI (llama.cpp is
built by ../shared/tools/build_llamacpp.sh, then `cmake --build BUILD --target llama-tokenize`).

usage: python tools/llamacpp_tokenize_check.py PATH/TO/llama-tokenize"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tempfile
from pathlib import Path

root = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(root / "src"), str(root / "tests")]

from strata.gguf_file import read  # noqa: E402
from strata.tokenizer import Tokenizer  # noqa: E402
from test_gguf_target import (GPT2_VOCABS, PRE_TEXTS, SPM_FOLDERS, SPM_TEXTS, SPM_VOCABS,  # noqa: E402
                              gpt2_vocab_file, spm_folder_vocab_file, spm_vocab_file, wide_tokenizer)


def llama_cpp(binary: str, path: Path, text: str, bos: bool) -> list[int]:
    out = subprocess.run([binary, "-m", str(path), "--ids", "--log-disable", "-p", text] + ["--no-bos"] * (not bos),
                         capture_output=True, text=True, check=True).stdout
    return ast.literal_eval(out.strip().splitlines()[-1])


def llama_cpp_ends(binary: str, path: Path) -> set[int]:
    """The EOG ids of llama.cpp's vocabulary log; its logger writes from a thread that an exiting process
    sometimes cuts off before anything is out, so a run whose log lacks the vocabulary's summary is repeated."""
    for _ in range(10):
        log = subprocess.run([binary, "-m", str(path), "--ids", "-v", "-p", "x"], capture_output=True, text=True,
                             check=True).stderr
        if "print_info: max token length" in log:
            return {int(m) for m in re.findall(r"print_info: EOG token\s+= (\d+)", log)}
    raise RuntimeError(f"{binary}: no vocabulary log for {path} in 10 runs")


def check(binary: str, path: Path, texts: list[str], label: str) -> int:
    ours = Tokenizer.from_gguf(read(path)[0], path)
    bare = [t for t in texts if t and ours.encode(t) != llama_cpp(binary, path, t, bos=False)]
    prompt = [t for t in texts if t and ours.encode_prompt(t) != llama_cpp(binary, path, t, bos=True)]
    theirs = llama_cpp_ends(binary, path)
    n = sum(1 for t in texts if t)
    print(f"{label}: {n - len(bare)}/{n} texts alike, {n - len(prompt)}/{n} prompts alike, end-of-generation "
          f"{'alike' if ours.end_ids == theirs else f'differs: ours {sorted(ours.end_ids)}, theirs {sorted(theirs)}'}"
          + (f"; differ: {bare + prompt}" if bare or prompt else ""))
    return len(bare) + len(prompt) + (ours.end_ids != theirs)


def main() -> int:
    binary = sys.argv[1]
    failures = 0
    with tempfile.TemporaryDirectory() as d:
        for n, (space_prefix, user, add_bos) in enumerate(SPM_VOCABS):
            path = Path(d) / f"spm{n}.gguf"
            spm_vocab_file(path, space_prefix, user, add_bos)
            failures += check(binary, path, SPM_TEXTS, f"llama add_space_prefix={space_prefix} user={list(user)} "
                                                       f"add_bos={add_bos}")
        for spaces, user in SPM_FOLDERS:
            path = Path(d) / f"spm-{spaces}.gguf"
            spm_folder_vocab_file(path, Path(d) / f"spm-{spaces}", spaces, user)
            failures += check(binary, path, SPM_TEXTS, f"llama from a tokenizer.json ({spaces} spaces, "
                                                       f"user={list(user)})")
        folder = Path(d) / "qwen"
        folder.mkdir()
        wide_tokenizer(folder)
        for name, (pre, extra, keys, _, _) in GPT2_VOCABS.items():
            path = Path(d) / f"{name}.gguf"
            gpt2_vocab_file(path, folder, pre, extra, keys)
            failures += check(binary, path, PRE_TEXTS, f"gpt2 {name}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
