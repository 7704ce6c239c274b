"""The llama.cpp GGUF layout of a DFlash drafter (general.architecture "dflash"), written and read by
the contract's key and tensor tables."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from .. import gguf_file
from ..errors import ArtifactError
from . import contract as C
from .hf_format import f32

#: values whose GGUF form differs from the config's: (to GGUF, from GGUF)
_CONVERT = {
    "target_layer_ids": (lambda ids: [t + 1 for t in ids], lambda ids: [t - 1 for t in ids]),
    "layer_types": (lambda types: [t == "sliding_attention" for t in types],
                    lambda pattern: ["sliding_attention" if p else "full_attention" for p in pattern]),
}


def metadata(cfg: C.DFlashConfig) -> list[tuple[str, str, object]]:
    """(key, type, value) in writing order; type is a GGUFWriter add_* suffix. Optional keys appear only
    when set; booleans only when true."""
    out = []
    for key in C.KEYS:
        value = getattr(cfg, key.field)
        if key.optional and (value is None or value is False):
            continue
        if key.field == "sliding_window" and cfg.layer_types is None:
            continue
        out.append((key.gguf, key.kind, _CONVERT[key.field][0](value) if key.field in _CONVERT else value))
    return out


def write_gguf(path: Path, cfg: C.DFlashConfig, tensors: dict[str, torch.Tensor], progress=None) -> None:
    """tensors: Hugging Face names, BF16. Written under llama.cpp names in contract order."""
    import gguf

    writer = gguf.GGUFWriter(str(path), C.ARCH)
    writer.add_name("DFlash drafter")
    arrays = {"int32_array": gguf.GGUFValueType.INT32, "bool_array": gguf.GGUFValueType.BOOL}
    for key, kind, value in metadata(cfg):
        if kind in arrays:
            writer.add_key_value(key, list(value), gguf.GGUFValueType.ARRAY, sub_type=arrays[kind])
        else:
            getattr(writer, f"add_{kind}")(key, value)
    for name in C.expected_tensors(cfg, "hf"):
        t = tensors[name]
        if t.dtype != torch.bfloat16:
            raise ValueError(f"{name}: write_gguf takes BF16 tensors")
        arr = t.contiguous().view(torch.int16).numpy().view(np.uint16)
        writer.add_tensor(C.hf_to_gguf_name(name), arr, raw_shape=arr.shape, raw_dtype=gguf.GGMLQuantizationType.BF16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=bool(progress))
    writer.close()


def _meta(kv: dict, key: C.Key, where: str):
    """A key's value checked against its type; None when an optional key is absent."""
    v = kv.get(key.gguf)
    if v is None and key.optional:
        return None
    if v is None and key.kind != "int32_array":
        raise ArtifactError(f"{where}: missing metadata key '{key.gguf}'")
    if key.kind == "uint32" and (isinstance(v, bool) or not isinstance(v, int)):
        raise ArtifactError(f"{where}: metadata key '{key.gguf}' must be an integer, got {v!r}")
    if key.kind == "float32":
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(v):
            raise ArtifactError(f"{where}: metadata key '{key.gguf}' must be a finite number, got {v!r}")
        return f32(v)
    if key.kind == "int32_array" and (not isinstance(v, list) or not v or
                                      any(isinstance(x, bool) or not isinstance(x, int) for x in v)):
        raise ArtifactError(f"{where}: metadata key '{key.gguf}' must be a non-empty integer array, got {v!r}")
    if key.kind == "bool_array" and not isinstance(v, list):
        raise ArtifactError(f"{where}: metadata key '{key.gguf}' must be an array")
    if key.kind == "bool":
        return bool(v)
    return v


def config_from_gguf(kv: dict, where: str, fc_in: int | None) -> C.DFlashConfig:
    arch = kv.get("general.architecture")
    if arch != C.ARCH:
        raise ArtifactError(f"{where}: general.architecture is {arch!r}, expected '{C.ARCH}'")
    values = {}
    for key in C.KEYS:
        v = _meta(kv, key, where)
        if key.gguf == C.K_VALUE_LEN:
            if v is not None and v != kv.get(C.K_KEY_LEN):
                raise ArtifactError(f"{where}: value_length {v} differs from key_length {kv.get(C.K_KEY_LEN)}")
            continue
        if key.gguf == C.K_TARGET_LAYERS and any(t < 1 for t in v):
            raise ArtifactError(f"{where}: '{C.K_TARGET_LAYERS}' holds layer boundaries (HF id + 1), so every "
                                f"entry must be >= 1, got {v}")
        if v is not None and key.field in _CONVERT:
            v = _CONVERT[key.field][1](v)
        if v is not None or not key.optional:
            values[key.field] = v
    n = len(values["target_layer_ids"])
    if not fc_in or fc_in % n:
        raise ArtifactError(f"{where}: tensor 'fc.weight' input size {fc_in} is not a multiple of the "
                            f"{n} target layers")
    cfg = C.DFlashConfig(target_hidden_size=fc_in // n, **values)
    cfg.validate(where)
    return cfg


def read_gguf(path: Path):
    import gguf

    from .artifact import Artifact

    where = str(path)
    kv, infos = gguf_file.read(path)
    names = [i.name for i in infos]
    C.refuse_variants(names, where)
    hf_names = {C.gguf_to_hf_name(n): n for n in names}
    by_name = {i.name: i for i in infos}
    fc = by_name.get(hf_names.get("fc.weight", ""))
    cfg = config_from_gguf(kv, where, fc.shape[0] if fc is not None and len(fc.shape) == 2 else None)
    expected = C.expected_tensors(cfg, "hf")
    C.check_tensor_set(hf_names, expected, where)
    tensors = {}
    for hf_name, shape in expected.items():
        info = by_name[hf_names[hf_name]]
        if info.type != gguf.GGMLQuantizationType.BF16:
            type_name = getattr(info.type, "name", str(info.type))
            raise ArtifactError(f"{where}: tensor '{info.name}' has type {type_name}, expected BF16")
        if tuple(reversed(info.shape)) != shape:
            raise ArtifactError(f"{where}: tensor '{info.name}' has shape {list(reversed(info.shape))} (GGML "
                                f"{info.shape}), expected {list(shape)}")
        raw = np.ascontiguousarray(info.data).view(np.uint16)
        if raw.size != int(np.prod(shape)):
            raise ArtifactError(f"{where}: tensor '{info.name}' data is truncated")
        tensors[hf_name] = torch.from_numpy(raw.reshape(shape).copy()).view(torch.bfloat16)
    return Artifact(cfg, tensors, path, "gguf")
