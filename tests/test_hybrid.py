"""Qwen3.5 hybrid targets (gated DeltaNet + gated attention): token for token against transformers'
Qwen3_5ForCausalLM on tiny random checkpoints it writes; speculation rolls the recurrent state back to
the last accepted token for every acceptance length, eagerly and in static shapes."""

from __future__ import annotations

import pytest
import torch

from strata.dflash.drafter import load_drafter
from strata.engine.decode import Engine
from strata.engine.drafter import Drafter, Proposal
from strata.engine.prompt_lookup import PromptLookupDrafter
from strata.errors import StrataError
from strata.models.loader import load_target

from conftest import write_hf_drafter, write_hf_model

PROMPTS = [[3, 99, 14, 250, 8, 8, 41], [17], [5, 6, 7, 5, 6, 7, 5, 6, 7, 5]]


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    d = tmp_path_factory.mktemp("hybrid")
    path, hf = write_hf_model(d / "q35", "qwen3_5", seed=11, layers=4)
    return path, hf, load_target(path)


class Truncating(Drafter):
    """Proposes the true continuation for the first `a` candidates and a wrong token after, with a cycling
    over 0..n round by round: every acceptance length, and so every rollback point, comes up."""

    name = "truncating"

    def __init__(self, sequence, window: int, vocab: int):
        self.sequence, self.max_window, self.vocab, self.rounds = list(sequence), window, vocab, 0

    def propose(self, req):
        truth = (self.sequence[req.pos + 1:req.pos + 1 + req.n] + [0] * req.n)[:req.n]
        keep = self.rounds % (req.n + 1)
        self.rounds += 1
        return Proposal(torch.tensor(truth[:keep] + [(t + 1) % self.vocab for t in truth[keep:]]))


def test_greedy_equals_transformers(hybrid):
    _, hf, target = hybrid
    assert target.cfg.linear.layers == [0, 1, 2] and target.recurrent
    for prompt in PROMPTS:
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=40, min_new_tokens=40, do_sample=False)
        want = want[0, len(prompt):].tolist()
        assert Engine(target, max_len=128).generate(prompt, 40).output_ids == want, prompt
        assert Engine(target, max_len=128, backend="static").generate(prompt, 40).output_ids == want, prompt


@pytest.mark.parametrize("static", [False, True])
def test_rollback_at_every_acceptance_length(hybrid, static):
    _, _, target = hybrid
    for prompt in PROMPTS[:2]:
        base = Engine(target, max_len=128, backend="static" if static else "eager", pad_rows=8).generate(prompt, 60)
        res = Engine(target, Truncating(prompt + base.output_ids, 8, 256), max_len=128, backend="static" if static else "eager",
                     window=8).generate(prompt, 60)
        assert res.output_ids == base.output_ids
        assert res.accept_lengths[:8] == [1, 2, 3, 4, 5, 6, 7, 8]


def test_target_only_rounds_run_one_ahead(hybrid):
    """Target-only decoding launches each round before reading the last one's token: no launch past the
    budget, one wasted at a stop token, and that round (it advanced the recurrent state) leaves the next
    generation as it was."""
    _, _, target = hybrid
    engine = Engine(target, max_len=128, backend="static")
    launches = []
    verify = engine.runner.verify
    engine.runner.verify = lambda *a: launches.append(1) or verify(*a)
    base = engine.generate(PROMPTS[0], 24)
    assert len(launches) == 23
    stop = base.output_ids[6]
    first = base.output_ids.index(stop)
    launches.clear()
    stopped = engine.generate(PROMPTS[0], 24, stop_ids={stop})
    assert stopped.output_ids == base.output_ids[:first + 1] and stopped.finish_reason == "stop"
    assert len(launches) == first + 1
    assert engine.generate(PROMPTS[0], 24).output_ids == base.output_ids


