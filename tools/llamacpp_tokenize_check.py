"""Check Strata's SentencePiece (llama-model) vocabularies against llama.cpp's own tokenizer: the vocabulary
files and texts of tests/test_gguf_target.py's SentencePiece test, each text tokenized by llama.cpp's
llama-tokenize (--no-bos, special tokens parsed, as Strata encodes prompts) and by Strata. Never from CI
(llama.cpp is built by ../shared/tools/build_llamacpp.sh, then `cmake --build BUILD --target llama-tokenize`).

usage: python tools/llamacpp_tokenize_check.py PATH/TO/llama-tokenize"""

from __future__ import annotations

import ast
import subprocess
import sys
import tempfile
from pathlib import Path

root = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(root / "src"), str(root / "tests")]

from strata.gguf_file import read  # noqa: E402
from strata.tokenizer import Tokenizer  # noqa: E402
from test_gguf_target import SPM_TEXTS, spm_vocab_file  # noqa: E402


def llama_cpp(binary: str, path: Path, text: str) -> list[int]:
    if not text:
        return []
    out = subprocess.run([binary, "-m", str(path), "--ids", "--no-bos", "--log-disable", "-p", text],
                         capture_output=True, text=True, check=True).stdout
    return ast.literal_eval(out.strip().splitlines()[-1])


def main() -> int:
    binary = sys.argv[1]
    failures = 0
    with tempfile.TemporaryDirectory() as d:
        for n, (space_prefix, user) in enumerate([(None, ()), (False, ()), (None, ("<tool>", "ZZ"))]):
            path = Path(d) / f"spm{n}.gguf"
            spm_vocab_file(path, space_prefix, user)
            ours = Tokenizer.from_gguf(read(path)[0], path)
            differ = [t for t in SPM_TEXTS if ours.encode(t) != llama_cpp(binary, path, t)]
            failures += len(differ)
            print(f"add_space_prefix={space_prefix} user={list(user)}: {len(SPM_TEXTS) - len(differ)}/{len(SPM_TEXTS)} "
                  f"texts tokenized alike" + (f"; differ: {differ}" if differ else ""))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
