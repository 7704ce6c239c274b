"""Drafter training on the CPU: the loss falls, the output converts and loads, a step is deterministic."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from strata.dflash.artifact import load_artifact
from strata.dflash.drafter import load_drafter
from strata.dflash.train import DrafterTrainer, TrainConfig, block_forward, continue_batch
from strata.models.loader import load_target
from strata.engine.decode import Engine

from conftest import forward_at, observe, propose, run_cli, write_hf_model
from test_cli_generate import make_tokenizer


def _target(tmp_path):
    path, _ = write_hf_model(tmp_path / "target", "qwen3", seed=3, vocab=300)
    make_tokenizer(path, 300)
    corpus = tmp_path / "corpus.py"
    corpus.write_text("def quicksort(arr):\n    if len(arr) <= 1:\n        return arr\n" * 30)
    return path, corpus


def test_train_drafter_cli_loss_falls_and_output_loads(tmp_path):
    target_dir, corpus = _target(tmp_path)
    out = tmp_path / "drafter"
    r = run_cli("train-drafter", "--target", target_dir, "--data", corpus, "--out", out, "--layers", "1",
                "--block-size", "4", "--taps", "0,2", "--steps", "60", "--batch-size", "8", "--num-sequences", "40",
                "--prompt-len", "16", "--gen-len", "24", "--eval-every", "20", "--lr", "3e-3", "--quiet",
                timeout=600)
    assert r.returncode == 0, r.stderr
    log = json.loads((out / "training_log.json").read_text())
    assert [e["step"] for e in log] == [0, 20, 40, 60]
    assert log[-1]["held_out_loss"] < log[0]["held_out_loss"] * 0.9
    assert (out / "checkpoint.pt").is_file()

    gguf = tmp_path / "d.gguf"
    assert run_cli("convert-dflash", out, gguf, "--target", target_dir, "--quiet").returncode == 0
    art = load_artifact(gguf)
    assert art.cfg.block_size == 4 and art.cfg.target_layer_ids == [0, 2] and len(art.tensors) == 14
    target = load_target(target_dir)
    base = Engine(target, max_len=128).generate([5, 6, 7], 20).output_ids
    res = Engine(target, load_drafter(gguf, target, max_len=128), max_len=128).generate([5, 6, 7], 20)
    assert res.output_ids == base

    resumed = run_cli("train-drafter", "--target", target_dir, "--data", corpus, "--out", out, "--layers", "1",
                      "--block-size", "4", "--taps", "0,2", "--steps", "80", "--batch-size", "8",
                      "--num-sequences", "40", "--prompt-len", "16", "--gen-len", "24", "--eval-every", "20",
                      "--resume", "--quiet", timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    assert [e["step"] for e in json.loads((out / "training_log.json").read_text())] == [0, 20, 40, 60, 80]


def test_one_step_is_deterministic(tmp_path):
    target_dir, _ = _target(tmp_path)
    target = load_target(target_dir)
    seqs = torch.randint(0, 300, (12, 40), generator=torch.Generator().manual_seed(0))
    states = []
    for _ in range(2):
        tc = TrainConfig(layers=2, block_size=4, taps=[0, 2], steps=10, batch_size=4, prompt_len=16, gen_len=24,
                         seed=11)  # two layers: each writes its own cache rows under autograd
        tr = DrafterTrainer(target, tc, tmp_path / "x", "cpu")
        tr.set_data(seqs)
        tr.train_step()
        states.append({k: v.clone() for k, v in tr.model.state_dict().items()})
    for k in states[0]:
        assert torch.equal(states[0][k], states[1][k]), k


def test_block_attention_mask_isolates_blocks(tmp_path):
    """A block's logits depend on context strictly before its anchor and on no other block."""
    target_dir, _ = _target(tmp_path)
    target = load_target(target_dir)
    tc = TrainConfig(layers=1, block_size=4, taps=[0, 2], prompt_len=8, gen_len=24)
    tr = DrafterTrainer(target, tc, tmp_path / "x", "cpu")
    tokens = torch.randint(0, 299, (1, 32), generator=torch.Generator().manual_seed(1))
    anchors = torch.tensor([[10, 20]])
    base = block_forward(tr.model, target, tr.cfg, tokens, tr.taps_of(tokens), anchors)[0]
    changed = tokens.clone()
    changed[0, 15] = (changed[0, 15] + 1) % 299  # after anchor 10, before anchor 20
    taps = tr.taps_of(tokens)
    taps2 = tr.taps_of(changed)
    out = block_forward(tr.model, target, tr.cfg, changed, taps2, anchors)[0]
    assert torch.allclose(out[0, 0], base[0, 0], atol=1e-6)  # block at 10 cannot see position 15
    assert not torch.allclose(out[0, 1], base[0, 1], atol=1e-6)  # block at 20 can
    taps_anchor = taps.clone()
    taps_anchor[0, 10] += 1.0  # the anchor's own features are not context for its block
    out = block_forward(tr.model, target, tr.cfg, tokens, taps_anchor, anchors)[0]
    assert torch.allclose(out[0, 0], base[0, 0], atol=1e-6)


