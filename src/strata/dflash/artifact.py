"""Reading and writing DFlash drafters: the reference Hugging Face folder and the llama.cpp GGUF.

`load_artifact` is the strict loader every command uses: it returns the config and the tensors under
their Hugging Face names, or raises ArtifactError naming the file and what is wrong."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import ArtifactError, StrataError
from ..models.weights import read_safetensors
from . import contract as C


@dataclass
class Artifact:
    cfg: C.DFlashConfig
    tensors: dict[str, torch.Tensor]  # Hugging Face names
    source: Path
    fmt: str  # "gguf" or "hf"

    @property
    def parameter_count(self) -> int:
        return sum(t.numel() for t in self.tensors.values())


# ---------------------------------------------------------------- Hugging Face config.json

def _int(cfg: dict, key: str, where: str, default=None):
    v = cfg.get(key, default)
    if v is None:
        raise ArtifactError(f"{where}: missing field '{key}'")
    if not isinstance(v, int) or isinstance(v, bool):
        raise ArtifactError(f"{where}: field '{key}' must be an integer, got {v!r}")
    return v


def config_from_hf(cfg: dict, where: str, fc_shape: tuple | None = None) -> C.DFlashConfig:
    C.refuse_variants([], where, cfg.get("architectures"))
    dcfg = cfg.get("dflash_config") or {}
    if not isinstance(dcfg, dict):
        raise ArtifactError(f"{where}: dflash_config must be an object")
    block = cfg.get("block_size", dcfg.get("block_size"))
    if block is None:
        raise ArtifactError(f"{where}: missing field 'block_size' (top level or in dflash_config)")
    mask = dcfg.get("mask_token_id", cfg.get("mask_token_id"))
    if mask is None:
        raise ArtifactError(f"{where}: missing field 'dflash_config.mask_token_id'")
    heads = _int(cfg, "num_attention_heads", where)
    hidden = _int(cfg, "hidden_size", where)
    num_target_layers = cfg.get("num_target_layers")
    taps = dcfg.get("target_layer_ids", cfg.get("target_layer_ids"))
    if taps is None:
        if not isinstance(num_target_layers, int):
            raise ArtifactError(f"{where}: no dflash_config.target_layer_ids and no num_target_layers to derive them")
        n = fc_shape[1] // hidden if fc_shape else 1  # fc in = n * target hidden; same-size target assumed
        taps = C.default_target_layers(max(n, 1), num_target_layers)
    if not isinstance(taps, list):
        raise ArtifactError(f"{where}: target_layer_ids must be a list, got {taps!r}")
    rope_theta = cfg.get("rope_theta")
    if rope_theta is None and isinstance(cfg.get("rope_parameters"), dict):
        rope_theta = cfg["rope_parameters"].get("rope_theta")
    target_hidden = cfg.get("target_hidden_size")
    if target_hidden is None:
        target_hidden = fc_shape[1] // max(len(taps), 1) if fc_shape else hidden
    out = C.DFlashConfig(
        hidden_size=hidden,
        intermediate_size=_int(cfg, "intermediate_size", where),
        num_layers=_int(cfg, "num_hidden_layers", where),
        num_heads=heads,
        num_kv_heads=_int(cfg, "num_key_value_heads", where, heads),
        head_dim=_int(cfg, "head_dim", where, hidden // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
        block_size=block,
        mask_token_id=mask,
        target_layer_ids=taps,
        target_hidden_size=target_hidden,
        context_length=int(cfg.get("max_position_embeddings", 32768)),
        num_target_layers=num_target_layers,
        vocab_size=cfg.get("vocab_size"),
        attention_bias=bool(cfg.get("attention_bias", False)),
        layer_types=cfg.get("layer_types"),
        sliding_window=cfg.get("sliding_window"),
        input_embedding_scale=cfg.get("input_embedding_scale"),
        output_multiplier=cfg.get("output_multiplier"),
        final_logit_softcapping=cfg.get("final_logit_softcapping"),
    )
    if out.layer_types is not None and "sliding_attention" not in out.layer_types:
        out.layer_types, out.sliding_window = None, None  # all full attention: same semantics, one spelling
    out.rms_norm_eps, out.rope_theta = _f32(out.rms_norm_eps), _f32(out.rope_theta)  # GGUF stores float32
    for key in C.OPTIONAL_FLOAT_KEYS:
        if getattr(out, key) is not None:
            setattr(out, key, _f32(getattr(out, key)))
    out.validate(where)
    return out


def config_to_hf(cfg: C.DFlashConfig) -> dict:
    out = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.context_length,
        "attention_bias": cfg.attention_bias,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "block_size": cfg.block_size,
        "dflash_config": {"mask_token_id": cfg.mask_token_id, "target_layer_ids": list(cfg.target_layer_ids)},
    }
    if cfg.num_target_layers is not None:
        out["num_target_layers"] = cfg.num_target_layers
    if cfg.vocab_size is not None:
        out["vocab_size"] = cfg.vocab_size
    if cfg.layer_types is not None:
        out["layer_types"] = list(cfg.layer_types)
        if cfg.sliding_window is not None:
            out["sliding_window"] = cfg.sliding_window
    if cfg.target_hidden_size != cfg.hidden_size:
        out["target_hidden_size"] = cfg.target_hidden_size
    for key in ("input_embedding_scale", "output_multiplier", "final_logit_softcapping"):
        if getattr(cfg, key) is not None:
            out[key] = getattr(cfg, key)
    return out


def read_hf(folder: Path) -> Artifact:
    from ..models.config import read_json

    where = str(folder)
    try:
        raw = read_json(folder / "config.json", "config.json")
    except StrataError as e:
        raise ArtifactError(str(e)) from None
    try:
        tensors = read_safetensors(folder)
    except StrataError as e:
        raise ArtifactError(str(e)) from None
    tensors = {k.removeprefix("model."): v for k, v in tensors.items()}
    C.refuse_variants(tensors, where, raw.get("architectures"))
    fc = tensors.get("fc.weight")
    cfg = config_from_hf(raw, where, tuple(fc.shape) if fc is not None else None)
    expected = C.expected_tensors(cfg, "hf")
    C.check_tensor_set(tensors, expected, where)
    for name, shape in expected.items():
        t = tensors[name]
        if tuple(t.shape) != shape:
            raise ArtifactError(f"{where}: tensor '{name}' has shape {list(t.shape)}, expected {list(shape)}")
        if not t.dtype.is_floating_point:
            raise ArtifactError(f"{where}: tensor '{name}' has dtype {t.dtype}, expected a float type")
    return Artifact(cfg, tensors, folder, "hf")


# ---------------------------------------------------------------- GGUF

def _f32(x: float) -> float:
    """The shortest decimal that reads back as the same float32 (1e-06, not 9.99999997e-07)."""
    return float(str(np.float32(x)))


def gguf_metadata(cfg: C.DFlashConfig) -> list[tuple[str, str, object]]:
    """(key, type, value) in writing order; type is a GGUFWriter add_* suffix."""
    kv = [
        (C.K_BLOCK_COUNT, "uint32", cfg.num_layers),
        (C.K_CONTEXT, "uint32", cfg.context_length),
        (C.K_EMBED, "uint32", cfg.hidden_size),
        (C.K_FFN, "uint32", cfg.intermediate_size),
        (C.K_HEADS, "uint32", cfg.num_heads),
        (C.K_KV_HEADS, "uint32", cfg.num_kv_heads),
        (C.K_KEY_LEN, "uint32", cfg.head_dim),
        (C.K_VALUE_LEN, "uint32", cfg.head_dim),
        (C.K_EPS, "float32", cfg.rms_norm_eps),
        (C.K_ROPE_BASE, "float32", cfg.rope_theta),
        (C.K_TARGET_LAYERS, "int32_array", [t + 1 for t in cfg.target_layer_ids]),
        (C.K_BLOCK_SIZE, "uint32", cfg.block_size),
        (C.K_MASK, "uint32", cfg.mask_token_id),
    ]
    if cfg.num_target_layers is not None:
        kv.append((C.K_NUM_TARGET_LAYERS, "uint32", cfg.num_target_layers))
    if cfg.vocab_size is not None:
        kv.append((C.K_VOCAB, "uint32", cfg.vocab_size))
    if cfg.attention_bias:
        kv.append((C.K_ATTN_BIAS, "bool", True))
    for key, gguf_key in C.OPTIONAL_FLOAT_KEYS.items():
        if getattr(cfg, key) is not None:
            kv.append((gguf_key, "float32", getattr(cfg, key)))
    if cfg.layer_types is not None and cfg.sliding_window is not None:
        kv.append((C.K_SLIDING, "uint32", cfg.sliding_window))
        kv.append((C.K_SLIDING_PATTERN, "bool_array", [t == "sliding_attention" for t in cfg.layer_types]))
    return kv


def write_gguf(path: Path, cfg: C.DFlashConfig, tensors: dict[str, torch.Tensor], progress=None) -> None:
    """tensors: Hugging Face names, BF16. Written under llama.cpp names in contract order."""
    import gguf

    writer = gguf.GGUFWriter(str(path), C.ARCH)
    writer.add_name("DFlash drafter")
    for key, kind, value in gguf_metadata(cfg):
        if kind == "int32_array":
            writer.add_key_value(key, [int(v) for v in value], gguf.GGUFValueType.ARRAY,
                                 sub_type=gguf.GGUFValueType.INT32)
        elif kind == "bool_array":
            writer.add_key_value(key, list(value), gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.BOOL)
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
    if progress is None:
        writer.write_tensors_to_file()
    else:
        writer.write_tensors_to_file(progress=True)
    writer.close()


def _field_value(field):
    import gguf

    types = field.types
    if not types:
        return None
    if types[0] == gguf.GGUFValueType.ARRAY:
        return [field.parts[i].tolist()[0] for i in field.data] if types[-1] != gguf.GGUFValueType.STRING \
            else [bytes(field.parts[i]).decode("utf-8", "replace") for i in field.data]
    if types[0] == gguf.GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", "replace")
    return field.parts[field.data[0]].tolist()[0]


def _meta_int(kv: dict, key: str, where: str, required=True):
    v = kv.get(key)
    if v is None:
        if required:
            raise ArtifactError(f"{where}: missing metadata key '{key}'")
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise ArtifactError(f"{where}: metadata key '{key}' must be an integer, got {v!r}")
    return v


def _meta_float(kv: dict, key: str, where: str) -> float:
    v = kv.get(key)
    if v is None:
        raise ArtifactError(f"{where}: missing metadata key '{key}'")
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(v):
        raise ArtifactError(f"{where}: metadata key '{key}' must be a finite number, got {v!r}")
    return _f32(v)


def config_from_gguf(kv: dict, where: str, fc_in: int | None) -> C.DFlashConfig:
    arch = kv.get("general.architecture")
    if arch != C.ARCH:
        raise ArtifactError(f"{where}: general.architecture is {arch!r}, expected '{C.ARCH}'")
    for key in C.REQUIRED_INT_KEYS:
        _meta_int(kv, key, where)
    layers = kv.get(C.K_TARGET_LAYERS)
    if not isinstance(layers, list) or not layers or any(isinstance(v, bool) or not isinstance(v, int) for v in layers):
        raise ArtifactError(f"{where}: metadata key '{C.K_TARGET_LAYERS}' must be a non-empty integer array, "
                            f"got {layers!r}")
    if any(v < 1 for v in layers):
        raise ArtifactError(f"{where}: '{C.K_TARGET_LAYERS}' holds layer boundaries (HF id + 1), so every entry "
                            f"must be >= 1, got {layers}")
    hidden = kv[C.K_EMBED]
    if kv.get(C.K_VALUE_LEN, kv[C.K_KEY_LEN]) != kv[C.K_KEY_LEN]:
        raise ArtifactError(f"{where}: value_length {kv[C.K_VALUE_LEN]} differs from key_length {kv[C.K_KEY_LEN]}")
    pattern = kv.get(C.K_SLIDING_PATTERN)
    sliding = _meta_int(kv, C.K_SLIDING, where, required=False)
    layer_types = None
    if pattern is not None:
        if not isinstance(pattern, list):
            raise ArtifactError(f"{where}: metadata key '{C.K_SLIDING_PATTERN}' must be an array")
        layer_types = ["sliding_attention" if p else "full_attention" for p in pattern]
    cfg = C.DFlashConfig(
        hidden_size=hidden,
        intermediate_size=kv[C.K_FFN],
        num_layers=kv[C.K_BLOCK_COUNT],
        num_heads=kv[C.K_HEADS],
        num_kv_heads=kv[C.K_KV_HEADS],
        head_dim=kv[C.K_KEY_LEN],
        rms_norm_eps=_meta_float(kv, C.K_EPS, where),
        rope_theta=_meta_float(kv, C.K_ROPE_BASE, where),
        block_size=kv[C.K_BLOCK_SIZE],
        mask_token_id=kv[C.K_MASK],
        target_layer_ids=[v - 1 for v in layers],
        target_hidden_size=(fc_in // len(layers)) if fc_in and fc_in % len(layers) == 0 else -1,
        context_length=kv[C.K_CONTEXT],
        num_target_layers=_meta_int(kv, C.K_NUM_TARGET_LAYERS, where, required=False),
        vocab_size=_meta_int(kv, C.K_VOCAB, where, required=False),
        attention_bias=bool(kv.get(C.K_ATTN_BIAS, False)),
        layer_types=layer_types,
        sliding_window=sliding,
        **{key: _meta_float(kv, gguf_key, where) for key, gguf_key in C.OPTIONAL_FLOAT_KEYS.items() if gguf_key in kv},
    )
    if cfg.target_hidden_size == -1:
        raise ArtifactError(f"{where}: tensor 'fc.weight' input size {fc_in} is not a multiple of the "
                            f"{len(layers)} target layers")
    cfg.validate(where)
    return cfg


# Smallest encoded size of one GGUF metadata value of each type (strings: their u64 length).
_GGUF_VALUE_SIZE = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 8: 8, 9: 12, 10: 8, 11: 8, 12: 8}


def check_gguf_counts(path: Path) -> None:
    """Walk the GGUF header and refuse any count or length that the rest of the file cannot hold,
    before gguf's reader builds per-element views (a corrupt array length would exhaust memory)."""
    import struct

    where = str(path)
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        f.seek(0)

        def take(n: int, what: str) -> bytes:
            if n > size - f.tell():
                raise ArtifactError(f"{where}: {what} at byte {f.tell()} runs past the end of the file "
                                    f"({size} bytes)")
            return f.read(n)

        def u32(what):
            return struct.unpack("<I", take(4, what))[0]

        def u64(what):
            return struct.unpack("<Q", take(8, what))[0]

        def value(vtype: int, what: str) -> None:
            if vtype == 8:
                take(u64(what + " length"), what)
            elif vtype == 9:
                item, count = u32(what + " item type"), u64(what + " count")
                if item not in _GGUF_VALUE_SIZE:
                    raise ArtifactError(f"{where}: {what} has unknown item type {item}")
                if count * _GGUF_VALUE_SIZE[item] > size - f.tell():
                    raise ArtifactError(f"{where}: {what} claims {count} items, more than the file holds")
                if item in (8, 9):
                    for _ in range(count):
                        value(item, what)
                else:
                    take(count * _GGUF_VALUE_SIZE[item], what)
            elif vtype in _GGUF_VALUE_SIZE:
                take(_GGUF_VALUE_SIZE[vtype], what)
            else:
                raise ArtifactError(f"{where}: {what} has unknown value type {vtype}")

        if take(4, "magic") != b"GGUF":
            raise ArtifactError(f"{where}: not a GGUF file (bad magic)")
        u32("version")
        n_tensors, n_kv = u64("tensor count"), u64("metadata count")
        if n_kv * 16 > size or n_tensors * 24 > size:
            raise ArtifactError(f"{where}: header claims {n_tensors} tensors and {n_kv} metadata keys, "
                                f"more than {size} bytes can hold")
        for i in range(n_kv):
            key = take(u64(f"metadata key {i} length"), f"metadata key {i}").decode("utf-8", "replace")
            value(u32(f"metadata '{key}' type"), f"metadata '{key}'")
        for i in range(n_tensors):
            name = take(u64(f"tensor {i} name length"), f"tensor {i} name").decode("utf-8", "replace")
            dims = u32(f"tensor '{name}' dimension count")
            if dims > 4:
                raise ArtifactError(f"{where}: tensor '{name}' has {dims} dimensions, at most 4 allowed")
            take(8 * dims + 12, f"tensor '{name}' info")


