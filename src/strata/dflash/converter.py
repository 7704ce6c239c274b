"""`convert-dflash` (reference HF folder -> llama.cpp GGUF) and `export-dflash` (any accepted drafter ->
reference HF folder).

Both check their output path before any work, write to a temporary name, verify the result byte for
byte, and only then rename it into place: a failure never leaves a partial output behind."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from ..errors import ArtifactError, StrataError
from ..files import check_output, replacing, umask_mode
from ..gguf_vocab import for_target
from . import contract as C
from .artifact import Artifact, load_artifact
from .gguf_format import read_gguf, stored, write_gguf
from .hf_format import config_to_hf, read_hf


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def verify_same(expected: dict[str, torch.Tensor], got: Artifact, progress: bool) -> None:
    for name, t in tqdm(expected.items(), desc="verify", unit="tensor", disable=not progress, leave=False):
        g = got.tensors.get(name)
        if g is None or not _same_bytes(t.contiguous(), g.contiguous()):
            raise ArtifactError(f"{got.source}: read-back of tensor '{name}' differs from the source")


def convert_hf_to_gguf(src: str | Path, out: str | Path, target: str | Path | None = None,
                       tokenizer_pre: str | None = None, progress: bool = True, qtype: str = "BF16") -> Artifact:
    """The drafter in llama.cpp's layout, carrying the target's vocabulary: from `target` (a model folder
    with tokenizer.json, or a GGUF file), else from a tokenizer.json in the drafter's own folder. qtype: BF16,
    or Q8_0 (the blocks llama-quantize makes of the BF16 file)."""
    src = Path(src)
    if not src.is_dir():
        raise StrataError(f"{src}: not a folder (expected a Hugging Face DFlash drafter)")
    out = check_output(out, inputs=[src, target])
    vocab_from = Path(target) if target else (src if (src / "tokenizer.json").is_file() else None)
    if vocab_from is None:
        raise StrataError(f"{src}: the drafter folder has no tokenizer.json; give the target model with --target "
                          f"DIR (llama.cpp loads a vocabulary for every model and reads the mask token through it)")
    art = read_hf(src)
    vocab = for_target(vocab_from, art.cfg.vocab_size, tokenizer_pre)
    cfg = art.cfg
    if cfg.vocab_size is not None and len(vocab.tokens) != cfg.vocab_size:
        raise StrataError(f"{vocab_from}: its vocabulary has {len(vocab.tokens)} tokens, the drafter's config says "
                          f"vocab_size {cfg.vocab_size}")
    if cfg.mask_token_id >= len(vocab.tokens):
        raise StrataError(f"{src}: mask_token_id {cfg.mask_token_id} is outside the vocabulary of "
                          f"{len(vocab.tokens)} tokens")
    cfg.vocab_size = len(vocab.tokens)
    expected = {name: stored(t, C.hf_to_gguf_name(name), qtype) for name, t in art.tensors.items()}
    with replacing(out) as tmp:
        write_gguf(tmp, cfg, art.tensors, vocab, name=src.name, progress=progress, qtype=qtype)
        back = read_gguf(tmp)
        if back.cfg != cfg:
            raise ArtifactError(f"{out}: read-back metadata differs from the source config")
        verify_same(expected, back, progress)
        if back.vocab is None or back.vocab.difference(vocab):
            raise ArtifactError(f"{out}: read-back vocabulary differs from {vocab_from}'s")
    back.source = out
    return back


def export_gguf_to_hf(src: str | Path, out_dir: str | Path, progress: bool = True) -> Artifact:
    """Any drafter Strata accepts, as the reference Hugging Face folder: each tensor in the dtype it was
    read in (BF16 and F32 as stored; quantized ones as their float32 dequantization)."""
    src = Path(src)
    out_dir = check_output(out_dir, folder=True, inputs=[src])
    if out_dir.exists() and any(out_dir.iterdir()):
        raise StrataError(f"{out_dir}: exists and is not empty")
    art = load_artifact(src)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        ordered = {name: art.tensors[name].contiguous() for name in C.expected_tensors(art.cfg, "hf")}
        dtypes = {t.dtype for t in ordered.values() if t.dim() == 2}
        dtype = str(dtypes.pop() if len(dtypes) == 1 else torch.float32).removeprefix("torch.")
        (tmp / "config.json").write_text(json.dumps(config_to_hf(art.cfg, dtype), indent=2) + "\n")
        save_file(ordered, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        umask_mode(tmp / "model.safetensors")
        back = read_hf(tmp)
        verify_same(ordered, back, progress)
        if out_dir.exists():
            out_dir.rmdir()
        os.replace(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    back.source = out_dir
    return back
