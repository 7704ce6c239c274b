"""The reference Hugging Face format of a DFlash drafter: config.json + safetensors (the `dflash`
package, vLLM and SGLang read it)."""

from __future__ import annotations

from pathlib import Path

from ..errors import ArtifactError, StrataError
from ..models.config import read_json
from ..models.loader import FLOAT_DTYPES, dtype_name, read_safetensors
from . import contract as C
from .contract import Artifact, f32


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
    optional = {}
    for k in C.KEYS:
        if k.optional and k.hf and k.field != "attention_bias":
            name = k.hf.removeprefix("dflash_config.")
            optional[k.field] = dcfg.get(name, cfg.get(name))
    refused = {"attention_value_scale": "an attention value scale", "partial_rotary_factor": "partial RoPE",
               "use_swa": "dflash_config.use_swa (sliding-window attention for every layer)"}
    for key, what in refused.items():
        if dcfg.get(key, cfg.get(key)) not in (None, False, 1.0):
            raise ArtifactError(f"{where}: field '{key}' asks for {what}, which is not supported")
    if (cfg.get("is_causal") if cfg.get("is_causal") is not None else dcfg.get("causal")):
        raise ArtifactError(f"{where}: field 'is_causal' asks for causal attention inside the block, which is not "
                            f"supported")
    out = C.DFlashConfig(
        hidden_size=hidden,
        intermediate_size=_int(cfg, "intermediate_size", where),
        num_layers=_int(cfg, "num_hidden_layers", where),
        num_heads=heads,
        num_kv_heads=_int(cfg, "num_key_value_heads", where, heads),
        head_dim=_int(cfg, "head_dim", where, hidden // heads),
        rms_norm_eps=f32(float(cfg.get("rms_norm_eps", 1e-6))),
        rope_theta=f32(float(rope_theta if rope_theta is not None else 10000.0)),
        block_size=block,
        mask_token_id=mask,
        target_layer_ids=taps,
        target_hidden_size=target_hidden,
        context_length=int(cfg.get("max_position_embeddings", 32768)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        **optional,
    )
    if "DFlash2DraftModel" in (cfg.get("architectures") or []) and out.variant != "dflash2":
        raise ArtifactError(f"{where}: architecture DFlash2DraftModel needs dflash_config's "
                            f"{', '.join(C.DFLASH2_FIELDS)}")
    if out.layer_types is not None and "sliding_attention" not in out.layer_types:
        out.layer_types, out.sliding_window = None, None  # all full attention: same semantics, one spelling
    for key in C.KEYS:
        if key.kind == "float32" and key.optional and getattr(out, key.field) is not None:
            setattr(out, key.field, f32(getattr(out, key.field)))
    out.validate(where)
    return out


def config_to_hf(cfg: C.DFlashConfig, dtype: str = "bfloat16") -> dict:
    arch = {"dflash2": "DFlash2DraftModel", "dspark": "DSparkDraftModel"}.get(cfg.variant, "DFlashDraftModel")
    out = {"architectures": [arch], "model_type": "qwen3", "hidden_act": "silu",
           "tie_word_embeddings": False, "torch_dtype": dtype, "dflash_config": {}}
    for key in C.KEYS:
        value = getattr(cfg, key.field)
        if key.hf is None or value is None or (key.field == "sliding_window" and cfg.layer_types is None):
            continue
        section, name = (out["dflash_config"], key.hf.split(".", 1)[1]) if "." in key.hf else (out, key.hf)
        section[name] = list(value) if isinstance(value, list) else value
    if cfg.target_hidden_size != cfg.hidden_size:
        out["target_hidden_size"] = cfg.target_hidden_size
    return out


def read_hf(folder: Path):
    where = str(folder)
    try:
        raw = read_json(folder / "config.json", "config.json")
        tensors = read_safetensors(folder)
    except StrataError as e:
        raise ArtifactError(str(e)) from None
    if raw.get("quantization_config") is not None:
        raise ArtifactError(f"{folder / 'config.json'}: quantization_config: quantized Hugging Face drafters are not "
                            f"supported (a GGUF drafter may be quantized)")
    tensors = {k.removeprefix("model."): v for k, v in tensors.items()}
    C.refuse_variants(tensors, where, raw.get("architectures"))
    fc = tensors.get("fc.weight")
    cfg = config_from_hf(raw, where, tuple(fc.shape) if fc is not None else None)
    cfg.set_dspark(tensors, {n: tuple(t.shape) for n, t in tensors.items()}, where)
    if any("DSpark" in a for a in raw.get("architectures") or []) and cfg.variant != "dspark":
        raise ArtifactError(f"{where}: a DSpark architecture without its Markov head "
                            f"({C.MARKOV_ROLES['w1'][0]})")
    if cfg.variant == "dspark":
        if raw.get("markov_head_type", "vanilla") != "vanilla":
            raise ArtifactError(f"{where}: field 'markov_head_type' is {raw['markov_head_type']!r}; only 'vanilla' "
                                f"Markov heads are supported (llama.cpp's too)")
        if raw.get("draft_vocab_size") not in (None, cfg.vocab_size):
            raise ArtifactError(f"{where}: field 'draft_vocab_size' {raw['draft_vocab_size']} differs from vocab_size "
                                f"{cfg.vocab_size}: a draft vocabulary (d2t) is not supported")
    C.refuse_stray_variants(tensors, cfg, where)
    expected = C.expected_tensors(cfg, "hf")
    C.check_tensor_set(tensors, expected, where)
    for name, shape in expected.items():
        t = tensors[name]
        if tuple(t.shape) != shape:
            raise ArtifactError(f"{where}: tensor '{name}' has shape {list(t.shape)}, expected {list(shape)}")
        if t.dtype not in FLOAT_DTYPES:
            raise ArtifactError(f"{where}: tensor '{name}' has dtype {dtype_name(t.dtype)}, expected float32, "
                                f"bfloat16 or float16")
    return Artifact(cfg, tensors, folder, "hf", types={n: str(t.dtype).removeprefix("torch.") for n, t in tensors.items()})