def read_gguf(path: Path) -> Artifact:
    import gguf

    where = str(path)
    if not path.is_file():
        raise ArtifactError(f"{where}: no such file")
    check_gguf_counts(path)
    try:
        reader = gguf.GGUFReader(str(path))
        kv = {name: _field_value(f) for name, f in reader.fields.items()}
        infos = [(t.name, t.tensor_type, [int(x) for x in t.shape], t.data) for t in reader.tensors]
    except ArtifactError:
        raise
    except Exception as e:  # noqa: BLE001 - any parse failure of a corrupt file is the artifact's fault
        raise ArtifactError(f"{where}: not a readable GGUF file ({type(e).__name__}: {e})") from None
    names = [gguf_name for gguf_name, *_ in infos]
    if len(set(names)) != len(names):
        raise ArtifactError(f"{where}: duplicate tensor names")
    C.refuse_variants(names, where)
    hf_names = {C.gguf_to_hf_name(n): n for n in names}
    fc = next((i for i in infos if C.gguf_to_hf_name(i[0]) == "fc.weight"), None)
    cfg = config_from_gguf(kv, where, fc[2][0] if fc and len(fc[2]) == 2 else None)
    expected = C.expected_tensors(cfg, "hf")
    C.check_tensor_set(hf_names, expected, where)
    tensors = {}
    by_name = {i[0]: i for i in infos}
    for hf_name, shape in expected.items():
        name, ttype, ggml_shape, data = by_name[hf_names[hf_name]]
        if ttype != gguf.GGMLQuantizationType.BF16:
            type_name = getattr(ttype, "name", str(ttype))
            raise ArtifactError(f"{where}: tensor '{name}' has type {type_name}, expected BF16")
        if tuple(reversed(ggml_shape)) != shape:
            raise ArtifactError(f"{where}: tensor '{name}' has shape {list(reversed(ggml_shape))} (GGML "
                                f"{ggml_shape}), expected {list(shape)}")
        raw = np.ascontiguousarray(data).view(np.uint16)
        if raw.size != int(np.prod(shape)):
            raise ArtifactError(f"{where}: tensor '{name}' data is truncated")
        tensors[hf_name] = torch.from_numpy(raw.reshape(shape).copy()).view(torch.bfloat16)
    return Artifact(cfg, tensors, path, "gguf")


