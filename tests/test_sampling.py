"""Lossless speculative sampling and the prompt-lookup drafter."""

from __future__ import annotations

import math

import pytest
import torch

import strata.engine.acceptance as acceptance
from strata.dflash.drafter import load_drafter
from strata.errors import StrataError
from strata.models.loader import load_target
from strata.engine.decode import Engine
from strata.engine.prompt_lookup import PromptLookupDrafter
from strata.engine.sampling import SamplingParams, process

from conftest import forward_at, observe, propose, run_cli, write_hf_drafter, write_hf_model

VOCAB, PROMPT, RUNS = 8, [1, 2, 3], 20_000


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    d = tmp_path_factory.mktemp("small")
    target_dir, _ = write_hf_model(d / "t", "qwen3", seed=5, vocab=VOCAB, layers=1)
    drafter_dir = write_hf_drafter(d / "d", layers=1, taps=(0,), vocab=VOCAB, mask_token_id=VOCAB - 1,
                                   num_target_layers=1, block_size=3, scale=0.5, seed=2)
    torch.set_num_threads(1)
    return load_target(target_dir), drafter_dir


def exact_first_three(target, params):
    """P(t1, t2, t3) of target-only sampling, by enumerating every prefix."""
    def probs(seq):
        logits = forward_at(target, torch.tensor(seq), 0, target.make_cache(16)).logits[-1:]
        return process(logits, params)[0].double()

    p1 = probs(PROMPT)
    dist = {}
    for a in range(VOCAB):
        p2 = probs(PROMPT + [a])
        for b in range(VOCAB):
            p3 = probs(PROMPT + [a, b])
            for c in range(VOCAB):
                dist[(a, b, c)] = float(p1[a] * p2[b] * p3[c])
    return dist


def chi_square_passes(counts, dist, runs):
    """Pearson chi-square with cells of expected count < 5 pooled; alpha = 0.001 (Wilson-Hilferty)."""
    stat, df, pool_obs, pool_exp = 0.0, -1, 0, 0.0
    for key, p in dist.items():
        exp, obs = p * runs, counts.get(key, 0)
        if exp < 5:
            pool_obs, pool_exp = pool_obs + obs, pool_exp + exp
            continue
        stat += (obs - exp) ** 2 / exp
        df += 1
    if pool_exp > 0:
        stat += (pool_obs - pool_exp) ** 2 / pool_exp
        df += 1
    z = 3.09
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat <= critical, stat, critical


def sampled_counts(engine, params, runs):
    counts = {}
    for seed in range(runs):
        out = engine.generate(PROMPT, 3, params=SamplingParams(params.temperature, params.top_k, params.top_p, seed))
        key = tuple(out.output_ids)
        counts[key] = counts.get(key, 0) + 1
    return counts


PARAMS = SamplingParams(temperature=1.0)


def test_speculative_sampling_matches_target_distribution(small):
    target, drafter_dir = small
    dist = exact_first_three(target, PARAMS)
    engine = Engine(target, load_drafter(drafter_dir, target, max_len=32), window=3, max_len=32)
    ok, stat, critical = chi_square_passes(sampled_counts(engine, PARAMS, RUNS), dist, RUNS)
    assert ok, (stat, critical)


def test_biased_acceptance_rule_fails_the_same_test(small, monkeypatch):
    """Negative control: accept every candidate. The chi-square test must catch it."""
    target, drafter_dir = small

    def accept_always(p, candidates, q, gen, limit=None):
        n = candidates.shape[0]
        return torch.cat([torch.tensor([n]), torch.multinomial(p[n], 1, generator=gen), candidates])

    monkeypatch.setattr(acceptance, "speculative_accept", accept_always)
    dist = exact_first_three(target, PARAMS)
    engine = Engine(target, load_drafter(drafter_dir, target, max_len=32), window=3, max_len=32)
    runs = RUNS // 5  # its bias is gross: a fifth of the runs already exposes it (keeps the suite lean)
    ok, stat, critical = chi_square_passes(sampled_counts(engine, PARAMS, runs), dist, runs)
    assert not ok, (stat, critical)


