"""The DFlash drafter artifact contract, in one place.

Tensor roles with their Hugging Face and llama.cpp GGUF names, the GGUF metadata keys, the expected
shape of every tensor derived from the hyper-parameters, and the variants Strata refuses. Every other
module reads names from here."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..errors import ArtifactError
from ..gguf_names import LAYER
from ..gguf_vocab import Vocab

ARCH = "dflash"

# role: (Hugging Face suffix under layers.N., GGUF suffix under blk.N.), from the shared name table
_ROLE_SUFFIX = {"attn_norm": "input_layernorm.weight", "q": "self_attn.q_proj.weight", "k": "self_attn.k_proj.weight",
                "v": "self_attn.v_proj.weight", "o": "self_attn.o_proj.weight", "q_norm": "self_attn.q_norm.weight",
                "k_norm": "self_attn.k_norm.weight", "ffn_norm": "post_attention_layernorm.weight",
                "gate": "mlp.gate_proj.weight", "up": "mlp.up_proj.weight", "down": "mlp.down_proj.weight"}
LAYER_ROLES = {role: (hf, LAYER[hf]) for role, hf in _ROLE_SUFFIX.items()}
BIAS_ROLES = {f"{r}_bias": (f"self_attn.{r}_proj.bias", LAYER[f"self_attn.{r}_proj.bias"]) for r in "qkvo"}
GLOBAL_ROLES = {
    "fc": ("fc.weight", "fc.weight"),
    "hidden_norm": ("hidden_norm.weight", "enc.output_norm.weight"),
    "norm": ("norm.weight", "output_norm.weight"),
}
#: DFlash2's tensors (llama.cpp's converter renames them without transposing or reshaping; the base kernels have no
#: `.weight` in either format, and the codebooks gain one in GGUF)
CONV_ROLES = {
    "attn_conv_base": ("attention_conv.base_kernel", "attn_conv_base"),
    "attn_conv_proj": ("attention_conv.kernel_projection.weight", "attn_conv_proj.weight"),
    "ffn_conv_base": ("mlp_conv.base_kernel", "ffn_conv_base"),
    "ffn_conv_proj": ("mlp_conv.kernel_projection.weight", "ffn_conv_proj.weight"),
}
SELECTOR_ROLES = {
    "predecessor": ("candidate_selector.predecessor_codebook", "selector_predecessor.weight"),
    "successor": ("candidate_selector.successor_codebook", "selector_successor.weight"),
    "hidden": ("candidate_selector.hidden_projection.weight", "selector_hidden.weight"),
}
#: DSpark's tensors: a low-rank Markov head (the previous slot's token biases each slot's logits) and an optional
#: confidence head; full-vocabulary drafters only (no d2t)
MARKOV_ROLES = {"w1": ("markov_head.markov_w1.weight", "markov_w1.weight"),
                "w2": ("markov_head.markov_w2.weight", "markov_w2.weight")}
CONFIDENCE_ROLES = {"weight": ("confidence_head.proj.weight", "conf_proj.weight"),
                    "bias": ("confidence_head.proj.bias", "conf_proj.bias")}
#: a DFlash2 drafter's hyper-parameters (DFlashConfig fields; dflash_config keys and dflash.* GGUF keys of the
#: same names)
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")

@dataclass(frozen=True)
class Key:
    """A hyper-parameter in both formats: its DFlashConfig field, its GGUF metadata key and value type
    (a GGUFWriter add_* suffix), and its config.json key (dotted inside dflash_config; None: the HF side
    is derived, see hf_format). Optional keys are written only when set (booleans: when true)."""

    field: str
    gguf: str
    kind: str
    hf: str | None
    optional: bool = False
    legacy: str | None = None  # the key Strata wrote before llama.cpp had one, still read


# In GGUF writing order. llama.cpp's keys first; strata.dflash.* hold facts of the reference
# config.json that llama.cpp has no key for.
KEYS = [
    Key("num_layers", "dflash.block_count", "uint32", "num_hidden_layers"),
    Key("context_length", "dflash.context_length", "uint32", "max_position_embeddings"),
    Key("hidden_size", "dflash.embedding_length", "uint32", "hidden_size"),
    Key("intermediate_size", "dflash.feed_forward_length", "uint32", "intermediate_size"),
    Key("num_heads", "dflash.attention.head_count", "uint32", "num_attention_heads"),
    Key("num_kv_heads", "dflash.attention.head_count_kv", "uint32", "num_key_value_heads"),
    Key("head_dim", "dflash.attention.key_length", "uint32", "head_dim"),
    Key("head_dim", "dflash.attention.value_length", "uint32", None, optional=True),  # must equal key_length
    Key("rms_norm_eps", "dflash.attention.layer_norm_rms_epsilon", "float32", "rms_norm_eps"),
    Key("rope_theta", "dflash.rope.freq_base", "float32", "rope_theta"),
    Key("target_layer_ids", "dflash.target_layers", "int32_array", "dflash_config.target_layer_ids"),
    Key("block_size", "dflash.block_size", "uint32", "block_size"),
    Key("mask_token_id", "tokenizer.ggml.mask_token_id", "uint32", "dflash_config.mask_token_id"),
    Key("num_target_layers", "strata.dflash.num_target_layers", "uint32", "num_target_layers", optional=True),
    Key("vocab_size", "strata.dflash.vocab_size", "uint32", "vocab_size", optional=True),
    Key("attention_bias", "strata.dflash.attention_bias", "bool", "attention_bias", optional=True),
    Key("input_embedding_scale", "dflash.embedding_scale", "float32", "input_embedding_scale", optional=True,
        legacy="strata.dflash.input_embedding_scale"),
    Key("output_multiplier", "dflash.logit_scale", "float32", "output_multiplier", optional=True,
        legacy="strata.dflash.output_multiplier"),
    Key("final_logit_softcapping", "dflash.final_logit_softcapping", "float32", "final_logit_softcapping",
        optional=True, legacy="strata.dflash.final_logit_softcapping"),
    Key("sliding_window", "dflash.attention.sliding_window", "uint32", "sliding_window", optional=True),
    Key("layer_types", "dflash.attention.sliding_window_pattern", "bool_array", "layer_types", optional=True),
    *(Key(f, f"dflash.{f}", "uint32", f"dflash_config.{f}", optional=True) for f in DFLASH2_FIELDS),
    Key("sample_from_anchor", "dflash.sample_from_anchor", "bool", "sample_from_anchor", optional=True),
    Key("has_confidence_head", "dflash.has_confidence_head", "bool", None, optional=True),
]
#: DSpark's booleans, written whenever set (llama.cpp takes an absent sample_from_anchor as true)
WRITTEN_WHEN_FALSE = ("sample_from_anchor", "has_confidence_head")
KEY = {k.gguf: k for k in KEYS}
#: llama.cpp DFlash metadata that changes the computation in ways Strata does not implement: key ->
#: (the value that means "as Strata computes", what the key is)
REFUSED_KEYS = {
    "dflash.attention.value_scale": (None, "an attention value scale"),
    "dflash.attention.scale": (None, "an attention scale other than head_dim^-0.5"),
    "dflash.hidden_act": ("silu", "an MLP activation other than SiLU"),
    "dflash.attention.causal": (False, "causal attention inside the block"),
    "dflash.hyper_connection_count": (None, "DeepSeek-V4 hyper-connections (DSpark)"),
}
K_TARGET_LAYERS = "dflash.target_layers"
K_MASK = "tokenizer.ggml.mask_token_id"
K_HEADS = "dflash.attention.head_count"
K_KV_HEADS = "dflash.attention.head_count_kv"
K_KEY_LEN = "dflash.attention.key_length"
K_VALUE_LEN = "dflash.attention.value_length"

# Variants recognised and refused: (substring of a tensor name, what it means)
REFUSED_VARIANTS = [
    ("embed_tokens", "a drafter with its own embedding"),
    ("token_embd", "a drafter with its own embedding"),
    ("lm_head", "a drafter with its own LM head"),
    ("d2t", "a drafter with a draft-to-target vocabulary map (d2t/t2d)"),
    ("t2d", "a drafter with a draft-to-target vocabulary map (d2t/t2d)"),
]


#: the Hugging Face architectures read (llama.cpp's converter takes both as its DFlash model)
HF_ARCHITECTURES = ("DFlashDraftModel", "DFlash2DraftModel", "DSparkDraftModel", "Qwen3DSparkModel")


def default_target_layers(n: int, num_target_layers: int) -> list[int]:
    """The reference rule (HF ids) when a config names no taps."""
    if n == 1:
        return [num_target_layers // 2]
    return [round(1 + i * (num_target_layers - 4) / (n - 1)) for i in range(n)]


MAX_LAYERS = 1024  # a drafter is a few layers; a corrupt count must not size the tensor table


@dataclass
class DFlashConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]  # HF convention: feature l = output of target decoder layer l
    target_hidden_size: int  # derived from fc's shape when not given
    context_length: int = 32768
    num_target_layers: int | None = None
    vocab_size: int | None = None
    attention_bias: bool = False
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    input_embedding_scale: float | None = None
    output_multiplier: float | None = None
    final_logit_softcapping: float | None = None
    conv_kernel_size: int | None = None  # DFlash2: the dynamic grouped causal convolutions' taps
    conv_group_size: int | None = None  # channels sharing a dynamic kernel
    selector_rank: int | None = None  # the candidate selector's codebooks' rank
    selector_top_k: int | None = None  # candidates per slot the selector chooses among
    markov_rank: int | None = None  # DSpark: the Markov head's rank (from its tensors)
    sample_from_anchor: bool | None = None  # DSpark: the anchor's own slot drafts the first token
    has_confidence_head: bool | None = None  # DSpark: conf_proj is there
    extra: dict = field(default_factory=dict)

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    @property
    def variant(self) -> str:
        if self.markov_rank is not None:
            return "dspark"
        return "dflash2" if self.conv_kernel_size is not None else "dflash"

    @property
    def anchor_drafts(self) -> bool:
        """Whether the block's first slot (the anchor's) drafts the first candidate (DSpark's default)."""
        return self.variant == "dspark" and self.sample_from_anchor is not False

    def set_dspark(self, names, shapes: dict, where: str) -> None:
        """A DSpark drafter's rank and heads, from its tensors (by Hugging Face name); none: not DSpark."""
        w1 = MARKOV_ROLES["w1"][0]
        if w1 not in names:
            return
        if len(shapes[w1]) != 2:
            raise ArtifactError(f"{where}: tensor '{w1}' must be 2-D [vocab, rank], got {list(shapes[w1])}")
        self.markov_rank = int(shapes[w1][1])
        self.has_confidence_head = CONFIDENCE_ROLES["weight"][0] in names
        if self.sample_from_anchor is None:
            self.sample_from_anchor = True
        if not isinstance(self.vocab_size, int):
            raise ArtifactError(f"{where}: DSpark's Markov head needs vocab_size")

    def validate(self, where: str) -> None:
        for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "target_hidden_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ArtifactError(f"{where}: {name} must be a positive integer, got {v!r}")
        if self.num_layers > MAX_LAYERS:
            raise ArtifactError(f"{where}: num_layers {self.num_layers} is not a drafter's (at most {MAX_LAYERS})")
        if self.num_heads % self.num_kv_heads:
            raise ArtifactError(f"{where}: head count {self.num_heads} is not a multiple of kv head count "
                                f"{self.num_kv_heads}")
        if not isinstance(self.block_size, int) or self.block_size < 2:
            raise ArtifactError(f"{where}: block_size must be an integer >= 2, got {self.block_size!r}")
        if not self.target_layer_ids or any(not isinstance(t, int) or t < 0 for t in self.target_layer_ids):
            raise ArtifactError(f"{where}: target layers must be a non-empty list of layer ids >= 0, "
                                f"got {self.target_layer_ids!r}")
        if not isinstance(self.mask_token_id, int) or self.mask_token_id < 0:
            raise ArtifactError(f"{where}: mask_token_id must be an integer >= 0, got {self.mask_token_id!r}")
        if not (isinstance(self.rms_norm_eps, float) and 0 < self.rms_norm_eps < 1):
            raise ArtifactError(f"{where}: rms_norm_eps must be in (0, 1), got {self.rms_norm_eps!r}")
        if not (isinstance(self.rope_theta, float) and self.rope_theta > 1):
            raise ArtifactError(f"{where}: rope theta must be > 1, got {self.rope_theta!r}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers or any(
                    t not in ("full_attention", "sliding_attention") for t in self.layer_types):
                raise ArtifactError(f"{where}: layer_types must list full_attention/sliding_attention for each of "
                                    f"the {self.num_layers} layers, got {self.layer_types!r}")
            if "sliding_attention" in self.layer_types and not (
                    isinstance(self.sliding_window, int) and self.sliding_window > 0):
                raise ArtifactError(f"{where}: sliding_attention layers need a positive sliding_window")
        self.validate_dflash2(where)

    def validate_dflash2(self, where: str) -> None:
        values = {f: getattr(self, f) for f in DFLASH2_FIELDS}
        if all(v is None for v in values.values()):
            return
        for name, v in values.items():
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ArtifactError(f"{where}: DFlash2 needs {name} as a positive integer, got {v!r}")
        if self.hidden_size % self.conv_group_size:
            raise ArtifactError(f"{where}: conv_group_size {self.conv_group_size} does not divide hidden_size "
                                f"{self.hidden_size}")
        k = self.selector_top_k
        if self.hidden_size < k * (k + 1):  # llama.cpp packs a slot's candidates and k x k scores in a row
            raise ArtifactError(f"{where}: selector_top_k {k} needs hidden_size >= {k * (k + 1)} (llama.cpp's "
                                f"limit), got {self.hidden_size}")
        if not isinstance(self.vocab_size, int) or self.vocab_size < k:
            raise ArtifactError(f"{where}: DFlash2's codebooks need vocab_size (at least selector_top_k {k}), got "
                                f"{self.vocab_size!r}")


def expected_tensors(cfg: DFlashConfig, naming: str = "hf") -> dict[str, tuple]:
    """name -> shape in PyTorch order (out, in) for every tensor the artifact must hold."""
    col = 0 if naming == "hf" else 1
    h, i, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    layer_shapes = {"attn_norm": (h,), "q": (q, h), "k": (kv, h), "v": (kv, h), "o": (h, q), "q_norm": (hd,),
                    "k_norm": (hd,), "ffn_norm": (h,), "gate": (i, h), "up": (i, h), "down": (h, i)}
    bias_shapes = {"q_bias": (q,), "k_bias": (kv,), "v_bias": (kv,), "o_bias": (h,)}
    out = {}
    for n in range(cfg.num_layers):
        prefix = f"layers.{n}." if naming == "hf" else f"blk.{n}."
        for role, names in LAYER_ROLES.items():
            out[prefix + names[col]] = layer_shapes[role]
        if cfg.attention_bias:
            for role, names in BIAS_ROLES.items():
                out[prefix + names[col]] = bias_shapes[role]
    globals_ = {"fc": (h, cfg.num_taps * cfg.target_hidden_size), "hidden_norm": (h,), "norm": (h,)}
    for role, names in GLOBAL_ROLES.items():
        out[names[col]] = globals_[role]
    if cfg.variant == "dflash2":
        k, groups = cfg.conv_kernel_size, h // cfg.conv_group_size
        conv = {"base": (2, k, h), "proj": (2 * k * groups, h)}
        for n in range(cfg.num_layers):
            prefix = f"layers.{n}." if naming == "hf" else f"blk.{n}."
            for role, names in CONV_ROLES.items():
                out[prefix + names[col]] = conv[role.rsplit("_", 1)[1]]
        codebook = (cfg.vocab_size, cfg.selector_rank)
        selector = {"predecessor": codebook, "successor": codebook, "hidden": (cfg.selector_rank, h)}
        for role, names in SELECTOR_ROLES.items():
            out[names[col]] = selector[role]
    if cfg.variant == "dspark":
        for names in MARKOV_ROLES.values():
            out[names[col]] = (cfg.vocab_size, cfg.markov_rank)
        if cfg.has_confidence_head:
            conf = {"weight": (1, h + cfg.markov_rank), "bias": (1,)}
            for role, names in CONFIDENCE_ROLES.items():
                out[names[col]] = conf[role]
    return out


def _rename(name: str, to_gguf: bool) -> str:
    src, dst = (0, 1) if to_gguf else (1, 0)
    prefixes = ("layers.", "blk.")
    if name.startswith(prefixes[src]):
        _, n, rest = name.split(".", 2)
        for pair in [*LAYER_ROLES.values(), *BIAS_ROLES.values(), *CONV_ROLES.values()]:
            if rest == pair[src]:
                return f"{prefixes[dst]}{n}.{pair[dst]}"
        return name
    for pair in [*GLOBAL_ROLES.values(), *SELECTOR_ROLES.values(), *MARKOV_ROLES.values(),
                 *CONFIDENCE_ROLES.values()]:
        if name == pair[src]:
            return pair[dst]
    return name


def gguf_to_hf_name(name: str) -> str:
    """A llama.cpp tensor name as its Hugging Face name (unknown and HF names pass through)."""
    return _rename(name, to_gguf=False)


def hf_to_gguf_name(name: str) -> str:
    return _rename(name, to_gguf=True)


def refuse_variants(names, where: str, architectures=None) -> None:
    for arch in architectures or []:
        if arch not in HF_ARCHITECTURES:
            raise ArtifactError(f"{where}: architecture {arch!r} drafters are not supported (expected "
                                f"{' or '.join(HF_ARCHITECTURES)})")
    for name in names:
        stem = name.split(".")
        for needle, what in REFUSED_VARIANTS:
            if needle in stem or any(part.startswith(needle) for part in stem):
                raise ArtifactError(f"{where}: tensor '{name}' belongs to {what}, which is not supported")
        if name in ("output.weight",):
            raise ArtifactError(f"{where}: tensor '{name}' belongs to a drafter with its own LM head, "
                                "which is not supported")


#: what DFlash2's tensors are, by a part of their names in either format
DFLASH2_PARTS = {"attention_conv": "convolutional attention", "attn_conv": "convolutional attention",
                 "mlp_conv": "convolutional MLP", "ffn_conv": "convolutional MLP",
                 "candidate_selector": "candidate selector", "selector_": "candidate selector"}
#: DSpark's, likewise
DSPARK_PARTS = {"markov": "Markov head", "confidence_head": "confidence head", "conf_proj": "confidence head"}


def refuse_stray_variants(names, cfg: DFlashConfig, where: str) -> None:
    """DFlash2's tensors in a drafter whose config lacks DFlash2's hyper-parameters, DSpark's in one without its
    Markov head's first matrix (they cannot be run)."""
    for name in names:
        what = next((w for part, w in DFLASH2_PARTS.items() if part in name), None)
        if what and cfg.variant != "dflash2":
            raise ArtifactError(f"{where}: tensor '{name}' belongs to DFlash2 ({what}), but the config has none of "
                                f"DFlash2's {', '.join(DFLASH2_FIELDS)}")
        what = next((w for part, w in DSPARK_PARTS.items() if part in name), None)
        if what and cfg.variant != "dspark":
            raise ArtifactError(f"{where}: tensor '{name}' belongs to DSpark ({what}), but the drafter has no "
                                f"{MARKOV_ROLES['w1'][0]}")


def check_tensor_set(names, expected: dict, where: str) -> None:
    present = set(names)
    missing = [n for n in expected if n not in present]
    unexpected = sorted(present - set(expected))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
        if unexpected:
            parts.append(f"unexpected {', '.join(unexpected[:8])}{' ...' if len(unexpected) > 8 else ''}")
        raise ArtifactError(f"{where}: expected exactly {len(expected)} tensors; " + "; ".join(parts))


def f32(x: float) -> float:
    """The shortest decimal that reads back as the same float32 (1e-06, not 9.99999997e-07): GGUF stores
    float32, so both formats hold the values it can."""
    return float(str(np.float32(x)))


@dataclass
class Artifact:
    """A DFlash drafter as read from either format (artifact.load_artifact)."""

    cfg: DFlashConfig
    tensors: dict[str, torch.Tensor]  # Hugging Face names; quantized GGUF tensors dequantized (float32)
    source: Path
    fmt: str  # "gguf" or "hf"
    types: dict[str, str] = field(default_factory=dict)  # GGUF type names (GGUF files), else torch dtypes
    vocab: Vocab | None = None  # the vocabulary a GGUF file carries
    blocks: dict = field(default_factory=dict)  # quantized tensors' GGUF blocks: name -> (GGML type, uint8 rows)

    @property
    def parameter_count(self) -> int:
        return sum(t.numel() for t in self.tensors.values())