def test_dflash_and_prompt_lookup_equal_target_only(hybrid, tmp_path):
    _, _, target = hybrid
    drafter_dir = write_hf_drafter(tmp_path / "drafter", layers=2, taps=(0, 3), num_target_layers=4, seed=4,
                                   scale=0.2)
    for prompt in PROMPTS:
        base = Engine(target, max_len=128).generate(prompt, 48).output_ids
        for drafter in (load_drafter(drafter_dir, target, max_len=128), PromptLookupDrafter(3)):
            assert Engine(target, drafter, max_len=128).generate(prompt, 48).output_ids == base, drafter.name
    with pytest.raises(StrataError, match="linear-attention layers"):
        Engine(target, load_drafter(drafter_dir, target, max_len=128), max_len=128, tree=8)


def test_moe_hybrids_and_a_vision_language_checkpoints_decoder(tmp_path):
    """Qwen3.5-MoE (routed experts + a gated shared expert in every layer), Qwen3-Next (grouped DeltaNet
    projections, a dense layer among sparse ones), and the text decoder inside a
    Qwen3_5ForConditionalGeneration checkpoint (its vision tower ignored), against transformers."""
    import transformers

    moe_dir, moe_hf = write_hf_model(tmp_path / "moe", "qwen3_5_moe", seed=12, layers=4)
    next_dir, next_hf = write_hf_model(tmp_path / "next", "qwen3_next", seed=14, layers=4)
    text = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                max_position_embeddings=512, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    torch.manual_seed(13)
    vlm = transformers.Qwen3_5ForConditionalGeneration(transformers.Qwen3_5Config(text_config=text,
                                                                                  vision_config=vision)).eval()
    vlm.save_pretrained(tmp_path / "vlm")
    for path, hf in ((moe_dir, moe_hf), (next_dir, next_hf), (tmp_path / "vlm", vlm)):
        target = load_target(path)
        for prompt in PROMPTS[:2]:
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=24, do_sample=False)
            assert Engine(target, max_len=128, backend="static").generate(prompt, 24).output_ids == \
                want[0, len(prompt):].tolist(), path
    target = load_target(moe_dir)
    base = Engine(target, max_len=128).generate(PROMPTS[2], 40)
    res = Engine(target, Truncating(PROMPTS[2] + base.output_ids, 8, 256), max_len=128, window=8).generate(PROMPTS[2], 40)
    assert res.output_ids == base.output_ids and res.accept_lengths[:8] == [1, 2, 3, 4, 5, 6, 7, 8]


def test_bench_hybrid_shape_against_transformers(tmp_path):
    from conftest import bench_tiny_shape

    result = bench_tiny_shape(tmp_path, "tiny-hybrid")
    assert result["hf"]["eager"]["identical_to_strata"] and result["dflash_oracle"]["identical_to_target_only"]
    rollback = result["rollback"]
    assert rollback["rows"] == 7 and not rollback["fused_kernel"] and rollback["replay_ms"] > 0