def load_artifact(path: str | Path) -> Artifact:
    path = Path(path)
    if path.is_dir():
        return read_hf(path)
    if not path.exists():
        raise ArtifactError(f"{path}: no such file or folder")
    return read_gguf(path)


def check_against_target(cfg: C.DFlashConfig, target_cfg, where: str) -> None:
    """A drafter must fit its target before any decoding starts."""
    n = target_cfg.num_layers
    bad = [t for t in cfg.target_layer_ids if not 0 <= t < n]
    if bad:
        raise ArtifactError(f"{where}: target layer id {bad[0]} (HF convention) is outside the target's "
                            f"{n} layers 0..{n - 1}")
    if cfg.target_hidden_size != target_cfg.hidden_size:
        raise ArtifactError(f"{where}: fc expects target hidden size {cfg.target_hidden_size} per tap, the target "
                            f"has {target_cfg.hidden_size}")
    if cfg.hidden_size != target_cfg.hidden_size:
        raise ArtifactError(f"{where}: drafter hidden size {cfg.hidden_size} differs from the target's "
                            f"{target_cfg.hidden_size} (it uses the target's embedding and LM head)")
    if cfg.vocab_size is not None and cfg.vocab_size != target_cfg.vocab_size:
        raise ArtifactError(f"{where}: drafter vocabulary {cfg.vocab_size} differs from the target's "
                            f"{target_cfg.vocab_size}")
    if cfg.mask_token_id >= target_cfg.vocab_size:
        raise ArtifactError(f"{where}: mask_token_id {cfg.mask_token_id} is outside the target's vocabulary "
                            f"of {target_cfg.vocab_size}")
    if cfg.num_target_layers is not None and cfg.num_target_layers != n:
        raise ArtifactError(f"{where}: drafter was trained for a target of {cfg.num_target_layers} layers, "
                            f"this target has {n}")
