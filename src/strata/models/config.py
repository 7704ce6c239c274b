"""Model hyper-parameters, and the helpers families use to read them from a Hugging Face config.json."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import StrataError
from ..layers.rotary import RopeConfig


@dataclass
class MoeConfig:
    """A mixture-of-experts MLP's shape: which layers have one, how many experts, how many a token uses."""

    experts: int
    top_k: int
    intermediate: int  # each expert's
    renormalize: bool  # the top-k weights rescaled to sum to 1 (norm_topk_prob)
    layers: list[int]  # the sparse layers; the others keep the dense MLP of intermediate_size
    shared: int = 0  # intermediate size of an always-on shared expert, gated by sigmoid (Qwen3.5-MoE); 0: none


@dataclass
class LinearAttentionConfig:
    """Hybrid models' linear-attention (gated DeltaNet) layers: which, and their shape."""

    layers: list[int]
    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int
    kernel: int
    tiled: bool = False  # value heads in llama.cpp's qwen35 order (GatedDeltaNet's tiled)


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
    moe: MoeConfig | None = None
    linear: LinearAttentionConfig | None = None
    checkpoint_prefix: str = "model."  # where the decoder's tensors sit ("model.language_model." in a VLM)
    weight_block: tuple[int, int] | None = None  # a block-scaled FP8 checkpoint's block (models/loader.py)
    mtp_layers: int = 0  # multi-token-prediction blocks the checkpoint holds beside the decoder (models/mtp.py)
    load_mtp: bool = False  # whether the model is built and loaded with its MTP block (--mtp)


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


def require(cfg: dict, key: str, path: Path, kind=int):
    """A field that must be there: int, a positive integer; float, a positive finite number; bool."""
    if key not in cfg:
        raise StrataError(f"{path}: missing field '{key}'")
    return checked(cfg[key], key, path, kind)


def optional(cfg: dict, key: str, path: Path, default, kind=int):
    """A field that may be absent or null (then `default`), else as require checks it."""
    value = cfg.get(key)
    return default if value is None else checked(value, key, path, kind)


def must(value, where, label: str, expected: str, ok) -> None:
    """The one-line refusal of a configuration value (a config.json field, a GGUF metadata key) for which
    ok(value) fails: where, what, what was expected and what was found."""
    if not ok(value):
        raise StrataError(f"{where}: {label} must be {expected}, got {value!r}")


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


#: checked()'s kinds: what the message says is expected, and the test
KINDS = {int: ("a positive integer", lambda v: _number(v) and isinstance(v, int) and v > 0),
         float: ("a positive number", lambda v: _number(v) and math.isfinite(v) and v > 0),
         bool: ("true or false", lambda v: isinstance(v, bool))}


def checked(value, key: str, path: Path, kind):
    must(value, path, f"field '{key}'", *KINDS[kind])
    return float(value) if kind is float else value


def token_ids(value, key: str, path: Path) -> list[int]:
    """A token id field (eos_token_id): absent, one id, or a list of them."""
    if value is None:
        return []
    ids = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise StrataError(f"{path}: field '{key}' must be a token id or a list of them, got {value!r}")
    return ids


def rope_from_hf(cfg: dict, path: Path, scalings: tuple[str, ...] = ()) -> RopeConfig:
    """rope_theta/rope_scaling (transformers 4.x) or rope_parameters (5.x); a scaling type outside
    `scalings` is refused."""
    for key in ("rope_parameters", "rope_scaling"):
        if not isinstance(cfg.get(key), (dict, type(None))):
            raise StrataError(f"{path}: field '{key}' must be an object, got {cfg[key]!r}")
    params = cfg.get("rope_parameters")
    theta = optional(cfg, "rope_theta", path, 10000.0, float)
    if params is not None:
        theta = optional(params, "rope_theta", path, theta, float)
        rope_type = params.get("rope_type", "default")
        scaling = None if rope_type in (None, "default") else dict(params)
    else:
        scaling = cfg.get("rope_scaling")
        if scaling is not None and scaling.get("rope_type", scaling.get("type")) in (None, "default"):
            scaling = None
    rope = RopeConfig(theta, scaling)
    if rope.scaling is not None:
        kind = rope.scaling.get("rope_type", rope.scaling.get("type"))
        if kind not in scalings:
            raise StrataError(f"{path}: rope scaling type {kind!r} is not supported"
                              f"{' (supported: ' + ', '.join(scalings) + ')' if scalings else ''}")
    return rope


