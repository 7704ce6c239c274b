"""MTP drafting (--mtp): the MTP block of tiny Qwen3.5 / Qwen3.5-MoE / Qwen3-Next checkpoints that transformers
writes (plus the mtp.* tensors their hub checkpoints carry), from the folder and from llama.cpp's GGUF layout;
every round's drafts against the block's definition computed from scratch; greedy identical to target-only,
sampled lossless. tools/llamacpp_mtp_check.py checks the drafts and their acceptance against llama.cpp's
draft-mtp."""

from __future__ import annotations

import json

import pytest
import torch

from strata.cache import KVCache
from strata.engine.decode import Engine
from strata.engine.mtp import MTPDrafter
from strata.layers.modules import Step
from strata.models.decoder import FINAL_NORM
from strata.models.loader import load_target

from conftest import add_mtp_block, run_cli, write_hf_model
from hybrid_layout import write as write_gguf
from test_gguf_target import qwen2_tokenizer
from test_sampling import PARAMS, RUNS, chi_square_passes, exact_first_three, sampled_counts

PROMPTS = ([3, 99, 14, 250, 8, 8, 41, 7], [5, 6, 7, 8])


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    d = tmp_path_factory.mktemp("mtp")
    out = {}
    for family in ("qwen3_5", "qwen3_5_moe", "qwen3_next"):
        write_hf_model(d / family, family, seed=3, layers=4)
        qwen2_tokenizer(d / family, 256)
        out[family] = add_mtp_block(d / family, counted=family != "qwen3_next")
    return out


