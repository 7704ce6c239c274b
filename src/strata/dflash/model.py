"""The DFlash drafter's own network: fusion of the target's taps (fc + hidden_norm), its decoder layers
and its final norm. It has no embedding and no LM head: the target lends both.

One forward serves inference (a block at its positions, its K/V in the drafter's own cache cells) and
training (many blocks of a batch packed after the context cells); the caller builds the masks."""

from __future__ import annotations

import torch
from torch import nn

from ..cache import KVCache
from ..layers.modules import MLP, Attention, DecoderLayer, Linear, RMSNorm, Step, run_layers
from ..layers.rotary import RopeConfig, RotaryTable
from ..models.decoder import layer_layout
from .contract import CONFIDENCE_ROLES, CONV_ROLES, MARKOV_ROLES, SELECTOR_ROLES, DFlashConfig, expected_tensors
from .dflash2 import CandidateSelector, ConvolvedLayer
from .dspark import MarkovHead


class DFlashModel(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.cfg = cfg
        self.fc = Linear(cfg.num_taps * cfg.target_hidden_size, cfg.hidden_size)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        types = cfg.layer_types or ["full_attention"] * cfg.num_layers
        layer = ConvolvedLayer if cfg.variant == "dflash2" else DecoderLayer
        self.layers = nn.ModuleList(
            layer(cfg, j, Attention(j, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                    cfg.rms_norm_eps, cfg.attention_bias, qk_norm=True,
                                    window=cfg.sliding_window if t == "sliding_attention" else None),
                  MLP(cfg.hidden_size, cfg.intermediate_size))
            for j, t in enumerate(types))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.variant == "dflash2":
            self.candidate_selector = CandidateSelector(cfg.vocab_size, cfg.selector_rank, cfg.hidden_size,
                                                        cfg.selector_top_k)
        if cfg.variant == "dspark":
            self.markov_head = MarkovHead(cfg.vocab_size, cfg.markov_rank)
            if cfg.has_confidence_head:  # read by --draft-p-min and --spec auto (dspark.confidence)
                self.confidence_head = nn.Module()
                self.confidence_head.proj = nn.Linear(cfg.hidden_size + cfg.markov_rank, 1)
        self.rotary: RotaryTable | None = None

    @property
    def windows(self) -> set:
        """The attention windows of the layers (None: the whole context)."""
        return {layer.mixer.window for layer in self.layers}

    def make_cache(self, cells: int, batch: int | None = None) -> KVCache:
        cfg = self.cfg
        dev, dtype = self.fc.weight.device, self.fc.weight.dtype
        if self.rotary is None:
            self.rotary = RotaryTable(cfg.head_dim, RopeConfig(cfg.rope_theta), dev, dtype)
        self.rotary.ensure(cells)
        return KVCache(cfg.num_layers, cells, cfg.num_kv_heads, cfg.head_dim, dev, dtype, batch)

    def store_context(self, taps: torch.Tensor, step: Step, cache: KVCache) -> None:
        """Context features of committed rows -> every layer's K/V at the step's cells. No
        input_layernorm on this path (the reference's)."""
        kernels = step.kernels
        c = kernels.rms_norm(self.fc(taps.to(self.fc.weight.dtype), kernels), self.hidden_norm.weight,
                             self.hidden_norm.eps)
        c = step.probed(-1, "fused", c)
        step = step.for_layers(self.rotary.at(step.positions))
        for layer in self.layers:
            layer.mixer.store_context(c, step, cache.layers[layer.index])

    def forward(self, x: torch.Tensor, step: Step, cache: KVCache) -> torch.Tensor:
        """Block rows x [..., T, hidden] -> final-normed hidden states. step.masks holds a mask for each
        of the layers' windows (DFlashModel.windows)."""
        step = step.for_layers(self.rotary.at(step.positions))
        x, pending, _ = run_layers(self.layers, x, step, cache)
        norm = self.norm
        h = step.kernels.rms_norm(x, norm.weight, norm.eps) if pending is None else \
            step.kernels.add_rms_norm(x, pending, norm.weight, norm.eps)[1]
        return step.probed(-1, "final_norm", h)


def scaled_logits(cfg: DFlashConfig, logits: torch.Tensor) -> torch.Tensor:
    """The drafter's logits from the head's: output_multiplier, then the softcap (DSpark's stay raw, as llama.cpp
    runs them)."""
    if cfg.variant == "dspark":
        return logits
    if cfg.output_multiplier is not None:
        logits = logits * cfg.output_multiplier
    if cfg.final_logit_softcapping is not None:
        logits = torch.tanh(logits / cfg.final_logit_softcapping) * cfg.final_logit_softcapping
    return logits


def hf_layout(cfg: DFlashConfig) -> dict[str, list[tuple[str, tuple]]]:
    """The reference checkpoint's tensors (Hugging Face names) packed into DFlashModel's parameters."""
    h = cfg.hidden_size
    out = {"fc.weight": [("fc.weight", (h, cfg.num_taps * cfg.target_hidden_size))],
           "hidden_norm.weight": [("hidden_norm.weight", (h,))], "norm.weight": [("norm.weight", (h,))]}
    for n in range(cfg.num_layers):
        out.update(layer_layout(f"layers.{n}.", f"layers.{n}.", h, cfg.intermediate_size, cfg.num_heads,
                                cfg.num_kv_heads, cfg.head_dim, cfg.attention_bias, qk_norm=True))
    # DFlash2's convolutions and selector, DSpark's heads: parameters of the checkpoint's names
    extra = {f"layers.{n}.{hf}" for n in range(cfg.num_layers) for hf, _ in CONV_ROLES.values()} | \
        {hf for roles in (SELECTOR_ROLES, MARKOV_ROLES, CONFIDENCE_ROLES) for hf, _ in roles.values()}
    out.update({name: [(name, shape)] for name, shape in expected_tensors(cfg).items() if name in extra})
    return out