def test_training_pass_equals_runtime_proposal(tmp_path):
    """What the drafter learns is what it does at run time: the training block pass and the runtime's
    proposal give the same logits for the same anchor and context."""
    from strata.dflash.artifact import Artifact
    from strata.dflash.drafter import DFlashDrafter
    from strata.dflash.model import hf_layout
    from strata.models.loader import unpack

    target_dir, _ = _target(tmp_path)
    target = load_target(target_dir)
    tc = TrainConfig(layers=2, block_size=6, taps=[0, 2], prompt_len=8, gen_len=40, seed=3)
    tr = DrafterTrainer(target, tc, tmp_path / "x", "cpu")
    tokens = torch.randint(0, 299, (1, 48), generator=torch.Generator().manual_seed(2))
    anchors = torch.tensor([[9, 30]])
    logits = block_forward(tr.model, target, tr.cfg, tokens, tr.taps_of(tokens), anchors)[0]
    tensors = unpack({k: v.detach().clone() for k, v in tr.model.state_dict().items()}, hf_layout(tr.cfg))
    runtime = DFlashDrafter(Artifact(tr.cfg, tensors, tmp_path, "hf"), target, max_len=64)
    for k, a in enumerate([9, 30]):
        taps = forward_at(target, tokens[0, :a], 0, target.make_cache(64), [0, 2]).taps
        runtime.reset()
        observe(runtime, tokens[0, :a].tolist(), 0, taps)
        got = propose(runtime, int(tokens[0, a]), a, 5).logits
        assert (got - logits[0, k]).abs().max() <= 1e-4


