"""Check Strata's llama vocabulary from a SentencePiece-style tokenizer.json against llama.cpp's own converter
on a real SentencePiece model: sentencepiece trains a small BPE model (byte fallback, a user-defined symbol);
transformers' extractor gives its tokenizer.json vocabulary and merges, laid out as Llama 2's converter lays
them out; a tiny LlamaForCausalLM beside them. Strata writes the vocabulary from tokenizer.json alone
(gguf_vocab.from_tokenizer_folder), llama.cpp's convert_hf_to_gguf.py from tokenizer.model; then both files'
tokens and types are compared and llama.cpp's llama-tokenize encodes test texts with each, as does Strata.
Never from CI (needs sentencepiece and protobuf, and llama.cpp: ../shared/tools/build_llamacpp.sh).

usage: python tools/spm_llamacpp_check.py LLAMA_CPP_SOURCE_DIR PATH/TO/llama-tokenize"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

root = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(root / "src"), str(root / "tests")]

from strata.gguf_file import read  # noqa: E402
from strata.gguf_vocab import from_tokenizer_folder  # noqa: E402
from strata.tokenizer import Tokenizer  # noqa: E402
from test_gguf_target import SPM_TEXTS, vocab_only_file  # noqa: E402

from llamacpp_tokenize_check import llama_cpp  # noqa: E402  (this script's folder)


def make_folder(d: Path) -> Path:
    import gguf  # noqa: F401 - fail early, before training, where the environment lacks it
    import sentencepiece as spm
    import torch
    from tokenizers import AddedToken, decoders, models, normalizers
    from tokenizers import Tokenizer as HFTokenizer
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.convert_slow_tokenizer import SentencePieceExtractor

    corpus = d / "corpus.txt"
    corpus.write_text("\n".join(SPM_TEXTS * 40 + [(root / "README.md").read_text()[:20000]]), encoding="utf-8")
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(d / "sp"), vocab_size=600, model_type="bpe",
                                   byte_fallback=True, character_coverage=1.0, user_defined_symbols=["<tool>"],
                                   unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
    folder = d / "model"
    folder.mkdir()
    extracted = SentencePieceExtractor(str(d / "sp.model")).extract(None)
    hf = HFTokenizer(models.BPE(extracted["vocab"], extracted["merges"], unk_token="<unk>", fuse_unk=True,
                                byte_fallback=True))
    hf.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    hf.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    hf.add_tokens([t for t in extracted["additional_special_tokens"] if not t.special])
    hf.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True, "add_eos_token": False,
        "tokenizer_class": "LlamaTokenizer", "legacy": True}))
    (folder / "tokenizer.model").write_bytes((d / "sp.model").read_bytes())
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(extracted["vocab"]), hidden_size=64, intermediate_size=128,
                                 num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                 bos_token_id=1, eos_token_id=2)).save_pretrained(folder)
    return folder


def fields(path: Path) -> tuple[list[str], list[int]]:
    import gguf

    f = gguf.GGUFReader(str(path)).fields
    return ([bytes(f["tokenizer.ggml.tokens"].parts[i]).decode() for i in f["tokenizer.ggml.tokens"].data],
            [int(f["tokenizer.ggml.token_type"].parts[i][0]) for i in f["tokenizer.ggml.token_type"].data])


def main() -> int:
    source, binary = Path(sys.argv[1]), sys.argv[2]
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        folder = make_folder(d)
        ours, theirs = d / "strata.gguf", d / "llama-cpp.gguf"
        vocab_only_file(ours, from_tokenizer_folder(folder), "llama")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(source / "gguf-py"), os.environ.get("PYTHONPATH", "")])}
        subprocess.run([sys.executable, str(source / "convert_hf_to_gguf.py"), str(folder), "--outtype", "f32",
                        "--outfile", str(theirs)], check=True, capture_output=True, env=env)
        (t1, y1), (t2, y2) = fields(ours), fields(theirs)
        types = [(i, t1[i], a, b) for i, (a, b) in enumerate(zip(y1, y2)) if a != b]
        print(f"tokens {'alike' if t1 == t2 else 'differ'} ({len(t1)} / {len(t2)}); types differ at {types or 'none'}")
        strata = Tokenizer.from_gguf(read(ours)[0], ours)
        readme = [line for line in (root / "README.md").read_text().splitlines()[:400] if line.strip()][::7]
        texts = [t for t in SPM_TEXTS + readme + ["<tool> call <s> x", " <tool>y"] if t]
        differ = [t for t in texts if llama_cpp(binary, ours, t, True) != llama_cpp(binary, theirs, t, True)
                  or strata.encode_prompt(t) != llama_cpp(binary, theirs, t, True)]
        print(f"{len(texts) - len(differ)}/{len(texts)} prompts alike (llama.cpp on both files, and Strata); "
              f"differ: {differ}")
        return 1 if t1 != t2 else 0


if __name__ == "__main__":
    sys.exit(main())
