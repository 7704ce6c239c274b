"""Gated DeltaNet's two-launch static step (delta_kernels.py), run by Triton's interpreter on the CPU, against
the layer's torch composition (GatedDeltaNet.mix with the reference ops): outputs and state through every
way a forward can start (fresh, at the end, a rollback), and a rollback's replay bit for bit."""

from __future__ import annotations

import pytest
import torch

from strata.layers.kernels import delta as delta_kernels
from strata.layers.kernels import Kernels
from strata.layers.linear_attention import GatedDeltaNet

TOL = {torch.float32: 2e-5, torch.float16: 2e-3}
#: whole heads a program (the norm in the kernel), and half heads (the norm after it)
CONFIGS = {"head": (None, 4), "half_head": (8, 1)}


def layer_of(dtype, seed=0, tiled=False) -> GatedDeltaNet:
    """2 key heads of 16, 4 value heads of 12 (no power of two: the blocks are masked), kernel 4; tiled: the
    value heads in llama.cpp's qwen35 order."""
    gen = torch.Generator().manual_seed(seed)
    layer = GatedDeltaNet(0, 32, 2, 4, 16, 12, 4, 1e-6, tiled)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
        layer.norm.weight.add_(1.0)
    return layer.to(dtype)


def projections(layer, rows: int, gen, dtype) -> torch.Tensor:
    return torch.randn(rows, layer.in_proj.weight.shape[0], generator=gen).to(dtype)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got.float() - want.float()).abs().max().item() / max(want.float().abs().max().item(), 1e-6)


STATE = ("conv", "rec", "qk", "v", "gb", "begin", "end")


@pytest.mark.parametrize("dtype, config, tiled", [(torch.float32, "head", False), (torch.float16, "half_head", False),
                                                  (torch.float32, "half_head", True)])
def test_kernel_follows_the_layer_through_every_start(dtype, config, tiled):
    """From a state full of garbage: a fresh start, a forward at the end, rollbacks of 2 and 3 kept rows, a
    re-run from the same position, a 1-row rollback, more rows than slots, a fresh start again."""
    layer, gen = layer_of(dtype, tiled=tiled), torch.Generator().manual_seed(1)
    got, want = layer.make_state(4, "cpu", dtype), layer.make_state(4, "cpu", dtype)
    for name in STATE[:5]:
        getattr(got, name).copy_(torch.randn(getattr(got, name).shape, generator=gen))
        getattr(want, name).copy_(getattr(got, name))
    got.end.fill_(9)
    want.end.fill_(9)
    for first, rows in ((0, 4), (4, 4), (6, 4), (9, 4), (9, 4), (10, 1), (11, 6), (0, 3)):
        proj = projections(layer, rows, gen, dtype)
        y = delta_kernels.gated_delta_net(layer, proj, torch.tensor(first), got, config=CONFIGS[config])
        with torch.no_grad():
            y_ref = layer.mix(proj, torch.tensor(first), want, Kernels(static=True))
        assert y.dtype == dtype and rel_err(y, y_ref) <= TOL[dtype], (first, rows)
        if tiled:  # the order matters: the other one's outputs are not these
            other = layer_of(dtype)
            with torch.no_grad():
                y_other = other.mix(proj, torch.tensor(first), other.make_state(4, "cpu", dtype), Kernels(static=True))
            assert rel_err(y_other, y_ref) > 1e-2
        assert got.conv.equal(want.conv) and got.begin.equal(want.begin) and got.end.equal(want.end), (first, rows)
        for name in ("rec", "qk", "v", "gb"):
            assert rel_err(getattr(got, name), getattr(want, name)) <= TOL[dtype], (first, rows, name)


def test_a_rollback_replays_bit_for_bit():
    """A forward of 3 rows, then one from 0-3 rows into it (its start state replayed from the kept rows),
    against the forward of just those rows before the same next one: the same state, bit for bit, and the
    same next outputs; the first launch's replay alone (delta_kernels.start_state) gives that state too."""
    layer, gen = layer_of(torch.float32, seed=2), torch.Generator().manual_seed(3)
    warm = layer.make_state(3, "cpu", torch.float32)
    delta_kernels.gated_delta_net(layer, projections(layer, 3, gen, torch.float32), torch.tensor(0), warm)
    proj, after = projections(layer, 3, gen, torch.float32), projections(layer, 3, gen, torch.float32)
    run = lambda st, p, first: delta_kernels.gated_delta_net(layer, p, torch.tensor(first), st)  # noqa: E731
    for n in range(4):
        rolled, exact = (layer.make_state(3, "cpu", torch.float32) for _ in range(2))
        for st in (rolled, exact):
            for name in STATE:
                getattr(st, name).copy_(getattr(warm, name))
        run(rolled, proj, 3)
        if n:
            run(exact, proj[:n], 3)
        alone = layer.make_state(3, "cpu", torch.float32)  # the first launch's replay on its own (the bench's)
        for name in STATE:
            getattr(alone, name).copy_(getattr(rolled, name))
        delta_kernels.start_state(layer, torch.tensor(3 + n), alone)
        assert alone.rec[0].equal(exact.rec[1]), n
        assert run(rolled, after, 3 + n).equal(run(exact, after, 3 + n)), n
        for name in STATE:
            assert getattr(rolled, name).equal(getattr(exact, name)), (n, name)
