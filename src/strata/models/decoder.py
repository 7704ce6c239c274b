"""The target decoder (Qwen3 / Llama) with residual-stream feature taps."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..kv_cache import KVCache
from .config import ModelConfig, load_model_config
from .layers import ATTENTION, EAGER, CacheSlot, DecoderLayer, Kernels, RMSNorm, RotaryTable
from .weights import check_and_convert, read_safetensors


@dataclass
class ForwardOut:
    logits: torch.Tensor  # [T, vocab] float32 (or [1, vocab] with last_only)
    taps: torch.Tensor | None  # [T, len(tap_layers) * hidden]


def window_mask(start: int, length: int, device) -> torch.Tensor:
    """Causal mask of a window of `length` queries at positions start.. over keys 0..start+length-1."""
    q = torch.arange(start, start + length, device=device).unsqueeze(1)
    k = torch.arange(start + length, device=device).unsqueeze(0)
    return k <= q


class TargetDecoder(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(
                cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                cfg.rms_norm_eps, cfg.attention_bias, cfg.qk_norm,
            )
            for _ in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope: RotaryTable | None = None

    @property
    def device(self):
        return self.embed_tokens.weight.device

    @property
    def dtype(self):
        return self.embed_tokens.weight.dtype

    def ensure_rope(self, max_len: int) -> None:
        cfg = self.cfg
        if self.rope is None or self.rope.max_positions < max_len:
            self.rope = RotaryTable(
                cfg.head_dim, cfg.rope, max(max_len, cfg.max_position_embeddings), self.device, self.dtype,
                orig_max_pos=(cfg.rope.scaling or {}).get("original_max_position_embeddings", 8192),
            )

    def make_cache(self, max_len: int | None = None) -> KVCache:
        cfg = self.cfg
        max_len = max_len or cfg.max_position_embeddings
        self.ensure_rope(max_len)
        return KVCache(cfg.num_layers, max_len, cfg.num_kv_heads, cfg.head_dim, self.device, self.dtype)

    def fuse_(self) -> "TargetDecoder":
        """Inference layout: fused q/k/v and gate/up matrices (see Attention.fuse_)."""
        for layer in self.layers:
            layer.fuse_()
        return self

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head; also used by the drafter, whose head is the target's."""
        return self.lm_head(self.norm(h)).float()

    @torch.inference_mode()
    def forward(
        self, tokens: torch.Tensor, start: int, cache: KVCache, taps: list[int] | None = None, last_only: bool = False
    ) -> ForwardOut:
        """Run a window of tokens at positions start.. over the cache's cells < start.

        Prefill (start = 0), a 1-token decode step and a verify window are the same call. The window's
        K/V are written to cells start..start+T-1; `cache.length` is left for the caller to commit.
        `taps` are HF layer ids: feature l is the residual stream after decoder layer l."""
        n = tokens.shape[0]
        end = start + n
        if end > cache.max_len:
            raise ValueError(f"window ends at {end}, past the cache's {cache.max_len} cells")
        rope = self.rope.at(torch.arange(start, end, device=self.device))
        mask = window_mask(start, n, self.device)
        x = self.embed_tokens(tokens)
        wanted = {l: i for i, l in enumerate(taps or [])}
        tapped: list[torch.Tensor | None] = [None] * len(wanted)
        for li, layer in enumerate(self.layers):
            def keys_fn(k, v, li=li):
                cache.write(li, start, k, v)
                return cache.read(li, end)

            x = layer(x, rope, keys_fn, mask)
            if li in wanted:
                tapped[wanted[li]] = x
        if last_only:
            x = x[-1:]
        return ForwardOut(self.logits(x), torch.cat(tapped, dim=-1) if tapped else None)


    @torch.inference_mode()
    def forward_static(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                       taps: list[int] | None = None, kv_len: int | None = None,
                       attention: str = "grouped", kernels: Kernels = EAGER) -> ForwardOut:
        """The same window as `forward`, with shapes that do not depend on the position: the window's
        K/V are scattered into the cache at `positions` (a device tensor) and every query attends over
        the first `kv_len` cells (a length bucket, all cells by default) through a mask built on the
        device. No host value is read, so the call can be captured in a CUDA graph and replayed for any
        position below kv_len."""
        kv_len = kv_len or cache.max_len
        cells = torch.arange(kv_len, device=tokens.device)
        mask = cells.unsqueeze(0) <= positions.unsqueeze(1)
        attend_fn = ATTENTION[attention]
        rope = self.rope.at(positions)
        x = self.embed_tokens(tokens)
        wanted = {l: i for i, l in enumerate(taps or [])}
        tapped: list[torch.Tensor | None] = [None] * len(wanted)
        pending = None
        for li, layer in enumerate(self.layers):
            slot = CacheSlot(cache, li, positions, kv_len)
            x, pending = layer(x, rope, slot, mask, attention=attend_fn, kernels=kernels, pending=pending, defer=True)
            if li in wanted:
                tapped[wanted[li]] = x + pending
        _, h = kernels.add_rms_norm(x, pending, self.norm.weight, self.norm.eps)
        return ForwardOut(kernels.linear(h, self.lm_head.weight).float(), torch.cat(tapped, dim=-1) if tapped else None)

    def forward_batch(self, tokens: torch.Tensor, taps: list[int] | None = None, with_logits: bool = True):
        """Causal forward of a batch [B, T] without a cache (training and batched data generation).

        Returns (logits [B, T, V] or None, taps [B, T, n*H] or None)."""
        b, t = tokens.shape
        self.ensure_rope(t)
        rope = self.rope.at(torch.arange(t, device=tokens.device))
        mask = window_mask(0, t, tokens.device)
        x = self.embed_tokens(tokens)
        wanted = {l: i for i, l in enumerate(taps or [])}
        tapped: list[torch.Tensor | None] = [None] * len(wanted)
        for li, layer in enumerate(self.layers):
            x = layer(x, rope, lambda k, v: (k, v), mask)
            if li in wanted:
                tapped[wanted[li]] = x
        logits = self.lm_head(self.norm(x)) if with_logits else None
        return logits, (torch.cat(tapped, dim=-1) if tapped else None)

    @torch.no_grad()
    def continue_batch(self, prompts: torch.Tensor, new_tokens: int, pick) -> torch.Tensor:
        """Extend every row of prompts [B, P] by new_tokens, each chosen by pick(logits [B, V]) -> [B, 1],
        over a per-batch K/V cache (self-distillation data: the same tokens as re-running forward_batch on
        the growing rows, at a fraction of the cost)."""
        b, p = prompts.shape
        total = p + new_tokens
        self.ensure_rope(total)
        bufs: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(self.layers)
        rows, window, start = [prompts], prompts, 0
        for _ in range(new_tokens):
            end = start + window.shape[1]
            rope = self.rope.at(torch.arange(start, end, device=prompts.device))
            mask = window_mask(start, window.shape[1], prompts.device)
            x = self.embed_tokens(window)
            for li, layer in enumerate(self.layers):
                def keys_fn(k, v, li=li, start=start, end=end):
                    if bufs[li] is None:
                        bufs[li] = (k.new_empty(b, total, *k.shape[2:]), v.new_empty(b, total, *v.shape[2:]))
                    kb, vb = bufs[li]
                    kb[:, start:end], vb[:, start:end] = k, v
                    return kb[:, :end], vb[:, :end]

                x = layer(x, rope, keys_fn, mask)
            window = pick(self.logits(x[:, -1]))
            rows.append(window)
            start = end
        return torch.cat(rows, dim=1)


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple]:
    h, i, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    for n in range(cfg.num_layers):
        p = f"model.layers.{n}."
        shapes.update({
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        })
        if cfg.attention_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,), p + "self_attn.o_proj.bias": (h,)})
        if cfg.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)})
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return shapes


def load_target(model_dir: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32) -> TargetDecoder:
    model_dir = Path(model_dir)
    cfg = load_model_config(model_dir)
    raw = read_safetensors(model_dir)
    weights = check_and_convert(raw, expected_tensors(cfg), dtype, model_dir)
    state = {k.removeprefix("model."): v for k, v in weights.items()}
    if cfg.tie_word_embeddings:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    with torch.device("meta"):
        model = TargetDecoder(cfg)
    model.load_state_dict(state, assign=True, strict=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model = model.to(device).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model.fuse_()
