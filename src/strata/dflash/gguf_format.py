"""The llama.cpp GGUF layout of a DFlash drafter (general.architecture "dflash"), as llama.cpp's own
converter writes it: the contract's metadata keys, the target's vocabulary (llama.cpp loads one for
every model), general.* keys, 1-D tensors in F32 and 2-D in BF16. Reading also takes what llama.cpp's
tools make of such a file: F16/F32 tensors and quantized ones (Q8_0, Q4_K, ...), dequantized here
exactly as gguf's reference does."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from .. import gguf_file
from ..errors import ArtifactError, StrataError
from ..gguf_vocab import Vocab
from . import contract as C
from .contract import Artifact, f32

#: values whose GGUF form differs from the config's: (to GGUF, from GGUF)
_CONVERT = {
    "target_layer_ids": (lambda ids: [t + 1 for t in ids], lambda ids: [t - 1 for t in ids]),
    "layer_types": (lambda types: [t == "sliding_attention" for t in types],
                    lambda pattern: ["sliding_attention" if p else "full_attention" for p in pattern]),
}
FILE_TYPE_BF16 = 32  # llama_ftype MOSTLY_BF16: most tensors BF16, norms F32
QUANTIZATION_VERSION = 2


def metadata(cfg: C.DFlashConfig) -> list[tuple[str, str, object]]:
    """(key, type, value) in writing order; type is a GGUFWriter add_* suffix. Optional keys appear only
    when set; booleans only when true."""
    out = []
    for key in C.KEYS:
        value = getattr(cfg, key.field)
        if key.optional and (value is None or (value is False and key.field not in C.WRITTEN_WHEN_FALSE)):
            continue
        if key.field == "sliding_window" and cfg.layer_types is None:
            continue
        out.append((key.gguf, key.kind, _CONVERT[key.field][0](value) if key.field in _CONVERT else value))
    return out


def kept_in_f32(t: torch.Tensor, name: str) -> bool:
    """Whether llama.cpp's converter stores this tensor (under its GGUF name) in F32: 1-D ones (llama.cpp's CPU
    ops take no BF16 norm) and those whose name does not end in `.weight` (DFlash2's base kernels)."""
    return t.dim() == 1 or not name.endswith(".weight")


#: the types a drafter may be written in (Q8_0: llama-quantize's Q8_0 of the BF16 file, byte for byte) and their
#: llama_ftype (MOSTLY_BF16, MOSTLY_Q8_0)
FILE_TYPES = {"BF16": FILE_TYPE_BF16, "Q8_0": 7}


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.bfloat16 else t.to(torch.float32).to(torch.bfloat16)


def _requantized(t: torch.Tensor, name: str, qtype: str) -> bool:
    """Whether llama-quantize retypes a tensor llama.cpp's converter leaves in BF16: one of several rows (a single
    row, DSpark's conf_proj, stays BF16)."""
    return qtype != "BF16" and not kept_in_f32(t, name) and t.numel() > t.shape[-1]


def _in_blocks(t: torch.Tensor, name: str, qtype: str) -> bool:
    """Whether a tensor is written in qtype's blocks: one llama-quantize retypes whose rows fill whole blocks
    (Q8_0's hold 32 values)."""
    return _requantized(t, name, qtype) and t.shape[-1] % 32 == 0


def storage(t: torch.Tensor, name: str, qtype: str = "BF16") -> tuple[np.ndarray, object]:
    """A tensor as llama.cpp's converter stores it under its GGUF name: F32 (kept_in_f32), else BF16 (rounded to
    nearest even), or with qtype Q8_0 those BF16 values in Q8_0 blocks, or F16 where a row fills no block (as
    llama-quantize makes them from the BF16 file). Returns (array, GGML type)."""
    import gguf
    from gguf import quants

    if kept_in_f32(t, name):
        return t.to(torch.float32).contiguous().numpy(), gguf.GGMLQuantizationType.F32
    bf16 = _bf16(t).contiguous()
    if _in_blocks(t, name, qtype):
        kind = gguf.GGMLQuantizationType[qtype]
        return quants.quantize(bf16.float().numpy(), kind), kind
    if _requantized(t, name, qtype):  # rows that fill no block: F16, llama-quantize's fallback
        return bf16.float().numpy().astype(np.float16), gguf.GGMLQuantizationType.F16
    return bf16.view(torch.int16).numpy().view(np.uint16), gguf.GGMLQuantizationType.BF16


def stored(t: torch.Tensor, name: str, qtype: str = "BF16") -> torch.Tensor:
    """What storage() keeps of a tensor, as a tensor: the read-back a converter must find (blocks as their
    float32 dequantization, as the reader gives them)."""
    from gguf import quants

    if kept_in_f32(t, name):
        return t.to(torch.float32)
    if _in_blocks(t, name, qtype):
        arr, kind = storage(t, name, qtype)
        return torch.from_numpy(quants.dequantize(arr, kind).astype(np.float32)).reshape(t.shape)
    return _bf16(t).half() if _requantized(t, name, qtype) else _bf16(t)


def write_gguf(path: Path, cfg: C.DFlashConfig, tensors: dict[str, torch.Tensor], vocab: Vocab, name: str,
               progress: bool = False, qtype: str = "BF16") -> None:
    """tensors: Hugging Face names; written under llama.cpp names in contract order; qtype: FILE_TYPES."""
    import gguf

    writer = gguf.GGUFWriter(str(path), C.ARCH)
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name)
    params = sum(t.numel() for t in tensors.values())
    writer.add_size_label(gguf.size_label(params, 0, 0, 0))
    arrays = {"int32_array": gguf.GGUFValueType.INT32, "bool_array": gguf.GGUFValueType.BOOL}
    for key, kind, value in metadata(cfg):
        if kind in arrays:
            writer.add_key_value(key, list(value), gguf.GGUFValueType.ARRAY, sub_type=arrays[kind])
        else:
            getattr(writer, f"add_{kind}")(key, value)
    writer.add_file_type(FILE_TYPES[qtype])
    writer.add_quantization_version(QUANTIZATION_VERSION)
    vocab.write(writer)
    for hf_name in C.expected_tensors(cfg, "hf"):
        name = C.hf_to_gguf_name(hf_name)
        arr, ggml_type = storage(tensors[hf_name], name, qtype)
        writer.add_tensor(name, arr, raw_shape=arr.shape, raw_dtype=ggml_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=progress)
    writer.close()