class Recording(MTPDrafter):
    """The drafter, keeping each round's position and drafts."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.rounds = []

    def propose(self, req):
        proposal = super().propose(req)
        self.rounds.append((req.pos, proposal.tokens.tolist()))
        return proposal


def reference_drafts(target, sequence: list[int], pos: int, n: int) -> list[int]:
    """The block's drafts at pos from scratch: the target over the sequence before pos (its final normed hidden
    states), the block over every token up to the anchor at pos, each with the hidden state before it (zeros
    before the first), then n steps each fed the block's own output and the LM head's argmax."""
    cfg, tokens = target.cfg, torch.tensor(sequence[:pos + 1])
    hidden = target(tokens[:pos], Step(torch.arange(pos), pos), target.make_cache(pos + 1), [FINAL_NORM],
                    logits="none").taps
    cache = KVCache(1, pos + n + 1, cfg.num_kv_heads, cfg.head_dim, target.device, target.dtype)
    out = target.forward_mtp(tokens, torch.cat([torch.zeros(1, cfg.hidden_size), hidden]),
                             Step(torch.arange(pos + 1), pos + 1), cache)[-1:]
    drafts = [int(target.head(out).argmax())]
    for i in range(1, n):
        out = target.forward_mtp(torch.tensor(drafts[-1:]), out, Step(torch.tensor([pos + i]), pos + i + 1), cache)
        drafts.append(int(target.head(out).argmax()))
    return drafts


def check_rounds(target, drafter: Recording, prompt: list[int], output: list[int]) -> None:
    sequence = prompt + output
    for pos, drafts in drafter.rounds:
        assert drafts == reference_drafts(target, sequence, pos, len(drafts)), pos


@pytest.mark.parametrize("family,new", [("qwen3_5", 32), ("qwen3_5_moe", 12), ("qwen3_next", 12)])
def test_mtp_drafts_as_the_block_defines_them(folders, family, new):
    """Each round's chain equals the block's drafts computed from scratch over the committed text (so the block's
    K/V and the hidden states kept between rounds are the right ones) and the output equals target-only; the
    static layout drafts the same (the dense block: drafts accepted too)."""
    target = load_target(folders[family], mtp=True)
    prompt = PROMPTS[0]
    base = Engine(target, max_len=64).generate(prompt, new).output_ids
    drafters = {}
    for backend in ("eager", "static") if family == "qwen3_5" else ("eager",):
        drafter = drafters[backend] = Recording(target, max_len=64)
        res = Engine(target, drafter, max_len=64, window=4, backend=backend).generate(prompt, new)
        assert res.output_ids == base, backend
    assert drafters.get("static", drafters["eager"]).rounds == drafters["eager"].rounds
    check_rounds(target, drafters["eager"], prompt, base)
    if family == "qwen3_5":  # its embedding pass-through drafts the target's repetitions partly right
        assert res.acceptance.summary()["accepted"] > 0


def test_mtp_from_gguf_drafts_as_from_the_folder(folders, tmp_path):
    """llama.cpp's layout of the block (blk.L.* after the decoder's layers, nextn.* parts, norms stored as
    1 + w), F32: the same drafts and output as the folder's; Q8_0 (dequantized on the CPU) equal to its own
    target-only."""
    import gguf

    folder = folders["qwen3_5_moe"]
    path = tmp_path / "m.gguf"
    write_gguf(path, folder, "qwen3_5_moe", mtp=True)
    from_folder, from_file = load_target(folder, mtp=True), load_target(path, mtp=True)
    runs = []
    for target in (from_folder, from_file):
        drafter = Recording(target, max_len=64)
        runs.append((Engine(target, drafter, max_len=64, window=5).generate(PROMPTS[1], 12).output_ids,
                     drafter.rounds))
    assert runs[0] == runs[1]
    q8 = tmp_path / "m-q8.gguf"
    write_gguf(q8, folder, "qwen3_5_moe", qtype=gguf.GGMLQuantizationType.Q8_0, mtp=True)
    target = load_target(q8, mtp=True)
    base = Engine(target, max_len=64).generate(PROMPTS[1], 12).output_ids
    assert Engine(target, MTPDrafter(target, 64), max_len=64, window=4).generate(PROMPTS[1], 12).output_ids == base


def test_mtp_sampled_matches_target_distribution(tmp_path):
    """Sampled decoding with the block's (deterministic) drafts: the suite's chi-square test on the first three
    tokens (an eighth of the runs: a hybrid target is slower per run)."""
    folder, _ = write_hf_model(tmp_path / "t", "qwen3_5", seed=5, vocab=8, layers=2,
                               layer_types=["linear_attention", "full_attention"])
    target = load_target(add_mtp_block(folder, passthrough=2.0), mtp=True)
    dist = exact_first_three(target, PARAMS)
    engine = Engine(target, MTPDrafter(target, 32), window=3, max_len=32)
    runs = RUNS // 8
    ok, stat, critical = chi_square_passes(sampled_counts(engine, PARAMS, runs), dist, runs)
    assert ok, (stat, critical)


def test_mtp_cli(folders, tmp_path):
    """generate --mtp prints target-only's tokens, gate --mtp passes; --mtp refused with --dflash and on a model
    without an MTP block (also one whose config counts a block its tensors lack), each with one line and exit code 2;
    inspect shows the block."""
    folder = folders["qwen3_5"]
    args = ("generate", "--model", folder, "--prompt-ids", "3,99,14,250", "--max-new-tokens", "16")
    mtp, plain = run_cli(*args, "--mtp", "--spec", "3"), run_cli(*args)
    assert mtp.returncode == 0 and plain.returncode == 0, mtp.stderr
    assert mtp.stdout.splitlines()[0] == plain.stdout.splitlines()[0]
    assert "W=3" in mtp.stderr
    gate = run_cli("gate", "--model", folder, "--mtp", "--prompt-ids", "3,99,14,250", "--max-new-tokens", "12",
                   "--spec-list", "2", "5")
    assert gate.returncode == 0 and "gate: PASS (2/2 identical)" in gate.stdout, gate.stdout + gate.stderr
    both = run_cli(*args, "--mtp", "--dflash", str(tmp_path / "d.gguf"))
    assert both.returncode == 2 and both.stderr.strip().endswith(
        "--dflash and --mtp are mutually exclusive: choose one drafter")
    bare, _ = write_hf_model(tmp_path / "bare", "qwen3_5", seed=1, layers=4)
    config = json.loads((bare / "config.json").read_text())  # a re-upload that kept the count, not the block
    (bare / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": 1}))
    none = run_cli("generate", "--model", bare, "--prompt-ids", "3,4", "--mtp")
    assert none.returncode == 2 and len(none.stderr.strip().splitlines()) == 1
    assert "has no MTP block" in none.stderr
    shown = run_cli("inspect", folder)  # a target: its shape and its block
    assert shown.returncode == 0 and "MTP: 1 block (one full-attention layer with an MLP of 96, fc [64, 128]): " \
        "--mtp drafts with it" in shown.stdout, shown.stdout
    assert "MTP: none" in run_cli("inspect", bare).stdout


def test_a_quantized_mtp_block_stays_in_its_blocks(tmp_path):
    """A Q8_0 GGUF's block loaded for the device kernels (quantized=True, as on a GPU): its matrices and experts
    kept in their blocks as the decoder's are (the same loader path; the interpreter is too slow to decode here)."""
    import gguf

    from hybrid_layout import COMMON, SHAPES
    from strata.layers.quant import QuantExperts, QuantWeight

    folder, _ = write_hf_model(tmp_path / "m", "qwen3_5_moe", seed=31, vocab=320, **COMMON, **SHAPES["qwen3_5_moe"])
    qwen2_tokenizer(folder, 320)
    path = tmp_path / "m-q8.gguf"
    write_gguf(path, add_mtp_block(folder), "qwen3_5_moe", qtype=gguf.GGMLQuantizationType.Q8_0, mtp=True)
    block = load_target(path, mtp=True, quantized=True).mtp
    assert all(isinstance(w, QuantWeight) for w in (block.fc.weight, block.layer.self_attn.qkv_proj.weight,
                                                    block.layer.self_attn.o_proj.weight))
    assert isinstance(block.layer.mlp.gate_up_proj, QuantExperts) and isinstance(block.layer.mlp.down_proj,
                                                                                 QuantExperts)
