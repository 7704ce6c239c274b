"""The adaptive verify window: the policy's choice from acceptance and cost, and decoding with it, which
must equal target-only whatever windows it picks (eager and static)."""

from __future__ import annotations

import pytest

from strata.dflash.drafter import load_drafter
from strata.engine.decode import Engine
from strata.engine.window_policy import PROBES, WindowPolicy, candidate_windows
from strata.errors import StrataError
from strata.models.loader import load_target

from conftest import write_hf_drafter


def test_the_policy_weighs_expected_tokens_against_cost():
    assert candidate_windows(16) == [2, 4, 8, 16] and candidate_windows(6) == [2, 4, 6]
    flat = WindowPolicy(8, cost=lambda w: 1.0)  # verifying is free: the whole window
    steep = WindowPolicy(8, cost=lambda w: float(w))  # cost in proportion to the rows
    for policy in (flat, steep):
        for _ in range(50):  # candidates accepted half the time, independently
            policy.record(8, 3, 0.0)
            policy.record(8, 0, 0.0)
    assert flat.choose() == 8 and steep.choose() == 2
    assert flat.expected_tokens(2) == pytest.approx(1 + 51 / 102)  # 1 + P(first accepted), uniform prior
    measured = WindowPolicy(8)
    picks = []
    for _ in range(PROBES * 3):
        w = measured.choose()
        picks.append(w)
        measured.record(w, w - 1, {2: 1.0, 4: 1.1, 8: 1.2}[w])  # every candidate accepted, verify nearly flat
    assert picks == [2, 2, 4, 4, 8, 8] and measured.choose() == 8


def test_adaptive_decoding_equals_target_only(qwen3_dir, tmp_path):
    target = load_target(qwen3_dir)
    drafter_dir = write_hf_drafter(tmp_path / "d", layers=1, taps=(0, 2), block_size=8, seed=3, scale=0.3)
    prompt = [3, 99, 14, 250, 8, 8, 41, 3, 99, 14]
    for static in (False, True):
        want = Engine(target, max_len=128, backend="static" if static else "eager").generate(prompt, 40).output_ids
        engine = Engine(target, load_drafter(drafter_dir, target, max_len=128), max_len=128, backend="static" if static else "eager",
                        adaptive_window=True)
        assert engine.generate(prompt, 40).output_ids == want, static
        assert all(n >= PROBES for n in engine.policy.seen.values())  # every window ran
    with pytest.raises(StrataError, match="adaptive_window and tree"):
        Engine(target, load_drafter(drafter_dir, target, max_len=128), max_len=128, adaptive_window=True, tree=4)
    with pytest.raises(StrataError, match="adaptive_window needs a drafter"):
        Engine(target, max_len=128, adaptive_window=True)


def test_generate_takes_the_flag(capsys):
    from strata.cli import main

    assert main(["generate", "--prompt-ids", "3,99,14,250", "--max-new-tokens", "24", "--ids", "--adaptive-window"]) == 0
    adaptive = capsys.readouterr()
    assert main(["generate", "--prompt-ids", "3,99,14,250", "--max-new-tokens", "24", "--ids", "--no-dflash"]) == 0
    assert adaptive.out == capsys.readouterr().out and "adaptive window, now " in adaptive.err


def test_auto_weighs_the_drafters_confidence_against_cost():
    """--spec auto: the expected tokens of a window from this round's ratings (their running product), scaled by
    how often each position's candidates were accepted against how confident the drafter was there."""
    policy = WindowPolicy(8, cost=lambda w: 1.0 + 0.25 * w)
    sure, doubtful = [0.99] * 7, [0.9, 0.05, 0.05, 0.05, 0.05, 0.05, 0.05]
    assert policy.expected_from(sure, 2) == pytest.approx(1 + 0.99)
    assert policy.choose(sure) == 8 and policy.choose(doubtful) == 2
    for _ in range(40):  # a drafter twice as confident as it should be at every position
        policy.record(8, 0, 0.0, [0.8] * 7)
        policy.record(8, 7, 0.0, [0.8] * 7)
    assert policy.expected_from([0.8] * 7, 2) == pytest.approx(1 + 0.8 * 41 / 65)  # (kept + 1) / (rated + 1)