def test_self_distillation_continuation_equals_uncached_greedy(tmp_path):
    """The cached batch continuation writes the tokens that re-running the whole row would pick."""
    target_dir, _ = _target(tmp_path)
    target = load_target(target_dir)
    prompts = torch.randint(0, 300, (3, 9), generator=torch.Generator().manual_seed(5))
    got = continue_batch(target, prompts, 12, lambda logits: logits.argmax(-1, keepdim=True))
    want = prompts
    for _ in range(12):
        logits = target.forward_batch(want).logits
        want = torch.cat([want, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert got.shape == (3, 21)
    assert torch.equal(got, want)


def test_cached_target_features_train_like_recomputed_ones(tmp_path):
    """The tap table (CUDA's default) feeds the same features as the target's forward at every step."""
    target_dir, _ = _target(tmp_path)
    target = load_target(target_dir)
    seqs = torch.randint(0, 300, (12, 40), generator=torch.Generator().manual_seed(0))
    losses = []
    for cached in (False, True):
        tc = TrainConfig(layers=1, block_size=4, taps=[0, 2], steps=10, batch_size=4, prompt_len=16, gen_len=24,
                         seed=11)
        tr = DrafterTrainer(target, tc, tmp_path / "x", "cpu")
        tr.cache_taps = cached
        tr.set_data(seqs)
        assert (tr.train_taps is not None) == cached
        losses.append([tr.train_step() for _ in range(3)])
    assert losses[0] == pytest.approx(losses[1], rel=1e-2)
    assert losses[0][0] == pytest.approx(losses[1][0], rel=1e-6)


def _perturbed(trainer, seed=7):
    """Every parameter moved off its initialisation (the identity convolutions, the zero Markov bias), so that
    each addition does something."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return trainer


@pytest.mark.parametrize("variant", ["dflash2", "dspark"])
def test_variant_training_picks_are_the_runtime_walk(tmp_path, variant):
    """What a DFlash2 or DSpark drafter learns is what it drafts: given the true tokens before each slot, the
    training pass's picks are the runtime's greedy walk (selector) or chain (Markov head), so a run of right picks
    is the accepted length, up to a changed token and not past it."""
    from strata.dflash.contract import Artifact
    from strata.dflash.drafter import DFlashDrafter
    from strata.dflash.model import hf_layout
    from strata.models.loader import unpack

    target_dir, _ = _target(tmp_path)
    target = load_target(target_dir)
    tc = TrainConfig(layers=2, block_size=6, taps=[0, 2], prompt_len=8, gen_len=40, seed=3, variant=variant,
                     conv_group_size=8, selector_rank=8, selector_top_k=4, markov_rank=8)
    tr = _perturbed(DrafterTrainer(target, tc, tmp_path / "x", "cpu"))
    assert tr.cfg.variant == variant
    tensors = unpack({k: v.detach().clone() for k, v in tr.model.state_dict().items()}, hf_layout(tr.cfg))
    runtime = DFlashDrafter(Artifact(tr.cfg, tensors, tmp_path, "hf"), target, max_len=64)
    n = tr.cfg.block_size - (0 if tr.cfg.anchor_drafts else 1)  # rows = block size
    tokens = torch.randint(0, 299, (1, 48), generator=torch.Generator().manual_seed(2))
    for a in (9, 30):
        taps = forward_at(target, tokens[0, :a], 0, target.make_cache(64), [0, 2]).taps
        runtime.reset()
        observe(runtime, tokens[0, :a].tolist(), 0, taps)
        walk = propose(runtime, int(tokens[0, a]), a, n).tokens
        seq = tokens.clone()
        seq[0, a + 1:a + 1 + n] = walk
        _, right = tr.loss_on(seq, torch.tensor([[a]]))
        assert right[0, 0].tolist() == [True] * n
        seq[0, a + 3] = (seq[0, a + 3] + 1) % 299
        _, right = tr.loss_on(seq, torch.tensor([[a]]))
        assert right[0, 0, :3].tolist() == [True, True, False]


def test_init_from_a_dflash_drafter_starts_where_it_was(tmp_path):
    """--init-from: a DFlash2 (or DSpark) drafter started from a DFlash one drafts what the DFlash one drafts
    before its first step (identity convolutions, a zero Markov bias); then training moves it."""
    target_dir, corpus = _target(tmp_path)
    target = load_target(target_dir)
    base = DrafterTrainer(target, TrainConfig(layers=1, block_size=4, taps=[0, 2], seed=5), tmp_path / "d", "cpu")
    with torch.no_grad():  # the export's BF16 values
        for p in _perturbed(base).model.parameters():
            p.copy_(p.bfloat16().float())
    base.export()
    tokens = torch.randint(0, 299, (2, 40), generator=torch.Generator().manual_seed(4))
    anchors = torch.tensor([[9, 20], [12, 30]])
    want = block_forward(base.model, target, base.cfg, tokens, base.taps_of(tokens), anchors)[0]
    for variant in ("dflash2", "dspark"):
        tc = TrainConfig(variant=variant, init_from=str(tmp_path / "d"), conv_group_size=8, selector_rank=8,
                         selector_top_k=4, markov_rank=8, steps=3, batch_size=2, prompt_len=8)
        tr = DrafterTrainer(target, tc, tmp_path / variant, "cpu")
        assert (tr.cfg.variant, tr.cfg.num_layers, tr.cfg.block_size) == (variant, 1, 4)
        got = block_forward(tr.model, target, tr.cfg, tokens, tr.taps_of(tokens), anchors)[0]
        if variant == "dflash2":
            assert (got - want).abs().max() <= 1e-5
        else:  # the anchor's slot drafts too: the block's rows are the same, one more of them read
            assert tr.cfg.anchor_drafts and got.shape[2] == want.shape[2] + 1
        tr.set_data(torch.randint(0, 299, (8, 40), generator=torch.Generator().manual_seed(6)))
        before = {k: v.clone() for k, v in tr.model.state_dict().items()}
        tr.train_step()
        moved = [k for k, v in tr.model.state_dict().items() if not torch.equal(v, before[k])]
        heads = ("candidate_selector", "attention_conv") if variant == "dflash2" else \
            ("markov_head", "confidence_head")
        assert all(any(h in k for k in moved) for h in heads), moved
        with torch.no_grad():  # a drafter of the kind asked for goes on as it is (its trained parts kept)
            for p in tr.model.parameters():
                p.copy_(p.bfloat16().float())
        tr.export()
        again = DrafterTrainer(target, replace(tc, init_from=str(tmp_path / variant)), tmp_path / "again", "cpu")
        assert all(torch.equal(a, b) for a, b in zip(again.model.state_dict().values(), tr.model.state_dict().values()))
