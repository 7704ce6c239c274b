"""The DFlash drafter at run time: fused taps -> its own position-addressed context K/V -> one
non-causal pass over [anchor, mask x (W-1)] -> candidates through the target's LM head.

Both steps work on device tensors alone (the device contract, engine/drafter.py), so the model runner
captures them in CUDA graphs in the static layout and runs them as they are in the dynamic one."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from ..cache import aligned_cells
from ..engine.drafter import Commit, Drafter, DraftRequest, Proposal
from ..layers.modules import Step
from ..layers.quant import QuantWeight, replace_parameter
from ..models.loader import pack, quantized_weight
from .artifact import Artifact, check_against_target, load_artifact
from .dspark import confidence
from .model import DFlashModel, hf_layout, scaled_logits


#: parameters read by rows or as plain matrices, never through the quantized kernels
ROWS_READ = re.compile("codebook|markov_head|confidence_head")


class DFlashDrafter(Drafter):
    name = "dflash"
    limit = "block size"
    on_device = True
    gives_logits = True
    rates_drafts = True

    def __init__(self, art: Artifact, target, window_cells: int = 32768, max_len: int | None = None,
                 quantized: bool | None = None):
        """window_cells: how many context cells before the block a full-attention layer sees (sliding
        layers keep their own window). max_len: the longest context it will serve. quantized: keep a
        quantized GGUF drafter's matrices in their blocks for the quantized kernels (default: on a GPU)."""
        cfg = art.cfg
        check_against_target(cfg, target.cfg, str(art.source), art.vocab)
        self.cfg, self.target, self.source = cfg, target, art.source
        self.tap_layers = list(cfg.target_layer_ids)
        self.max_window = cfg.block_size + (1 if cfg.anchor_drafts else 0)  # W-1 drafts from W-1 rows
        if cfg.variant == "dflash2":  # its trees branch over the selector's candidates
            self.tree_top_k = cfg.selector_top_k
        self.window_cells = window_cells
        layout = hf_layout(cfg)
        quant = {}
        if target.device.type == "cuda" if quantized is None else quantized:
            quant = {param: quantized_weight([art.blocks[n] for n, _ in sources], sources[0][1][1], target.device,
                                             target.dtype)
                     for param, sources in layout.items() if not ROWS_READ.search(param)
                     and all(n in art.blocks and QuantWeight.fits(art.blocks[n][0], s) for n, s in sources)}
        with torch.device("meta"):
            model = DFlashModel(cfg)
        state = pack(art.tensors, {p: s for p, s in layout.items() if p not in quant}, target.dtype, art.source)
        state.update({p: torch.empty(sum(s[0] for _, s in layout[p]), layout[p][0][1][1], device="meta")
                      for p in quant})
        model.load_state_dict(state, assign=True, strict=True)
        for param, weight in quant.items():
            replace_parameter(model, param, weight)
        self.model = model.to(target.device).eval().requires_grad_(False)
        self.max_len = max_len or target.cfg.max_position_embeddings
        self.cache = self.model.make_cache(aligned_cells(self.max_len + cfg.block_size))
        self.mask_token = torch.tensor([cfg.mask_token_id], device=target.device)

    @torch.inference_mode()
    def observe(self, commit: Commit) -> None:
        """Context K/V of every row the target ran, at its position. Rows past the accepted prefix write
        cells no proposal reads (a block at p sees cells < p) until they are rewritten."""
        self.model.store_context(commit.taps, Step(commit.positions, 0, commit.kernels, probe=commit.probe),
                                 self.cache)

    def block_input(self, block: torch.Tensor) -> torch.Tensor:
        x = self.target.embed(block)
        if self.cfg.input_embedding_scale is not None:
            x = x * self.cfg.input_embedding_scale
        return x

    def context_range(self, window: int | None, pos: int) -> tuple[int, int]:
        """Context cells [begin, end) a block at pos sees in a layer of this attention window."""
        return max(0, pos - (window or self.window_cells)), pos

    @torch.inference_mode()
    def propose(self, req: DraftRequest) -> Proposal:
        """The block's own K/V go into its cells pos..pos+n of the drafter's cache, which hold no context
        yet (the next observe rewrites every cell a later block reads), so each layer attends over one
        slice of the cache: the context cells before pos inside the layer's window, and the block."""
        dev, n, pos, cfg = self.target.device, req.n, req.pos_t, self.cfg
        rows = n if cfg.anchor_drafts else n + 1  # DSpark's anchor slot drafts too
        kv_len = min(req.kv_len, self.cache.cells)
        positions = pos + torch.arange(rows, device=dev)
        cells = torch.arange(kv_len, device=dev)
        own = (cells >= pos) & (cells < pos + rows)
        masks = {w: (((cells < pos) & (cells >= pos - (w or self.window_cells))) | own).expand(rows, -1)
                 for w in self.model.windows}
        x = self.block_input(torch.cat([req.anchor_t, self.mask_token.expand(rows - 1)]))
        h = self.model(x, Step(positions, kv_len, req.kernels, probe=req.probe, masks=masks), self.cache)
        raw = self.target.head(h, req.kernels)
        logits = scaled_logits(cfg, raw)
        if req.probe is not None:
            logits = req.probe(-1, "logits", logits)
        logits, h = logits[rows - n:], h[rows - n:]  # the draft slots
        if cfg.variant == "dflash2":  # the selector's walk among each slot's candidates
            selector, block = self.model.candidate_selector, (logits, h, req.anchor_t, req.kernels)
            tokens, conf = selector.walk(*block)
            return Proposal(tokens, logits, draw=lambda probs, gen: selector.draw(*block, probs, gen),
                            confidence=conf, tree=lambda budget: selector.tree(*block, budget))
        if cfg.variant == "dspark":  # the Markov head's chain from the anchor
            head = self.model.markov_head
            tokens, chained = head.walk(logits, req.anchor_t)
            conf = confidence(getattr(self.model, "confidence_head", None), head, h, chained, req.anchor_t,
                              tokens) if req.rate else None
            return Proposal(tokens, chained, draw=lambda probs, gen: head.draw(logits, req.anchor_t, probs, gen),
                            confidence=conf)
        conf = None
        if req.rate:  # llama.cpp's: the softmax of the raw logits' top 10, at the first
            conf = torch.softmax(raw[rows - n:].float().topk(min(10, raw.shape[-1]), dim=-1).values, -1)[:, 0]
        return Proposal(logits.argmax(-1), logits, confidence=conf)


def load_drafter(source: str | Path | Artifact, target, window_cells: int = 32768,
                 max_len: int | None = None) -> DFlashDrafter:
    """source: a drafter's path, or its artifact already read."""
    art = source if isinstance(source, Artifact) else load_artifact(source)
    return DFlashDrafter(art, target, window_cells, max_len)