def test_bad_hybrid_configs_are_one_line_errors(hybrid, tmp_path):
    import json
    import shutil

    path, _, _ = hybrid
    for field, value, needle in (("layer_types", ["linear_attention"] * 3, "field 'layer_types' must list"),
                                 ("linear_num_value_heads", 3, "not a multiple of linear_num_key_heads 2"),
                                 ("rope_parameters", {"rope_theta": 1e4, "partial_rotary_factor": 0.1},
                                  "gives 1 rotary dims")):
        bad = tmp_path / field
        shutil.copytree(path, bad)
        cfg = json.loads((bad / "config.json").read_text())
        cfg[field] = value
        (bad / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(StrataError, match=needle):
            load_target(bad)


def test_fla_kernels_follow_the_torch_rule_and_replay_bit_for_bit():
    """fla-core's recurrent kernel (the GPU's, here in Triton's interpreter) against the token-by-token
    rule, and its replay of the first n rows: the very state a forward of those n rows ends with."""
    from strata.layers import ops
    from strata.layers.kernels import fla as fla_kernels

    gen = torch.Generator().manual_seed(3)
    t, hk, hv, d = 6, 2, 4, 16
    q, k = (torch.randn(t, hk, d, generator=gen) for _ in range(2))
    v = torch.randn(t, hv, d, generator=gen)
    g = torch.nn.functional.logsigmoid(torch.randn(t, hv, generator=gen))
    beta = torch.rand(t, hv, generator=gen)
    h0 = torch.randn(hv, d, d, generator=gen)
    out, final = fla_kernels.gated_delta_rule(q, k, v, g, beta, h0)
    want_out, want_final = ops.gated_delta_rule(q, k, v, g, beta, h0)
    assert (out - want_out).abs().max() < 1e-5 and (final - want_final).abs().max() < 1e-5
    for n in range(t + 1):
        _, replayed = fla_kernels.gated_delta_rule(q, k, v, g, beta, h0, rows=torch.tensor(n))
        _, torch_replayed = ops.gated_delta_rule(q, k, v, g, beta, h0, rows=torch.tensor(n))
        _, prefix = fla_kernels.gated_delta_rule(q[:n], k[:n], v[:n], g[:n], beta[:n], h0) if n else (None, h0)
        assert replayed.equal(prefix), n
        _, torch_prefix = ops.gated_delta_rule(q[:n], k[:n], v[:n], g[:n], beta[:n], h0) if n else (None, h0)
        assert torch_replayed.equal(torch_prefix), n


def test_rollback_through_fla_kernels_in_static_steps(hybrid, monkeypatch):
    """The GPU's gated delta rule (TritonKernels' fla-core kernels, in the interpreter; the rest in torch to
    keep the test short): speculation at every acceptance length equals target-only in the same shapes."""
    from strata.engine import runner
    from strata.layers.kernels import fla as fla_kernels
    from strata.layers.kernels import Kernels, TritonKernels

    _, _, target = hybrid
    kernels = Kernels(attention="grouped", static=True)
    kernels.delta_rule = TritonKernels(compiled=False).delta_rule
    monkeypatch.setattr(runner, "select_kernels", lambda *a: kernels)
    calls = []
    real = fla_kernels.gated_delta_rule
    monkeypatch.setattr(fla_kernels, "gated_delta_rule", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    prompt = PROMPTS[0]
    base = Engine(target, max_len=64, backend="static", pad_rows=4).generate(prompt, 11)
    res = Engine(target, Truncating(prompt + base.output_ids, 4, 256), max_len=64, backend="static",
                 window=4).generate(prompt, 11)
    assert res.output_ids == base.output_ids and res.accept_lengths[:4] == [1, 2, 3, 4]
    assert calls


def test_rollback_through_the_fused_deltanet_kernels_in_static_steps(hybrid, monkeypatch):
    """Speculation at every acceptance length with the DeltaNet layers of the static steps through TritonKernels'
    two launches each (delta_kernels.py, in the interpreter; the rest in torch to keep the test short) gives
    target-only's tokens (the torch layers')."""
    from strata.engine import runner
    from strata.layers.kernels import delta as delta_kernels
    from strata.layers.kernels import Kernels, TritonKernels

    _, _, target = hybrid
    prompt = PROMPTS[0]
    want = Engine(target, max_len=64, backend="static", pad_rows=4).generate(prompt, 11).output_ids
    triton = TritonKernels(compiled=False)
    kernels = Kernels(attention="grouped", static=True)
    kernels.gated_delta_net = triton.gated_delta_net
    monkeypatch.setattr(runner, "select_kernels", lambda *a: kernels)
    calls = []
    real = delta_kernels.gated_delta_net
    monkeypatch.setattr(delta_kernels, "gated_delta_net", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    res = Engine(target, Truncating(prompt + want, 4, 256), max_len=64, backend="static", window=4).generate(prompt, 11)
    assert res.output_ids == want and res.accept_lengths == [1, 2, 3, 4]
    assert len(calls) == 4 * len(target.cfg.linear.layers) and not triton._failed