def dense_config(cfg: dict, path: Path, family: str, qk_norm: bool, rope_scalings: tuple[str, ...] = ()) -> ModelConfig:
    """The fields every dense decoder of the Llama lineage shares."""
    hidden = require(cfg, "hidden_size", path)
    heads = require(cfg, "num_attention_heads", path)
    kv_heads = optional(cfg, "num_key_value_heads", path, heads)
    head_dim = hidden // heads if cfg.get("head_dim") == 0 else optional(cfg, "head_dim", path, hidden // heads)
    if heads % kv_heads:
        raise StrataError(f"{path}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    if cfg.get("mlp_bias"):
        raise StrataError(f"{path}: mlp_bias is not supported")
    layers = require(cfg, "num_hidden_layers", path)
    sliding = sliding_window_layers(cfg, path, layers)
    if sliding:
        raise StrataError(f"{path}: use_sliding_window gives layers {sliding[0]}.. a sliding window of "
                          f"{cfg['sliding_window']}, which is not supported")
    return ModelConfig(
        family=family,
        vocab_size=require(cfg, "vocab_size", path),
        hidden_size=hidden,
        intermediate_size=require(cfg, "intermediate_size", path),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=optional(cfg, "rms_norm_eps", path, 1e-6, float),
        max_position_embeddings=optional(cfg, "max_position_embeddings", path, 4096),
        rope=rope_from_hf(cfg, path, rope_scalings),
        tie_word_embeddings=optional(cfg, "tie_word_embeddings", path, False, bool),
        attention_bias=optional(cfg, "attention_bias", path, False, bool),
        qk_norm=qk_norm,
        bos_token_id=(token_ids(cfg.get("bos_token_id"), "bos_token_id", path) or [None])[0],
        eos_token_ids=token_ids(cfg.get("eos_token_id"), "eos_token_id", path),
        torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
    )


def sliding_window_layers(cfg: dict, path: Path, layers: int) -> list[int]:
    """The layers transformers gives a sliding window (Qwen3's use_sliding_window, sliding_window, and
    max_window_layers or layer_types)."""
    if optional(cfg, "use_sliding_window", path, False, bool) is False or cfg.get("sliding_window") is None:
        return []
    types = cfg.get("layer_types")
    if types is None:
        return list(range(optional(cfg, "max_window_layers", path, 28), layers))
    return [n for n, t in enumerate(types) if t == "sliding_attention"] if isinstance(types, list) else []


def moe_from_hf(hf: dict, path, num_layers: int, renormalize: bool, shared: bool = False,
                sparse_by_config: bool = True) -> MoeConfig:
    """A mixture-of-experts config.json's expert fields (num_experts or num_local_experts,
    num_experts_per_tok, moe_intermediate_size; shared_expert_intermediate_size when `shared`); with
    sparse_by_config the sparse layers are those decoder_sparse_step and mlp_only_layers leave, else all."""
    experts = checked(hf.get("num_experts", hf.get("num_local_experts")), "num_experts", path, int)
    top_k = require(hf, "num_experts_per_tok", path)
    optional(hf, "norm_topk_prob", path, False, bool)
    if top_k > experts:
        raise StrataError(f"{path}: num_experts_per_tok {top_k} exceeds num_experts {experts}")
    layers = list(range(num_layers))
    if sparse_by_config:
        step = optional(hf, "decoder_sparse_step", path, 1)
        dense = hf.get("mlp_only_layers") or []
        if not isinstance(dense, list) or not all(isinstance(n, int) and not isinstance(n, bool) for n in dense):
            raise StrataError(f"{path}: field 'mlp_only_layers' must be a list of layer indices, got {dense!r}")
        outside = [n for n in dense if not 0 <= n < num_layers]
        if outside:
            raise StrataError(f"{path}: field 'mlp_only_layers' names layer {outside[0]}, outside the model's "
                              f"{num_layers} layers 0..{num_layers - 1}")
        dense = set(dense)
        layers = [n for n in layers if n not in dense and (n + 1) % step == 0]
    return MoeConfig(experts, top_k, require(hf, "moe_intermediate_size", path), renormalize, layers,
                     require(hf, "shared_expert_intermediate_size", path) if shared else 0)
