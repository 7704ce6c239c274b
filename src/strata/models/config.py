"""Model hyper-parameters read from a Hugging Face config.json."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import StrataError

SUPPORTED_ARCHITECTURES = {
    "Qwen3ForCausalLM": "qwen3",
    "LlamaForCausalLM": "llama",
}


@dataclass
class RopeConfig:
    theta: float = 10000.0
    scaling: dict | None = None


@dataclass
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    torch_dtype: str | None = None


def read_json(path: Path, what: str) -> dict:
    if not path.is_file():
        raise StrataError(f"{path}: missing {what}")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise StrataError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise StrataError(f"{path}: expected a JSON object")
    return data


def _require(cfg: dict, key: str, path: Path, kind=int):
    if key not in cfg:
        raise StrataError(f"{path}: missing field '{key}'")
    value = cfg[key]
    if kind is int and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
        raise StrataError(f"{path}: field '{key}' must be a positive integer, got {value!r}")
    if kind is float and not isinstance(value, (int, float)):
        raise StrataError(f"{path}: field '{key}' must be a number, got {value!r}")
    return value


def _as_id_list(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def rope_from_hf(cfg: dict) -> RopeConfig:
    """rope_theta/rope_scaling (transformers 4.x) or rope_parameters (5.x)."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict):
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        rope_type = params.get("rope_type", "default")
        scaling = None if rope_type in (None, "default") else dict(params)
        return RopeConfig(float(theta), scaling)
    scaling = cfg.get("rope_scaling")
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) in (None, "default"):
        scaling = None
    return RopeConfig(float(cfg.get("rope_theta", 10000.0)), scaling)


def load_model_config(model_dir: str | Path) -> ModelConfig:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise StrataError(f"{model_dir}: not a model folder")
    path = model_dir / "config.json"
    return parse_model_config(read_json(path, "config.json"), path)


def parse_model_config(cfg: dict, path: Path) -> ModelConfig:
    """A Hugging Face config dict; `path` names it in errors."""
    archs = cfg.get("architectures") or []
    family = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if family is None:
        family = {"qwen3": "qwen3", "llama": "llama"}.get(cfg.get("model_type", "")) if not archs else None
    if family is None:
        raise StrataError(
            f"{path}: unknown architecture {archs or cfg.get('model_type')!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    hidden = _require(cfg, "hidden_size", path)
    heads = _require(cfg, "num_attention_heads", path)
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or hidden // heads
    if heads % kv_heads:
        raise StrataError(f"{path}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    if cfg.get("mlp_bias"):
        raise StrataError(f"{path}: mlp_bias is not supported")
    rope = rope_from_hf(cfg)
    if rope.scaling is not None:
        kind = rope.scaling.get("rope_type", rope.scaling.get("type"))
        if kind != "llama3":
            raise StrataError(f"{path}: rope scaling type {kind!r} is not supported (supported: llama3)")
    return ModelConfig(
        family=family,
        vocab_size=_require(cfg, "vocab_size", path),
        hidden_size=hidden,
        intermediate_size=_require(cfg, "intermediate_size", path),
        num_layers=_require(cfg, "num_hidden_layers", path),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        rope=rope,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        qk_norm=family == "qwen3",
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_as_id_list(cfg.get("eos_token_id")),
        torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
    )


def llama3_inv_freq(inv_freq, scaling: dict, orig_max_pos_default: int = 8192):
    """Llama 3.1 frequency-dependent rope rescaling (published formula)."""
    import torch

    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_ctx = float(scaling.get("original_max_position_embeddings", orig_max_pos_default))
    low_wavelen = old_ctx / low
    high_wavelen = old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)