def test_auto_window_and_p_min_decode_as_target_only(qwen3_dir, tmp_path):
    """Whatever window auto picks and wherever --draft-p-min cuts a draft, greedy output is target-only's; a cut
    caps acceptance (p_min 1 cuts every draft: nothing is accepted), the settings that cannot go together are
    refused by name."""
    from strata.engine.prompt_lookup import PromptLookupDrafter

    target = load_target(qwen3_dir)
    drafter_dir = write_hf_drafter(tmp_path / "d", layers=1, taps=(0, 2), block_size=8, seed=3, scale=0.3)
    prompt = [3, 99, 14, 250, 8, 8, 41, 3, 99, 14]
    for backend in ("eager", "static"):
        want = Engine(target, max_len=128, backend=backend).generate(prompt, 40).output_ids
        for kw in (dict(auto_window=True), dict(draft_p_min=0.3), dict(auto_window=True, draft_p_min=0.3),
                   dict(draft_p_min=1.0)):
            engine = Engine(target, load_drafter(drafter_dir, target, max_len=128), max_len=128, backend=backend,
                            window=8, **kw)
            res = engine.generate(prompt, 40)
            assert res.output_ids == want, (backend, kw)
            if kw.get("draft_p_min") == 1.0:
                assert res.accept_lengths == [1] * len(res.accept_lengths)
            if kw.get("auto_window"):
                assert all(n >= PROBES for n in engine.policy.seen.values())
    d = load_drafter(drafter_dir, target, max_len=128)
    for kw, needle in ((dict(auto_window=True, adaptive_window=True), "auto_window and adaptive_window"),
                       (dict(draft_p_min=0.5, tree=4), "draft_p_min and tree"),
                       (dict(draft_p_min=1.5), "between 0 and 1")):
        with pytest.raises(StrataError, match=needle):
            Engine(target, d, max_len=128, **kw)
    with pytest.raises(StrataError, match="auto_window reads the drafter's confidence"):
        Engine(target, PromptLookupDrafter(3), max_len=128, auto_window=True)
    with pytest.raises(StrataError, match="draft_p_min needs a DFlash drafter"):
        Engine(target, max_len=128, draft_p_min=0.5)


def test_generate_takes_spec_auto_and_p_min(capsys):
    from strata.cli import main

    assert main(["generate", "--prompt-ids", "3,99,14,250", "--max-new-tokens", "24", "--ids", "--spec", "auto",
                 "--draft-p-min", "0.2"]) == 0
    auto = capsys.readouterr()
    assert main(["generate", "--prompt-ids", "3,99,14,250", "--max-new-tokens", "24", "--ids", "--no-dflash"]) == 0
    assert auto.out == capsys.readouterr().out and "auto window, " in auto.err
    with pytest.raises(SystemExit) as bad:
        main(["generate", "--prompt-ids", "3", "--spec", "eight"])
    assert bad.value.code == 2 and "expected a window (an integer) or auto" in capsys.readouterr().err


def test_bench_window_sweep_holds_auto_against_each_fixed_window(tmp_path):
    """`strata bench --spec auto` (its window sweep) on the demo pair: every fixed window of auto's and auto itself
    on the prompt set, taking each prompt in turn, with identical outputs and the best fixed window named."""
    import json

    from conftest import run_cli

    prompts = tmp_path / "p.json"
    prompts.write_text('["def fibonacci(n):", "class Stack:"]')
    out = tmp_path / "w.json"
    r = run_cli("bench", "--spec", "auto", "--prompts", prompts, "--new-tokens", "24", "--runs", "1",
                "--prompt-len", "16", "--hf", "none", "--out", out)
    assert r.returncode == 0, r.stderr
    sweep = json.loads(out.read_text())["window_sweep"]
    assert sweep["prompts"] == 2 and set(sweep["fixed"]) == {"2", "4", "8"} and sweep["interleaved"]
    assert all(row["identical"] for row in [*sweep["fixed"].values(), sweep["auto"]])
    assert sweep["fixed"]["8"]["tau"] > sweep["fixed"]["2"]["tau"] and 1 < sweep["auto"]["mean_window"] <= 8
    best = sweep["fixed"][str(sweep["best_fixed"])]["tok_s"]
    assert sweep["auto_vs_best_fixed"] == sweep["auto"]["tok_s"] / best and "--spec auto" in r.stderr