def _meta(kv: dict, key: C.Key, where: str):
    """A key's value checked against its type; None when an optional key is absent."""
    v = kv.get(key.gguf, kv.get(key.legacy) if key.legacy else None)
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


def _refuse_keys(kv: dict, where: str) -> None:
    """llama.cpp DFlash metadata that would change the computation in a way Strata does not implement."""
    for key, (fine, what) in C.REFUSED_KEYS.items():
        if key in kv and kv[key] != fine:
            raise ArtifactError(f"{where}: metadata key '{key}' = {kv[key]!r} asks for {what}, which is not "
                                f"supported")
    head_dim = kv.get(C.K_KEY_LEN)
    rot = kv.get("dflash.rope.dimension_count")
    if rot is not None and rot != head_dim:
        raise ArtifactError(f"{where}: metadata key 'dflash.rope.dimension_count' = {rot} asks for partial RoPE "
                            f"(head dim {head_dim}), which is not supported")
    sections = kv.get("dflash.rope.dimension_sections")
    if sections is not None and (list(sections)[:1] != [(head_dim or 0) // 2] or any(list(sections)[1:])):
        raise ArtifactError(f"{where}: metadata key 'dflash.rope.dimension_sections' = {sections} asks for "
                            f"multi-section RoPE, which is not supported")


def config_from_gguf(kv: dict, where: str, fc_in: int | None) -> C.DFlashConfig:
    arch = kv.get("general.architecture")
    if arch != C.ARCH:
        raise ArtifactError(f"{where}: general.architecture is {arch!r}, expected '{C.ARCH}'")
    _refuse_keys(kv, where)
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
    try:
        vocab = Vocab.from_metadata(kv, where)
    except StrataError as e:  # a drafter's file: refused as the artifact it is
        raise ArtifactError(str(e)) from None
    if values.get("vocab_size") is None and vocab is not None:
        values["vocab_size"] = len(vocab.tokens)
    n = len(values["target_layer_ids"])
    if not fc_in or fc_in % n:
        raise ArtifactError(f"{where}: tensor 'fc.weight' input size {fc_in} is not a multiple of the "
                            f"{n} target layers")
    cfg = C.DFlashConfig(target_hidden_size=fc_in // n, **values)
    cfg.validate(where)
    return cfg


def read_gguf(path: Path):
    where = str(path)
    kv, infos = gguf_file.read(path)
    arch = kv.get("general.architecture")
    if arch != C.ARCH:
        from ..models.registry import families

        targets = {f.gguf_arch for f in families().values()}
        kind = " (a target model's file: give it as --model)" if arch in targets else ""
        raise ArtifactError(f"{where}: general.architecture is {arch!r}, expected '{C.ARCH}'{kind}")
    names = [i.name for i in infos]
    C.refuse_variants(names, where)
    hf_names = {C.gguf_to_hf_name(n): n for n in names}
    by_name = {i.name: i for i in infos}
    fc = by_name.get(hf_names.get("fc.weight", ""))
    cfg = config_from_gguf(kv, where, fc.shape[0] if fc is not None and len(fc.shape) == 2 else None)
    cfg.set_dspark(hf_names, {h: tuple(reversed(by_name[g].shape)) for h, g in hf_names.items()}, where)
    C.refuse_stray_variants(hf_names, cfg, where)
    expected = C.expected_tensors(cfg, "hf")
    C.check_tensor_set(hf_names, expected, where)
    tensors, types, blocks = {}, {}, {}
    for hf_name, shape in expected.items():
        info = by_name[hf_names[hf_name]]
        tensors[hf_name] = gguf_file.values(info, shape, where)
        types[hf_name] = info.type.name
        if info.type.name not in ("F32", "F16", "BF16"):
            blocks[hf_name] = (int(info.type), gguf_file.rows_of_blocks(info, shape))
    return Artifact(cfg, tensors, path, "gguf", types=types, vocab=Vocab.from_metadata(kv, where), blocks=blocks)
