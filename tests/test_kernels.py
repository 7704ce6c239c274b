"""The fused elementwise groups the GPU path compiles: each must compile as one graph (no fallback to
eager, which would leave the GPU launch-bound) and agree with the plain functions."""

from __future__ import annotations

import warnings

import torch

from strata.layers.kernels import EAGER, Kernels
from strata.layers.ops import rms_norm, rotate


def test_compiled_kernels_match_the_plain_functions():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, generator=gen)
    residual = torch.randn(3, 64, generator=gen)
    w = torch.rand(64, generator=gen) + 0.5
    qk = torch.randn(3, 6, 16, generator=gen)
    q_w, k_w = torch.rand(16, generator=gen) + 0.5, torch.rand(16, generator=gen) + 0.5
    cos, sin = torch.rand(3, 1, 16, generator=gen), torch.rand(3, 1, 16, generator=gen)
    gate_up = torch.randn(3, 96, generator=gen)
    scores = torch.randn(2, 3, 2, 20, generator=gen)
    mask = torch.arange(20).unsqueeze(0) <= torch.tensor([[7], [8], [9]])
    calls = {
        "rms_norm": (x, w, 1e-6),
        "add_rms_norm": (x, residual, w, 1e-6),
        "silu_mul": (gate_up,),
        "masked_softmax": (scores, mask, 0.25),
    }
    compiled = Kernels(compiled=True)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for name, args in calls.items():
            want = getattr(EAGER, name)(*args)
            got = getattr(compiled, name)(*args)
            for a, b in zip(want if isinstance(want, tuple) else (want,), got if isinstance(got, tuple) else (got,)):
                assert a.shape == b.shape, name
                assert (a - b).abs().max() <= 1e-5, name
        k_cache, v_cache = torch.zeros(10, 2, 16), torch.zeros(10, 2, 16)
        caches = []
        for fns in (EAGER, compiled):
            kc, vc = k_cache.clone(), v_cache.clone()
            q = fns.norm_rotate_store(qk, qk[:, 4:], q_w, k_w, cos, sin, 1e-6, 4, kc, vc, torch.tensor([7, 8, 9]))
            caches.append((q, kc, vc))
        for a, b in zip(*caches):
            assert (a - b).abs().max() <= 1e-5
        assert caches[0][1][:7].eq(0).all() and caches[0][1][7:].ne(0).all()
        k, v = qk[:, 4:], qk[:, :2]
        stored = []
        for fns in (EAGER, compiled):
            kc, vc = k_cache.clone(), v_cache.clone()
            fns.norm_rotate_store_kv(k, v, k_w, cos, sin, 1e-6, kc, vc, torch.tensor([2, 5, 6]))
            stored.append((kc, vc))
        want_k = rotate(rms_norm(k, k_w, 1e-6), cos, sin)
        for kc, vc in stored:
            assert (kc[[2, 5, 6]] - want_k).abs().max() <= 1e-5 and vc[[2, 5, 6]].equal(v)
            assert kc[[0, 1, 3, 4, 7, 8, 9]].eq(0).all() and vc[[0, 1, 3, 4, 7, 8, 9]].eq(0).all()
    fallbacks = [str(w.message)[:200] for w in seen if "torch.compile of" in str(w.message)]
    assert not fallbacks, fallbacks  # a compile failure falls back to eager with this warning
    assert torch.isfinite(EAGER.masked_softmax(scores, mask, 0.25)).all()
