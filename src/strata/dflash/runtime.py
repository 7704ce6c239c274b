"""The DFlash drafter at run time: fused taps -> its own position-addressed context K/V -> one
non-causal pass over [anchor, mask x (W-1)] -> candidates through the target's LM head.

It is built from the same layers as the target decoder (models/layers.py)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..kv_cache import KVCache, aligned_cells
from ..models.config import RopeConfig
from ..models.decoder import TargetDecoder
from ..models.layers import ATTENTION, EAGER, CacheSlot, DecoderLayer, Kernels, RMSNorm, RotaryTable
from ..spec.drafter import Drafter, Proposal
from .artifact import Artifact, check_against_target, load_artifact
from .contract import DFlashConfig


class DFlashModel(nn.Module):
    """The drafter's own weights: fusion (fc + hidden_norm), its layers, its final norm."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.num_taps * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                         cfg.rms_norm_eps, cfg.attention_bias, qk_norm=True)
            for _ in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DFlashDrafter(Drafter):
    name = "dflash"
    on_device = True

    def __init__(self, art: Artifact, target: TargetDecoder, window_cells: int = 32768, max_len: int | None = None):
        cfg = art.cfg
        check_against_target(cfg, target.cfg, str(art.source))
        if window_cells < 1:
            from ..errors import StrataError

            raise StrataError(f"--dflash-window must be >= 1, got {window_cells}")
        self.cfg, self.target, self.source = cfg, target, art.source
        self.tap_layers = list(cfg.target_layer_ids)
        self.max_window = cfg.block_size
        with torch.device("meta"):
            model = DFlashModel(cfg)
        model.load_state_dict({k: v.to(target.dtype) for k, v in art.tensors.items()}, assign=True, strict=True)
        self.model = model.to(target.device).eval().requires_grad_(False)
        for layer in self.model.layers:
            layer.fuse_()
        self.max_len = max_len or target.cfg.max_position_embeddings
        self.rope = RotaryTable(cfg.head_dim, RopeConfig(cfg.rope_theta), self.max_len + cfg.block_size,
                                target.device, target.dtype)
        self.cache = KVCache(cfg.num_layers, aligned_cells(self.max_len + cfg.block_size), cfg.num_kv_heads,
                             cfg.head_dim, target.device, target.dtype)
        types = cfg.layer_types or ["full_attention"] * cfg.num_layers
        self.windows = [cfg.sliding_window if t == "sliding_attention" else window_cells for t in types]
        self.mask_token = torch.tensor([cfg.mask_token_id], device=target.device)

    def reset(self) -> None:
        self.cache.reset()

    @torch.inference_mode()
    def observe(self, tokens: list[int], start: int, taps: torch.Tensor | None) -> None:
        """Write context K/V of the committed positions start.. into each layer's own cells."""
        c = self._context(taps)
        rope = self.rope.at(torch.arange(start, start + c.shape[0], device=c.device))
        for j, layer in enumerate(self.model.layers):
            k, v = layer.self_attn.key_value(c, rope)
            self.cache.write(j, start, k, v)
        self.cache.commit(start + c.shape[0])

    def _context(self, taps: torch.Tensor, kernels: Kernels = EAGER) -> torch.Tensor:
        """Fused target taps -> the drafter's context features (fc, then hidden_norm)."""
        norm = self.model.hidden_norm
        fc = self.model.fc
        return kernels.rms_norm(kernels.linear(taps.to(self.target.dtype), fc.weight, fc.bias), norm.weight, norm.eps)

    def context_range(self, layer: int, pos: int) -> tuple[int, int]:
        """Context cells [begin, end) a block at position pos attends to in this layer."""
        return max(0, pos - self.windows[layer]), pos

    def _block_input(self, block: torch.Tensor) -> torch.Tensor:
        x = self.target.embed_tokens(block)
        if self.cfg.input_embedding_scale is not None:
            x = x * self.cfg.input_embedding_scale
        return x

    def _head(self, x: torch.Tensor, trace=None, pending: torch.Tensor | None = None,
              kernels: Kernels = EAGER) -> Proposal:
        """Final norm (adding the last layer's deferred MLP output), the target's LM head, the optional
        multiplier and softcap; rows 1.. are candidates."""
        cfg = self.cfg
        norm = self.model.norm
        h = norm(x) if pending is None else kernels.add_rms_norm(x, pending, norm.weight, norm.eps)[1]
        if trace:
            h = trace(-1, "final_norm", h)
        logits = kernels.linear(h, self.target.lm_head.weight).float()
        if cfg.output_multiplier is not None:
            logits = logits * cfg.output_multiplier
        if cfg.final_logit_softcapping is not None:
            cap = cfg.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        if trace:
            logits = trace(-1, "logits", logits)
        return Proposal(logits[1:].argmax(-1), logits[1:])

    @torch.inference_mode()
    def propose(self, anchor: int, pos: int, n: int, trace=None) -> Proposal:
        """trace(layer, stage, tensor) -> tensor records or replaces intermediates (parity tool)."""
        target = self.target
        block = torch.cat([torch.tensor([anchor], device=target.device), self.mask_token.expand(n)])
        x = self._block_input(block)
        rope = self.rope.at(torch.arange(pos, pos + n + 1, device=target.device))
        for j, layer in enumerate(self.model.layers):
            begin, end = self.context_range(j, pos)

            def keys_fn(k, v, j=j, begin=begin, end=end):
                ck, cv = self.cache.read(j, end, begin)
                return torch.cat([ck, k]), torch.cat([cv, v])

            layer_trace = (lambda stage, t, j=j: trace(j, stage, t)) if trace else None
            x = layer(x, rope, keys_fn, None, layer_trace)
            if trace:
                x = trace(j, "out", x)
        return self._head(x, trace)

    # -- static shapes (CUDA-graph friendly): positions are device tensors, every cell is addressed

    @torch.inference_mode()
    def observe_static(self, taps: torch.Tensor, positions: torch.Tensor, kernels: Kernels = EAGER) -> None:
        """Context K/V of every row of a verify window at its position. Rows past the accepted prefix
        write cells no proposal reads (a block at p sees cells < p) until they are rewritten."""
        c = self._context(taps, kernels)
        rope = self.rope.at(positions)
        for j, layer in enumerate(self.model.layers):
            layer.self_attn.store_key_value(c, rope, CacheSlot(self.cache, j, positions, 0), kernels)

    @torch.inference_mode()
    def propose_static(self, anchor: torch.Tensor, pos: torch.Tensor, n: int, ctx_len: int | None = None,
                       attention: str = "grouped", kernels: Kernels = EAGER) -> Proposal:
        """anchor, pos: one-element device tensors; ctx_len: the cells read, at least pos + n + 1.

        The block's own K/V go into its cells pos..pos+n of the drafter's cache, which hold no context
        yet (the next observe rewrites every cell a later block reads), so each layer attends over one
        slice of the cache: the context cells before pos inside the layer's window, and the block."""
        dev = self.target.device
        ctx_len = min(ctx_len or self.cache.max_len, self.cache.max_len)
        positions = pos + torch.arange(n + 1, device=dev)
        x = self._block_input(torch.cat([anchor, self.mask_token.expand(n)]))
        rope = self.rope.at(positions)
        cells = torch.arange(ctx_len, device=dev)
        own = (cells >= pos) & (cells <= pos + n)
        masks = {w: (((cells < pos) & (cells >= pos - w)) | own).expand(n + 1, -1) for w in set(self.windows)}
        attend_fn = ATTENTION[attention]
        pending = None
        for j, layer in enumerate(self.model.layers):
            x, pending = layer(x, rope, CacheSlot(self.cache, j, positions, ctx_len), masks[self.windows[j]],
                               attention=attend_fn, kernels=kernels, pending=pending, defer=True)
        return self._head(x, pending=pending, kernels=kernels)


def load_drafter(path: str | Path, target: TargetDecoder, window_cells: int = 32768,
                 max_len: int | None = None) -> DFlashDrafter:
    return DFlashDrafter(load_artifact(path), target, window_cells, max_len)
