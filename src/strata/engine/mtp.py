"""MTP drafting: the target's own multi-token-prediction block (models/mtp.py) proposes a round's candidates
one after another, as llama.cpp's `--spec-type draft-mtp` does, so that the same file accepts the same drafts
in both engines.

- Every target forward (prefill chunk or verify) is observed: each row's token at its position goes through
  the block with the target's final normed hidden state of the row before (for the first row, the one kept
  from the forward before; zeros before the prompt), which writes the block's K/V there. Rows past the
  accepted prefix write cells no draft reads before they are written again.
- A draft at the anchor's position p starts from the target's hidden state at p - 1; each step runs the
  block over one token, takes the LM head's argmax as the next candidate, and feeds the block's normed output
  in place of the target's hidden state. The steps write the block's K/V at p.., rewritten by the next
  observe.

The target's hidden states are kept by position in a ring of RING rows: a verify's rows fit it, and the row a
draft or the next forward starts from is always among the last forward's."""

from __future__ import annotations

import torch

from ..cache import KVCache, aligned_cells
from ..layers.modules import Step
from ..models.decoder import FINAL_NORM
from .drafter import Commit, Drafter, DraftRequest, Proposal

#: target hidden states kept, by position modulo RING (more than any verify's rows)
RING = 256
#: the longest chain drafted in a round (llama.cpp's --spec-draft-n-max is unbounded; a window's rows are not)
MAX_DRAFTS = 32


class MTPDrafter(Drafter):
    name = "mtp"
    max_window = MAX_DRAFTS + 1
    limit = "longest MTP chain"
    default_window = 4
    tap_layers = [FINAL_NORM]
    rates_drafts = True
    on_device = True

    def __init__(self, target, max_len: int | None = None):
        """target: loaded with its MTP block (load_target(..., mtp=True)). max_len: the longest context served."""
        if target.mtp is None:
            raise ValueError("the target was loaded without its MTP block (load_target(..., mtp=True))")
        cfg, dev = target.cfg, target.device
        self.target = target
        cells = aligned_cells((max_len or cfg.max_position_embeddings) + self.max_window)
        self.cache = KVCache(1, cells, cfg.num_kv_heads, cfg.head_dim, dev, target.dtype)  # the block's layer 0
        target.ensure_rope(cells)
        self.hidden = torch.zeros(RING, cfg.hidden_size, device=dev, dtype=target.dtype)

    def reset(self) -> None:
        self.cache.reset()

    def before(self, positions: torch.Tensor) -> torch.Tensor:
        """The target's hidden state at the position before each of positions [T] (zeros before the prompt)."""
        rows = self.hidden.index_select(0, (positions - 1) % RING)
        return rows * (positions > 0).unsqueeze(-1).to(rows.dtype)

    @torch.inference_mode()
    def observe(self, commit: Commit) -> None:
        positions, taps = commit.positions, commit.taps
        hidden = torch.cat([self.before(positions[:1]), taps[:-1]])
        self.target.forward_mtp(commit.row_tokens, hidden, Step(positions, commit.kv_len, commit.kernels), self.cache)
        kept = min(RING, positions.shape[0])
        self.hidden.index_copy_(0, positions[-kept:] % RING, taps[-kept:])

    @torch.inference_mode()
    def propose(self, req: DraftRequest) -> Proposal:
        target, pos = self.target, req.pos_t
        kv_len = min(req.kv_len, self.cache.cells)
        token, hidden = req.anchor_t, self.before(pos)
        tokens, conf = [], []
        for i in range(req.n):
            hidden = target.forward_mtp(token, hidden, Step(pos + i, kv_len, req.kernels), self.cache)
            logits = target.head(hidden, req.kernels)
            token = logits.argmax(-1)
            tokens.append(token)
            if req.rate:  # llama.cpp's: the softmax of the logits' top 10, at the first
                conf.append(torch.softmax(logits.topk(min(10, logits.shape[-1]), dim=-1).values, -1)[:, 0])
        return Proposal(torch.cat(tokens), confidence=torch.cat(conf) if req.rate else None)
