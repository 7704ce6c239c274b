"""Reading Hugging Face safetensors checkpoints (single file or sharded with an index)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..errors import StrataError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise StrataError(f"--dtype: expected one of {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise StrataError(f"{index}: not a valid safetensors index ({e})") from None
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise StrataError(f"{index}: names shard {f.name}, which does not exist")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(model_dir.glob("*.safetensors"))
    if found:
        return found
    raise StrataError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")


def read_safetensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint folder, in their stored dtype, on the CPU."""
    tensors: dict[str, torch.Tensor] = {}
    for path in safetensors_files(model_dir):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    tensors[name] = f.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise StrataError(f"{path}: cannot read safetensors ({e})") from None
    return tensors


def check_and_convert(
    tensors: dict[str, torch.Tensor], expected: dict[str, tuple], dtype: torch.dtype, source: Path
) -> dict[str, torch.Tensor]:
    """Pick exactly the expected tensors, check their shapes, convert them to dtype."""
    out = {}
    for name, shape in expected.items():
        t = tensors.get(name)
        if t is None:
            raise StrataError(f"{source}: missing tensor '{name}' (expected shape {list(shape)})")
        if tuple(t.shape) != tuple(shape):
            raise StrataError(f"{source}: tensor '{name}' has shape {list(t.shape)}, expected {list(shape)}")
        out[name] = t.to(dtype)
    return out
