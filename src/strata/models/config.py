"""Model hyper-parameters, and the helpers families use to read them from a Hugging Face config.json."""

from __future__ import annotations

import json
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
    gated_attention: bool = False


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
    if key not in cfg:
        raise StrataError(f"{path}: missing field '{key}'")
    value = cfg[key]
    if kind is int and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
        raise StrataError(f"{path}: field '{key}' must be a positive integer, got {value!r}")
    if kind is float and not isinstance(value, (int, float)):
        raise StrataError(f"{path}: field '{key}' must be a number, got {value!r}")
    return value


def id_list(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def rope_from_hf(cfg: dict, path: Path, scalings: tuple[str, ...] = ()) -> RopeConfig:
    """rope_theta/rope_scaling (transformers 4.x) or rope_parameters (5.x); a scaling type outside
    `scalings` is refused."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict):
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        rope_type = params.get("rope_type", "default")
        scaling = None if rope_type in (None, "default") else dict(params)
        rope = RopeConfig(float(theta), scaling)
    else:
        scaling = cfg.get("rope_scaling")
        if scaling is not None and scaling.get("rope_type", scaling.get("type")) in (None, "default"):
            scaling = None
        rope = RopeConfig(float(cfg.get("rope_theta", 10000.0)), scaling)
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
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or hidden // heads
    if heads % kv_heads:
        raise StrataError(f"{path}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    if cfg.get("mlp_bias"):
        raise StrataError(f"{path}: mlp_bias is not supported")
    return ModelConfig(
        family=family,
        vocab_size=require(cfg, "vocab_size", path),
        hidden_size=hidden,
        intermediate_size=require(cfg, "intermediate_size", path),
        num_layers=require(cfg, "num_hidden_layers", path),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        rope=rope_from_hf(cfg, path, rope_scalings),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        qk_norm=qk_norm,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=id_list(cfg.get("eos_token_id")),
        torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
    )


def moe_from_hf(hf: dict, path, num_layers: int, renormalize: bool, shared: bool = False,
                sparse_by_config: bool = True) -> MoeConfig:
    """A mixture-of-experts config.json's expert fields (num_experts or num_local_experts,
    num_experts_per_tok, moe_intermediate_size; shared_expert_intermediate_size when `shared`); with
    sparse_by_config the sparse layers are those decoder_sparse_step and mlp_only_layers leave, else all."""
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    if not isinstance(experts, int) or isinstance(experts, bool) or experts <= 0:
        raise StrataError(f"{path}: field 'num_experts' must be a positive integer, got {experts!r}")
    top_k = require(hf, "num_experts_per_tok", path)
    if not isinstance(hf.get("norm_topk_prob", False), bool):
        raise StrataError(f"{path}: field 'norm_topk_prob' must be true or false, got {hf['norm_topk_prob']!r}")
    if top_k > experts:
        raise StrataError(f"{path}: num_experts_per_tok {top_k} exceeds num_experts {experts}")
    layers = list(range(num_layers))
    if sparse_by_config:
        step = hf.get("decoder_sparse_step", 1)
        if not isinstance(step, int) or step <= 0:
            raise StrataError(f"{path}: field 'decoder_sparse_step' must be a positive integer, got {step!r}")
        dense = hf.get("mlp_only_layers") or []
        if not isinstance(dense, list) or not all(isinstance(n, int) and not isinstance(n, bool) for n in dense):
            raise StrataError(f"{path}: field 'mlp_only_layers' must be a list of layer indices, got {dense!r}")
        dense = set(dense)
        layers = [n for n in layers if n not in dense and (n + 1) % step == 0]
    return MoeConfig(experts, top_k, require(hf, "moe_intermediate_size", path), renormalize, layers,
                     require(hf, "shared_expert_intermediate_size", path) if shared else 0)
