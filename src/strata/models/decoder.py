"""The decoder-only causal LM every target family builds: embedding, decoder layers, final norm, LM
head, and taps of the residual stream. One forward serves prefill, a 1-token decode, a verify window
and training batches; the model runner decides shapes, cells and kernels (engine/runner.py)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import nn

from ..cache import KVCache
from ..errors import StrataError
from ..layers.kernels import EAGER, Kernels
from ..layers.modules import MLP, Attention, DecoderLayer, Linear, RMSNorm, Step, causal_masks, run_layers
from ..layers.moe import SparseMoE
from ..layers.quant import QuantWeight
from ..layers.rotary import RotaryTable
from .config import ModelConfig, dense_config, must


#: the tap of the final norm's output, what the LM head reads (an MTP block's input), beside layer ids
FINAL_NORM = -1


@dataclass
class ForwardOut:
    logits: torch.Tensor | None  # [..., T, vocab] float32 ([..., 1, vocab] for "last", None for "none")
    taps: torch.Tensor | None  # [..., T, len(taps) * hidden]


class DecoderLM(nn.Module):
    def __init__(self, cfg: ModelConfig, layers: list[nn.Module]):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)
        self.rotary: RotaryTable | None = None
        self.mtp: nn.Module | None = None  # the MTP block, where loaded (models/mtp.py)
        self.expert_plan = None  # a mixture-of-experts target's placement (models/placement.py)
        self.dequantized: dict[str, tuple[str, int]] = {}  # GGUF tensors the kernels do not take: name -> (type, bytes)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def tie_weights_(self) -> "DecoderLM":
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        return self

    def make_cache(self, cells: int, batch: int | None = None, rows: int = 16) -> KVCache:
        """A cache of `cells` positions (and the rotary table to cover them), each layer's part as its mixer
        makes it (a recurrent mixer keeps the states of a forward's last `rows` positions: its verify window)."""
        cfg = self.cfg
        cache = KVCache(cfg.num_layers, cells, cfg.num_kv_heads, cfg.head_dim, self.device, self.dtype, batch)
        self.ensure_rope(cells)  # after the cache, the larger of the two: one that cannot fit is refused first
        for layer in self.layers:
            cache.layers[layer.index] = layer.mixer.new_state(cache, rows, batch)
        return cache

    def ensure_rope(self, cells: int) -> None:
        """The rotary table covers positions [0, cells) (an MTP block's cache may reach past the target's)."""
        if self.rotary is None:
            self.rotary = RotaryTable(self.cfg.head_dim, self.cfg.rope, self.device, self.dtype)
        self.rotary.ensure(cells)

    @property
    def host_experts(self) -> int:
        """Experts an expert cache left in host memory (models/placement.py): each forward reads its routing
        on the host, so a captured step is a CUDA graph per stretch between sparse layers
        (layers/graph_breaks.py)."""
        return sum(layer.mlp.host_experts for layer in self.layers)

    @property
    def recurrent(self) -> bool:
        """Whether some layers carry a recurrent state (a tree cannot be verified through them)."""
        return any(layer.mixer.recurrent for layer in self.layers)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        w = self.embed_tokens.weight
        return w.embed(tokens) if isinstance(w, QuantWeight) else self.embed_tokens(tokens)

    def head(self, h: torch.Tensor, kernels: Kernels = EAGER) -> torch.Tensor:
        """Normed hidden states -> float32 logits; the drafter's head too (it has none of its own)."""
        return self.lm_head(h, kernels).float()

    def forward(self, tokens: torch.Tensor, step: Step, cache: KVCache, taps=(), logits: str = "all") -> ForwardOut:
        """tokens [..., T] at step.positions: their K/V are written to the cache, every row attends over
        the cells up to its position (or as step.masks says: a tree's rows see their ancestors), and `taps` (HF
        layer ids: feature l is the residual stream after decoder layer l; FINAL_NORM the final norm's output) come
        back concatenated. logits: "all" rows, the "last" row, or "none"."""
        step = step.for_layers(self.rotary.at(step.positions), causal_masks(step) if step.masks is None else None)
        taps = list(taps or ())
        wanted = {layer: slot for slot, layer in enumerate(t for t in taps if t != FINAL_NORM)}
        x, pending, tapped = run_layers(self.layers, self.embed(tokens), step, cache, wanted)
        norm = self.norm
        if FINAL_NORM in taps:
            tapped.insert(taps.index(FINAL_NORM), step.kernels.rms_norm(x if pending is None else x + pending,
                                                                        norm.weight, norm.eps))
        out = None
        if logits != "none":
            into = self.lm_head.weight if logits == "all" or x.shape[-2] == 1 else None  # the head reads them all
            h = step.kernels.rms_norm(x, norm.weight, norm.eps, into) if pending is None else \
                step.kernels.add_rms_norm(x, pending, norm.weight, norm.eps, into)[1]
            last = logits == "last" and into is None  # with into, "last" is the one row there is
            out = self.head(h[..., -1:, :] if last else h, step.kernels)
        return ForwardOut(out, torch.cat(tapped, dim=-1) if tapped else None)

    def forward_mtp(self, tokens: torch.Tensor, hidden: torch.Tensor, step: Step, cache: KVCache) -> torch.Tensor:
        """The MTP block over tokens [T] at step.positions, each with the final normed hidden state of the
        position before it [T, hidden] (the target's, or the block's own when chaining): its normed output, for
        head(); its K/V written to `cache` (the block's own)."""
        step = step.for_layers(self.rotary.at(step.positions), causal_masks(step) if step.masks is None else None)
        return self.mtp(self.embed(tokens), hidden, step, cache)

    def forward_batch(self, tokens: torch.Tensor, taps=(), logits: bool = True) -> ForwardOut:
        """A causal pass over a batch [B, T] from position 0 (training, batched feature tables)."""
        b, t = tokens.shape
        positions = torch.arange(t, device=tokens.device)
        return self(tokens, Step(positions, t), self.make_cache(t, batch=b), taps, "all" if logits else "none")


def layer_layout(hf: str, param: str, hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int,
                 bias: bool, qk_norm: bool) -> dict[str, list[tuple[str, tuple]]]:
    """A Llama-lineage decoder layer's checkpoint tensors (names under `hf`) packed into a DecoderLayer's
    parameters (names under `param`)."""
    q, kv = heads * head_dim, kv_heads * head_dim
    out = {
        param + "input_layernorm.weight": [(hf + "input_layernorm.weight", (hidden,))],
        param + "self_attn.qkv_proj.weight": [(hf + "self_attn.q_proj.weight", (q, hidden)),
                                              (hf + "self_attn.k_proj.weight", (kv, hidden)),
                                              (hf + "self_attn.v_proj.weight", (kv, hidden))],
        param + "self_attn.o_proj.weight": [(hf + "self_attn.o_proj.weight", (hidden, q))],
        param + "post_attention_layernorm.weight": [(hf + "post_attention_layernorm.weight", (hidden,))],
        param + "mlp.gate_up_proj.weight": [(hf + "mlp.gate_proj.weight", (intermediate, hidden)),
                                            (hf + "mlp.up_proj.weight", (intermediate, hidden))],
        param + "mlp.down_proj.weight": [(hf + "mlp.down_proj.weight", (hidden, intermediate))],
    }
    if bias:
        out[param + "self_attn.qkv_proj.bias"] = [(hf + "self_attn.q_proj.bias", (q,)),
                                                  (hf + "self_attn.k_proj.bias", (kv,)),
                                                  (hf + "self_attn.v_proj.bias", (kv,))]
        out[param + "self_attn.o_proj.bias"] = [(hf + "self_attn.o_proj.bias", (hidden,))]
    if qk_norm:
        out[param + "self_attn.q_norm.weight"] = [(hf + "self_attn.q_norm.weight", (head_dim,))]
        out[param + "self_attn.k_norm.weight"] = [(hf + "self_attn.k_norm.weight", (head_dim,))]
    return out


def dense_hf_layout(cfg: ModelConfig) -> dict[str, list[tuple[str, tuple]]]:
    """A dense decoder's Hugging Face checkpoint (model.* names, lm_head unless tied)."""
    h = cfg.hidden_size
    out = {"embed_tokens.weight": [("model.embed_tokens.weight", (cfg.vocab_size, h))],
           "norm.weight": [("model.norm.weight", (h,))]}
    for n in range(cfg.num_layers):
        out.update(layer_layout(f"model.layers.{n}.", f"layers.{n}.", h, cfg.intermediate_size, cfg.num_heads,
                                cfg.num_kv_heads, cfg.head_dim, cfg.attention_bias, cfg.qk_norm))
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = [("lm_head.weight", (cfg.vocab_size, h))]
    return out


def attention(cfg: ModelConfig, index: int, gated: bool = False) -> Attention:
    """A target layer's attention as its config describes it."""
    return Attention(index, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps,
                     cfg.attention_bias, cfg.qk_norm, gated)


def feed_forward(cfg: ModelConfig, index: int) -> nn.Module:
    """A target layer's MLP: its mixture of experts where the config makes the layer sparse, else the dense
    SwiGLU."""
    moe = cfg.moe
    if moe is not None and index in moe.layers:
        return SparseMoE(cfg.hidden_size, moe.intermediate, moe.experts, moe.top_k, moe.renormalize, moe.shared)
    return MLP(cfg.hidden_size, cfg.intermediate_size)


def gguf_value(kv: dict, key: str, where: str, default, kind: str, types, ok):
    """A metadata value of one of `types` (never a bool) for which ok(value) holds, else a one-line error
    naming the key; missing, the default, unless that is None."""
    v = kv.get(key, default)
    if v is None:
        raise StrataError(f"{where}: metadata key '{key}' is missing (expected {kind})")
    must(v, where, f"metadata key '{key}'", kind, lambda v: not isinstance(v, bool) and isinstance(v, types) and ok(v))
    return v


def gguf_count(kv: dict, key: str, where: str, default=None) -> int:
    """A positive count (as llama.cpp reads it, a 32-bit integer) of metadata key `key`."""
    return gguf_value(kv, key, where, default, "a positive 32-bit integer", int, lambda v: 0 < v < 2 ** 31)


def dense_gguf_config(fam, kv: dict, tensors: dict, where: str) -> ModelConfig:
    """A dense decoder's hyper-parameters from llama.cpp's `{arch}.*` keys and its tensor table (vocabulary,
    tied head, biases, RoPE factors): the keys llama.cpp requires are required here, every value is
    checked, and keys that would change the computation in ways Strata does not implement are refused by
    name."""
    from ..gguf_names import ROPE_FACTORS
    from ..layers.rotary import RopeConfig

    a = fam.gguf_arch

    def count(key: str, default=None) -> int:
        return gguf_count(kv, f"{a}.{key}", where, default)

    def positive(key: str, default=None) -> float:
        return float(gguf_value(kv, f"{a}.{key}", where, default, "a positive finite number", (int, float),
                                lambda v: math.isfinite(v) and v > 0))

    for key, what, plain in ((f"{a}.expert_count", "mixture-of-experts layers", (0,)),
                             (f"{a}.attention.sliding_window", "sliding-window attention", (0,)),
                             (f"{a}.rope.scaling.type", "RoPE scaling", ("none",)),
                             (f"{a}.attention.causal", "non-causal attention", (True,))):
        if key in kv and not any(type(kv[key]) is type(p) and kv[key] == p for p in plain):
            raise StrataError(f"{where}: metadata key '{key}' = {kv[key]!r} asks for {what}, which is not supported")
    hidden, heads, layers = count("embedding_length"), count("attention.head_count"), count("block_count")
    kv_heads = count("attention.head_count_kv", heads)
    if heads % kv_heads:
        raise StrataError(f"{where}: head count {heads} is not a multiple of the kv head count {kv_heads} "
                          f"('{a}.attention.head_count_kv')")
    if f"{a}.attention.key_length" not in kv and hidden % heads:
        raise StrataError(f"{where}: embedding length {hidden} is not a multiple of the head count {heads}, and "
                          f"'{a}.attention.key_length' is missing")
    head_dim = count("attention.key_length", hidden // heads)
    if count("attention.value_length", head_dim) != head_dim:
        raise StrataError(f"{where}: metadata key '{a}.attention.value_length' = {kv[f'{a}.attention.value_length']} "
                          f"differs from the key length {head_dim}, which is not supported")
    if count("rope.dimension_count", head_dim) != head_dim:
        raise StrataError(f"{where}: metadata key '{a}.rope.dimension_count' = {kv[f'{a}.rope.dimension_count']} "
                          f"asks for partial RoPE (head dim {head_dim}), which is not supported")
    blocks = {int(n.split(".")[1]) for n in tensors if n.startswith("blk.") and n.split(".")[1].isdigit()}
    if len(blocks) != layers or max(blocks) != layers - 1:
        raise StrataError(f"{where}: metadata key '{a}.block_count' = {layers}, but the file's tensors are of "
                          f"{len(blocks)} layers ({', '.join(f'blk.{n}' for n in sorted(blocks)[:4])}"
                          f"{' ...' if len(blocks) > 4 else ''})")
    embd = tensors.get("token_embd.weight")
    if embd is None or len(embd.shape) != 2:
        raise StrataError(f"{where}: missing tensor 'token_embd.weight'" if embd is None else
                          f"{where}: tensor 'token_embd.weight' has {len(embd.shape)} dimensions, expected 2")
    return ModelConfig(
        family=fam.name, vocab_size=embd.shape[1], hidden_size=hidden, intermediate_size=count("feed_forward_length"),
        num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        rms_norm_eps=positive("attention.layer_norm_rms_epsilon"), max_position_embeddings=count("context_length"),
        rope=RopeConfig(positive("rope.freq_base", 10000.0), factors=rope_factors(fam, tensors.get(ROPE_FACTORS),
                                                                                  head_dim, where)),
        tie_word_embeddings="output.weight" not in tensors, attention_bias="blk.0.attn_q.bias" in tensors,
        qk_norm=fam.qk_norm, bos_token_id=kv.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=[kv[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in kv])


def rope_factors(fam, info, head_dim: int, where: str) -> list[float] | None:
    """Llama 3.1+'s RoPE factors (the rope_freqs tensor: a divisor per frequency, positive and finite), in
    a family that reads them."""
    from .. import gguf_file
    from ..gguf_names import ROPE_FACTORS

    if info is None:
        return None
    if not fam.gguf_rope_factors:
        raise StrataError(f"{where}: tensor '{ROPE_FACTORS}' (RoPE factors) is not part of llama.cpp's "
                          f"{fam.gguf_arch} layout")
    factors = gguf_file.values(info, (head_dim // 2,), where).float()
    if not (torch.isfinite(factors).all() and (factors > 0).all()):
        raise StrataError(f"{where}: tensor '{ROPE_FACTORS}' holds factors that are not positive and finite")
    return factors.tolist()


class DenseFamily:
    """A decoder of the Llama lineage in transformers' checkpoint layout (registry.Family): subclasses name
    it, say whether it has q/k norms and which RoPE scalings it reads, and override the blocks of layers
    that differ (mixer, feed_forward) and the layouts."""

    name = ""
    architectures: tuple[str, ...] = ()
    model_types: tuple[str, ...] = ()
    gguf_arch = ""

    qk_norm = False
    rope_scalings: tuple[str, ...] = ("llama3",)

    def config(self, hf, where):
        return dense_config(hf, where, self.name, qk_norm=self.qk_norm, rope_scalings=self.rope_scalings)

    def build(self, cfg):
        return DecoderLM(cfg, [DecoderLayer(cfg, n, self.mixer(cfg, n), self.feed_forward(cfg, n))
                               for n in range(cfg.num_layers)])

    def mixer(self, cfg, index):
        """Layer `index`'s mixer (a family with other blocks overrides it)."""
        return attention(cfg, index)

    def feed_forward(self, cfg, index):
        return feed_forward(cfg, index)

    def hf_layout(self, cfg):
        return dense_hf_layout(cfg)

    def finish(self, state, cfg):
        return state

    gguf_qk_permuted = False  # whether llama.cpp's converter interleaved each head's q/k rows
    gguf_rope_factors = False  # whether llama.cpp's layout of this family has the rope_freqs tensor

    def gguf_config(self, kv, tensors, where):
        return dense_gguf_config(self, kv, tensors, where)

    def gguf_layout(self, cfg):
        """dense_hf_layout under llama.cpp's names; q/k rows un-interleaved where the converter did that."""
        from ..gguf_names import target_name

        heads = {"self_attn.q_proj.weight": cfg.num_heads, "self_attn.k_proj.weight": cfg.num_kv_heads}

        def undo(hf: str):
            n = next((h for k, h in heads.items() if hf.endswith(k)), None)
            return functools.partial(unpermute, heads=n) if n and self.gguf_qk_permuted else None

        return {param: [(target_name(hf), shape, undo(hf)) for hf, shape in sources]
                for param, sources in dense_hf_layout(cfg).items()}


def unpermute(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's interleaving of q/k rows: per head its converter stores the two RoPE halves
    pairwise ([h0[0], h1[0], h0[1], ...]); NeoX rotate-half wants them as halves."""
    rows = t.shape[0]
    return t.reshape(heads, rows // heads // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)