def test_same_seed_same_output(small):
    target, drafter_dir = small
    engine = Engine(target, load_drafter(drafter_dir, target, max_len=64), window=3, max_len=64)
    runs = [engine.generate(PROMPT, 40, params=SamplingParams(0.9, 5, 0.95, seed=s)).output_ids for s in (7, 7, 8)]
    assert runs[0] == runs[1] and runs[0] != runs[2]
    argmax = Engine(target, load_drafter(drafter_dir, target, max_len=64), window=3, max_len=64,
                    draft_sampling="argmax")
    a = [argmax.generate(PROMPT, 40, params=SamplingParams(0.9, seed=3)).output_ids for _ in range(2)]
    assert a[0] == a[1]


def test_temperature_zero_is_greedy(small):
    target, drafter_dir = small
    greedy = Engine(target, max_len=64).generate(PROMPT, 30).output_ids
    for eng in (Engine(target, max_len=64),
                Engine(target, load_drafter(drafter_dir, target, max_len=64), window=3, max_len=64)):
        assert eng.generate(PROMPT, 30, params=SamplingParams(0.0, seed=1)).output_ids == greedy


def test_process_top_k_top_p():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    assert torch.allclose(process(logits, SamplingParams(1.0)), torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    assert torch.allclose(process(logits, SamplingParams(1.0, top_k=2)), torch.tensor([[4 / 7, 3 / 7, 0, 0]]))
    assert torch.allclose(process(logits, SamplingParams(1.0, top_p=0.65)), torch.tensor([[4 / 7, 3 / 7, 0, 0]]))
    assert torch.allclose(process(logits, SamplingParams(1.0, top_p=0.7)), torch.tensor([[4 / 7, 3 / 7, 0, 0]]))
    assert torch.allclose(process(logits, SamplingParams(1.0, top_p=0.71)), torch.tensor([[4 / 9, 3 / 9, 2 / 9, 0]]))
    hot = process(logits, SamplingParams(0.5))
    assert torch.allclose(hot, torch.tensor([[16, 9, 4, 1]]) / 30.0)


def test_top_k_restricts_target_and_drafter_alike(small):
    """Every emitted token lies in the target's top-k at its position, drafts included."""
    target, drafter_dir = small
    engine = Engine(target, load_drafter(drafter_dir, target, max_len=64), window=3, max_len=64)
    for seed in range(10):
        out = engine.generate(PROMPT, 30, params=SamplingParams(1.5, top_k=2, seed=seed)).output_ids
        seq = PROMPT + out
        logits = forward_at(target, torch.tensor(seq[:-1]), 0, target.make_cache(64)).logits
        for i, tok in enumerate(out):
            top2 = torch.topk(logits[len(PROMPT) - 1 + i], 2).indices.tolist()
            assert tok in top2


@pytest.mark.parametrize("kw,needle", [
    (dict(temperature=-0.5), "temperature"), (dict(top_k=-1), "top_k"), (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
])
def test_invalid_sampling_values(kw, needle):
    with pytest.raises(StrataError, match=needle):
        SamplingParams(**kw)


def test_cli_sampling_errors(qwen3_dir):
    r = run_cli("generate", "--model", qwen3_dir, "--prompt-ids", "1,2", "--top-p", "0")
    assert r.returncode == 2 and "top_p must be in (0, 1]" in r.stderr
    r = run_cli("generate", "--model", qwen3_dir, "--prompt-ids", "1,2", "--prompt-lookup", "2", "--dflash", "x")
    assert r.returncode == 2 and "mutually exclusive" in r.stderr


# ------------------------------------------------------------------ prompt lookup

def test_prompt_lookup_proposals():
    d = PromptLookupDrafter(max_ngram=3)
    observe(d, [5, 6, 7, 8, 9, 5, 6], 0, None)
    assert propose(d, 7, 7, 3).tokens.tolist() == [8, 9, 5]  # suffix [5, 6, 7] seen at 0
    observe(d, [7], 7, None)
    observe(d, [1], 8, None)
    assert propose(d, 2, 9, 3).tokens.tolist() == [2, 2, 2]  # nothing matches: padded


def test_prompt_lookup_greedy_identity_and_tau(qwen3_dir):
    target = load_target(qwen3_dir)
    base = Engine(target, max_len=512).generate([9, 8, 7], 120).output_ids
    tail = base[-40:]  # a random tiny model settles into a cycle: a prompt that repeats itself
    prompt = tail + tail
    expected = Engine(target, max_len=512).generate(prompt, 64).output_ids
    for w in (2, 4, 8):
        res = Engine(target, PromptLookupDrafter(3), window=w, max_len=512).generate(prompt, 64)
        assert res.output_ids == expected
        if w == 8:
            assert res.stats()["tau"] > 1.5, res.stats()["tau"]
    sampled = Engine(target, PromptLookupDrafter(3), window=4, max_len=512)
    runs = [sampled.generate(prompt, 32, params=SamplingParams(0.8, seed=1)).output_ids for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 32


def variant_of(drafter_dir, out, arch: str, tensors: dict, **config):
    """The small drafter as another variant: its config with `config` (DFlash2's keys go in dflash_config), its
    tensors with random ones of these shapes."""
    import json

    from safetensors.torch import load_file, save_file

    out.mkdir()
    cfg = json.loads((drafter_dir / "config.json").read_text())
    cfg["architectures"] = [arch]
    cfg["dflash_config"].update(config.pop("dflash_config", {}))
    cfg.update(config)
    (out / "config.json").write_text(json.dumps(cfg))
    weights = load_file(drafter_dir / "model.safetensors")
    gen = torch.Generator().manual_seed(3)
    weights.update({name: (torch.randn(shape, generator=gen) * 0.5).to(torch.bfloat16) for name, shape in tensors.items()})
    save_file(weights, str(out / "model.safetensors"))
    return out


def test_dflash2_sampled_walk_matches_target_distribution(small, tmp_path):
    """DFlash2's selector drawing each slot from the softmax of its candidates' scores after the token drawn
    before it, under --spec auto: the same chi-square test (a quarter of the runs: another drafter, a lean
    suite)."""
    target, drafter_dir = small
    d2 = variant_of(drafter_dir, tmp_path / "d2", "DFlash2DraftModel", {
        "layers.0.attention_conv.base_kernel": (2, 2, 64), "layers.0.attention_conv.kernel_projection.weight": (16, 64),
        "layers.0.mlp_conv.base_kernel": (2, 2, 64), "layers.0.mlp_conv.kernel_projection.weight": (16, 64),
        "candidate_selector.predecessor_codebook": (VOCAB, 4), "candidate_selector.successor_codebook": (VOCAB, 4),
        "candidate_selector.hidden_projection.weight": (4, 64)},
        dflash_config=dict(conv_kernel_size=2, conv_group_size=16, selector_rank=4, selector_top_k=3))
    dist = exact_first_three(target, PARAMS)
    # the window chosen each round (--spec auto) from the greedy walk's ratings, which no draw changes
    engine = Engine(target, load_drafter(d2, target, max_len=32), window=3, max_len=32, auto_window=True)
    runs = RUNS // 4
    ok, stat, critical = chi_square_passes(sampled_counts(engine, PARAMS, runs), dist, runs)
    assert ok, (stat, critical)


def test_dspark_sampled_chain_matches_target_distribution(small, tmp_path):
    """DSpark drawing each slot (from the anchor's own) from its logits biased by the token drawn before it, its
    drafts cut by --draft-p-min: the same chi-square test (a quarter of the runs)."""
    target, drafter_dir = small
    ds = variant_of(drafter_dir, tmp_path / "ds", "DSparkDraftModel", {
        "markov_head.markov_w1.weight": (VOCAB, 4), "markov_head.markov_w2.weight": (VOCAB, 4),
        "confidence_head.proj.weight": (1, 68), "confidence_head.proj.bias": (1,)})
    dist = exact_first_three(target, PARAMS)
    # drafts cut where a draw's q is below 0.4 (--draft-p-min): a stopping rule, so still lossless
    engine = Engine(target, load_drafter(ds, target, max_len=32), window=3, max_len=32, draft_p_min=0.4)
    runs = RUNS // 4
    ok, stat, critical = chi_square_passes(sampled_counts(engine, PARAMS, runs), dist, runs)
    assert ok, (stat, critical)
