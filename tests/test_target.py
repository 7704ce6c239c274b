"""The target decoder against transformers' own implementation."""

from __future__ import annotations

import pytest
import torch

from strata.models.loader import load_target
from strata.engine.decode import Engine

from conftest import cache_equal, forward_at, write_hf_model

CASES = [
    dict(family="qwen3", tie=False, kv_heads=2),
    dict(family="qwen3", tie=True, kv_heads=1),
    dict(family="llama", tie=False, kv_heads=2),
    dict(family="llama", tie=True, kv_heads=4, attention_bias=True),
    dict(family="qwen3", tie=False, kv_heads=2, max_shard_size="100KB"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_matches_transformers(tmp_path, case):
    path, hf = write_hf_model(tmp_path, seed=7, **case)
    if "max_shard_size" in case:
        assert (path / "model.safetensors.index.json").is_file()
    model = load_target(path)
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, hf.config.vocab_size, (40,), generator=gen)
    with torch.no_grad():
        ref = hf(prompt[None], output_hidden_states=True)
    taps = list(range(hf.config.num_hidden_layers))
    cache = model.make_cache(256)
    out = forward_at(model, prompt, 0, cache, taps)
    assert (out.logits - ref.logits[0]).abs().max().item() <= 1e-4
    h = hf.config.hidden_size
    for i, layer in enumerate(taps[:-1]):  # the last hidden_states entry is after the final norm
        got = out.taps[:, i * h:(i + 1) * h]
        assert (got - ref.hidden_states[layer + 1][0]).abs().max().item() <= 1e-4, f"tap {layer}"

    with torch.no_grad():
        hf_ids = hf.generate(prompt[None], attention_mask=torch.ones(1, 40, dtype=torch.long), max_new_tokens=48,
                             min_new_tokens=48, do_sample=False)[0, 40:].tolist()
    res = Engine(model, max_len=256).generate(prompt.tolist(), 48)
    assert res.output_ids == hf_ids


@pytest.mark.parametrize("case", CASES[:4], ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_static_path_matches_transformers(tmp_path, case):
    """The shapes CUDA graphs capture (attention over a fixed bucket of cells under a mask, grouped
    attention) give the reference's logits and taps, prefill then one decode step, and leave the same cache."""
    from strata.layers.kernels import Kernels

    path, hf = write_hf_model(tmp_path, seed=7, **case)
    model = load_target(path)
    prompt = torch.randint(0, hf.config.vocab_size, (41,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(prompt[None], output_hidden_states=True)
    taps = list(range(hf.config.num_hidden_layers - 1))
    h = hf.config.hidden_size
    cache, dyn = model.make_cache(64), model.make_cache(64)
    forward_at(model, prompt, 0, dyn)
    kernels = Kernels(attention="grouped")
    pre = forward_at(model, prompt[:40], 0, cache, taps, kv_len=64, kernels=kernels)
    step = forward_at(model, prompt[40:], 40, cache, taps, kv_len=64, kernels=kernels)
    logits = torch.cat([pre.logits, step.logits])
    feats = torch.cat([pre.taps, step.taps])
    assert (logits - ref.logits[0]).abs().max().item() <= 1e-4
    for i, layer in enumerate(taps):
        assert (feats[:, i * h:(i + 1) * h] - ref.hidden_states[layer + 1][0]).abs().max().item() <= 1e-4
    assert cache_equal(cache, dyn, 41, 1e-5)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_windows_over_cache_match_one_prefill(tmp_path, family):
    path, _ = write_hf_model(tmp_path, family, seed=11)
    model = load_target(path)
    gen = torch.Generator().manual_seed(5)
    seq = torch.randint(0, model.cfg.vocab_size, (90,), generator=gen)
    taps = [0, 1, 2]
    full = forward_at(model, seq, 0, model.make_cache(128), taps)

    cache = model.make_cache(128)
    n = 20
    forward_at(model, seq[:n], 0, cache, taps)
    cache.commit(n)
    pos, size = n, 1
    while pos < 90:
        w = min(size, 90 - pos)
        # a garbage window first, rolled back: stale cells must not leak into the real one
        junk = torch.randint(0, model.cfg.vocab_size, (w,), generator=gen)
        forward_at(model, junk, pos, cache, taps)
        cache.rollback(pos)
        out = forward_at(model, seq[pos:pos + w], pos, cache, taps)
        assert (out.logits - full.logits[pos:pos + w]).abs().max().item() <= 1e-5
        assert (out.taps - full.taps[pos:pos + w]).abs().max().item() <= 1e-5
        cache.commit(pos + w)
        pos += w
        size = size % 8 + 1


def test_dtypes_load(qwen3_dir):
    for dtype in (torch.bfloat16, torch.float16):
        model = load_target(qwen3_dir, dtype=dtype)
        assert model.lm_head.weight.dtype == dtype
        res = Engine(model, max_len=64).generate([1, 2, 3], 4)
        assert len(res.output_ids) == 4
