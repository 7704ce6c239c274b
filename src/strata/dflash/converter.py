"""`convert-dflash` (reference HF folder -> llama.cpp GGUF) and `export-dflash` (the reverse).

Both write to a temporary name, verify the result byte for byte, and only then rename it into place:
a failure never leaves a partial output behind."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from ..errors import ArtifactError, StrataError
from . import contract as C
from .artifact import Artifact
from .gguf_format import read_gguf, write_gguf
from .hf_format import config_to_hf, read_hf


def to_bf16(t: torch.Tensor) -> torch.Tensor:
    """float32/float16 -> BF16 with round-to-nearest-even (what torch's cast does)."""
    return t.contiguous() if t.dtype == torch.bfloat16 else t.to(torch.float32).to(torch.bfloat16)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.int16), b.view(torch.int16))


def verify_same(expected: dict[str, torch.Tensor], got: Artifact, progress: bool) -> None:
    for name, t in tqdm(expected.items(), desc="verify", unit="tensor", disable=not progress, leave=False):
        g = got.tensors.get(name)
        if g is None or not _same_bytes(t, g):
            raise ArtifactError(f"{got.source}: read-back of tensor '{name}' differs from the source")


def convert_hf_to_gguf(src: str | Path, out: str | Path, progress: bool = True) -> Artifact:
    src, out = Path(src), Path(out)
    if not src.is_dir():
        raise StrataError(f"{src}: not a folder (expected a Hugging Face DFlash drafter)")
    art = read_hf(src)
    bf16 = {name: to_bf16(t) for name, t in tqdm(art.tensors.items(), desc="bf16", unit="tensor",
                                                 disable=not progress, leave=False)}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        write_gguf(tmp, art.cfg, bf16, progress=progress or None)
        back = read_gguf(tmp)
        if back.cfg != art.cfg:
            raise ArtifactError(f"{out}: read-back metadata differs from the source config")
        verify_same(bf16, back, progress)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            tmp.unlink()
    back.source = out
    return back


def export_gguf_to_hf(src: str | Path, out_dir: str | Path, progress: bool = True) -> Artifact:
    src, out_dir = Path(src), Path(out_dir)
    art = read_gguf(src)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise StrataError(f"{out_dir}: exists and is not empty")
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        (tmp / "config.json").write_text(json.dumps(config_to_hf(art.cfg), indent=2) + "\n")
        ordered = {name: art.tensors[name] for name in C.expected_tensors(art.cfg, "hf")}
        save_file(ordered, str(tmp / "model.safetensors"), metadata={"format": "pt"})
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
