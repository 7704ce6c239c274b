"""The taps check: the target's tapped hidden states from one prefill against those its verify windows give
over a cache, position by position."""

from __future__ import annotations

from dataclasses import replace

import torch

from ..engine.config import EngineConfig
from ..engine.drafter import Drafter
from ..engine.runner import ModelRunner
from ..layers.modules import Step


class _Taps(Drafter):
    """A drafter that only asks for taps: the taps check's verify windows."""

    def __init__(self, layers: list[int]):
        self.tap_layers = layers


@torch.inference_mode()
def taps_check(target, tap_layers: list[int], seq: list[int], prefix: int, w: int,
               config: EngineConfig = EngineConfig()):
    """Cosine, per position, between taps from one prefill and taps from the serving path's verify
    windows of w rows over a cache."""
    n = len(seq)
    full = target(torch.tensor(seq, device=target.device), Step(torch.arange(n, device=target.device), n),
                  target.make_cache(n), tap_layers).taps
    config = replace(config, max_len=n + w)
    runner = ModelRunner(target, _Taps(tap_layers), config, config.plan(target, w))
    runner.reset()
    parts = [runner.prefill(seq[:prefix]).taps]
    pos = prefix
    while pos < n:
        rows = min(w, n - pos)
        chunk = seq[pos:pos + rows]
        runner.start_round(chunk[0], pos)
        cands = torch.tensor((chunk[1:] + [0] * w)[:w - 1], dtype=torch.long, device=target.device)
        out, _, _ = runner.verify(cands, w, runner.kv_len(pos, w))
        parts.append(out.taps[:rows])
        pos += rows
        runner.cache.commit(pos)
    windowed = torch.cat(parts).float()
    full = full.float()
    cos = torch.nn.functional.cosine_similarity(windowed, full, dim=-1)
    return cos.cpu().numpy(), float((windowed - full).abs().max())
