"""DFlash2 drafters (dynamic grouped causal convolutions, a low-rank candidate selector): read from the reference
Hugging Face folder and from llama.cpp's GGUF layout, converted both ways bit for bit, every stage of a proposal
and the selector's walk against the independent NumPy reference, decoding identical to target-only."""

from __future__ import annotations

import pytest
import torch

from strata.checks.parity import run_parity
from strata.dflash.artifact import load_artifact
from strata.dflash.converter import convert_hf_to_gguf, export_gguf_to_hf
from strata.dflash.drafter import load_drafter
from strata.engine.decode import Engine
from strata.errors import ArtifactError

from conftest import write_hf_drafter, write_hf_model

TAPS, GROUP, RANK, TOP_K, VOCAB, HIDDEN = 3, 16, 8, 4, 256, 64


def write_dflash2(path, seed=4, layers=2, **config):
    """A DFlash2 drafter for the tests' small qwen3 target, as the reference folder holds one (config keys in
    dflash_config; the base kernels and codebooks as bare parameters)."""
    gen = torch.Generator().manual_seed(seed + 100)
    groups = HIDDEN // GROUP
    tensors = {}
    for n in range(layers):
        for conv in ("attention_conv", "mlp_conv"):
            tensors[f"layers.{n}.{conv}.base_kernel"] = torch.randn(2, TAPS, HIDDEN, generator=gen) * 0.5
            tensors[f"layers.{n}.{conv}.kernel_projection.weight"] = \
                torch.randn(2 * TAPS * groups, HIDDEN, generator=gen) * 0.1
    tensors["candidate_selector.predecessor_codebook"] = torch.randn(VOCAB, RANK, generator=gen) * 0.1
    tensors["candidate_selector.successor_codebook"] = torch.randn(VOCAB, RANK, generator=gen) * 0.1
    tensors["candidate_selector.hidden_projection.weight"] = torch.randn(RANK, HIDDEN, generator=gen) * 0.3
    dcfg = {"mask_token_id": 255, "target_layer_ids": [0, 2], "conv_kernel_size": TAPS, "conv_group_size": GROUP,
            "selector_rank": RANK, "selector_top_k": TOP_K, **config}
    return write_hf_drafter(path, layers=layers, taps=(0, 2), block_size=8, seed=seed, scale=0.2,
                            extra_config={"architectures": ["DFlash2DraftModel"], "dflash_config": dcfg},
                            extra_tensors={k: v.to(torch.bfloat16) for k, v in tensors.items()})


@pytest.fixture(scope="module")
def pair2(tmp_path_factory):
    from strata.models.loader import load_target

    d = tmp_path_factory.mktemp("dflash2")
    target_dir, _ = write_hf_model(d / "target", "qwen3", seed=21)
    return target_dir, write_dflash2(d / "drafter"), load_target(target_dir), d


def test_dflash2_formats_both_ways(pair2):
    """The folder as llama.cpp's converter writes it (its names; the base kernels F32, having no `.weight`; the
    rest BF16), read back bit for bit, and exported back to the folder it came from."""
    import gguf

    target_dir, drafter_dir, _, d = pair2
    hf = load_artifact(drafter_dir)
    assert hf.cfg.variant == "dflash2" and hf.cfg.selector_top_k == TOP_K and hf.cfg.vocab_size == VOCAB
    art = convert_hf_to_gguf(drafter_dir, d / "d2.gguf")
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(d / "d2.gguf")).tensors}
    assert types["blk.1.attn_conv_base"] == types["blk.0.ffn_conv_base"] == "F32"
    assert types["blk.0.attn_conv_proj.weight"] == types["selector_successor.weight"] == "BF16"
    assert types["selector_hidden.weight"] == types["selector_predecessor.weight"] == "BF16"
    reader = gguf.GGUFReader(str(d / "d2.gguf"))
    keys = {k: reader.fields[k].contents() for k in ("dflash.conv_kernel_size", "dflash.conv_group_size",
                                                      "dflash.selector_rank", "dflash.selector_top_k")}
    assert keys == {"dflash.conv_kernel_size": TAPS, "dflash.conv_group_size": GROUP, "dflash.selector_rank": RANK,
                    "dflash.selector_top_k": TOP_K}
    assert art.cfg == load_artifact(d / "d2.gguf").cfg
    from strata.dflash.inspect import inspect_path

    text, ok = inspect_path(d / "d2.gguf")
    assert ok and "architecture: dflash (DFlash2: convolutions and a candidate selector)" in text
    assert f"DFlash2: convolution taps {TAPS}, group {GROUP} channels; selector rank {RANK}, top-{TOP_K}" in text
    back = export_gguf_to_hf(d / "d2.gguf", d / "back")
    assert back.cfg.variant == "dflash2"
    for name, t in hf.tensors.items():
        assert torch.equal(back.tensors[name].to(t.dtype), t), name


def test_dflash2_proposals_match_the_reference_and_decode_as_target_only(pair2):
    """Every stage of a proposal (the convolutions inside attn_in, o_residual and mlp) and the selector's walk
    against the NumPy reference, from both formats; greedy decoding with it, eager and static, equals
    target-only."""
    target_dir, drafter_dir, target, d = pair2
    prompt = [3, 99, 14, 250, 8, 8, 41]
    base = Engine(target, max_len=128).generate(prompt, 40).output_ids
    for source in (drafter_dir, d / "d2.gguf") if (d / "d2.gguf").exists() else (drafter_dir,):
        drafter = load_drafter(source, target, max_len=128)
        for w in (2, 8):
            rows, first = run_parity(drafter, prompt, w)
            assert first is None, [r for r in rows if not r.ok]
            assert any(r.name == "draft_tokens" for r in rows)
        for backend in ("eager", "static"):
            res = Engine(target, load_drafter(source, target, max_len=128), max_len=128, backend=backend,
                         window=8).generate(prompt, 40)
            assert res.output_ids == base, (source, backend)


@pytest.mark.parametrize("config,needle", [
    ({"selector_top_k": None}, "DFlash2 needs selector_top_k as a positive integer, got None"),
    ({"conv_group_size": 24}, "conv_group_size 24 does not divide hidden_size 64"),
    ({"selector_top_k": 8}, "selector_top_k 8 needs hidden_size >= 72 (llama.cpp's limit), got 64"),
])
def test_bad_dflash2_configs_are_one_line_errors(tmp_path, config, needle):
    path = write_dflash2(tmp_path / "bad", **config)
    with pytest.raises(ArtifactError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        load_artifact(path)


def write_dspark(path, seed=5, anchor=True, confidence=True, rank=8):
    """A DSpark drafter (DSparkDraftModel: a Markov head, a confidence head) for the small qwen3 target."""
    gen = torch.Generator().manual_seed(seed + 200)
    tensors = {"markov_head.markov_w1.weight": torch.randn(VOCAB, rank, generator=gen) * 0.5,
               "markov_head.markov_w2.weight": torch.randn(VOCAB, rank, generator=gen) * 0.05}
    if confidence:
        tensors["confidence_head.proj.weight"] = torch.randn(1, HIDDEN + rank, generator=gen) * 0.1
        tensors["confidence_head.proj.bias"] = torch.zeros(1)
    return write_hf_drafter(path, layers=2, taps=(0, 2), block_size=8, seed=seed, scale=0.2,
                            extra_config={"architectures": ["DSparkDraftModel"], "sample_from_anchor": anchor,
                                          "markov_head_type": "vanilla"},
                            extra_tensors={k: v.to(torch.bfloat16) for k, v in tensors.items()})


@pytest.mark.parametrize("anchor", [True, False])
def test_dspark_drafts_as_the_reference_and_decodes_as_target_only(pair2, anchor):
    """DSpark's Markov chain from the anchor's own slot (sample_from_anchor, W-1 rows for W-1 drafts) or after it:
    both formats (the keys llama.cpp's converter writes), every stage and the chained tokens against the NumPy
    reference, greedy decoding equal to target-only at the block size + 1 (anchor-first's largest window)."""
    import gguf

    _, _, target, d = pair2
    folder = write_dspark(d / f"dspark-{anchor}", anchor=anchor)
    art = convert_hf_to_gguf(folder, d / f"dspark-{anchor}.gguf")
    assert art.cfg.variant == "dspark" and art.cfg.markov_rank == 8 and art.cfg.sample_from_anchor is anchor
    reader = gguf.GGUFReader(str(d / f"dspark-{anchor}.gguf"))
    assert reader.fields["dflash.sample_from_anchor"].contents() is anchor
    assert reader.fields["dflash.has_confidence_head"].contents() is True
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["markov_w1.weight"] == types["conf_proj.weight"] == "BF16" and types["conf_proj.bias"] == "F32"
    prompt = [3, 99, 14, 250, 8, 8, 41]
    base = Engine(target, max_len=128).generate(prompt, 40).output_ids
    for source in (folder, d / f"dspark-{anchor}.gguf"):
        drafter = load_drafter(source, target, max_len=128)
        assert drafter.max_window == (9 if anchor else 8)
        for w in (2, drafter.max_window):
            table, first = run_parity(drafter, prompt, w)
            assert first is None and any(r.name == "draft_tokens" for r in table), [r for r in table if not r.ok]
        for backend in ("eager", "static"):
            res = Engine(target, load_drafter(source, target, max_len=128), max_len=128, backend=backend,
                         window=drafter.max_window).generate(prompt, 40)
            assert res.output_ids == base, (source, backend)


def test_dflash2_tree_holds_the_best_prefixes_of_its_selector(pair2):
    """A DFlash2 draft tree (tree verification) is the budget's best prefixes by summed log-probability, each step a
    softmax among the slot's top-k candidates scored after the parent's own token (enumerated here path by path);
    tree verification with it decodes as target-only, eager and static."""
    import itertools

    import numpy as np

    from strata.dflash.dflash2 import CandidateSelector
    from strata.layers.kernels import EAGER

    torch.manual_seed(0)
    sel = CandidateSelector(VOCAB, RANK, HIDDEN, 3)
    with torch.no_grad():
        for p in sel.parameters():
            p.normal_(0, 0.5)
    depths, budget, anchor = 3, 10, torch.tensor([7])
    logits, h = torch.randn(depths, VOCAB) * 3, torch.randn(depths, HIDDEN)
    tree = sel.tree(logits, h, anchor, EAGER, budget)
    pred, succ = sel.predecessor_codebook.detach().double().numpy(), sel.successor_codebook.detach().double().numpy()
    gate = (h @ sel.hidden_projection.weight.T).detach().double().numpy()
    cand = [np.argsort(-logits[d].numpy(), kind="stable")[:3] for d in range(depths)]
    scored = {}
    for n in range(1, depths + 1):
        for path in itertools.product(range(3), repeat=n):
            total, prev = 0.0, 7
            for d, j in enumerate(path):
                s = np.array([logits[d, c].item() + np.sum(succ[c] * pred[prev] * gate[d]) for c in cand[d]])
                total += s[j] - s.max() - np.log(np.exp(s - s.max()).sum())
                prev = int(cand[d][j])
            scored[tuple(int(cand[d][j]) for d, j in enumerate(path))] = total
    want = set(sorted(scored, key=lambda p: -scored[p])[:budget])
    rows = tree.tokens.tolist()
    parent = tree.parent.tolist()

    def path_of(r):
        return () if r == 0 else path_of(parent[r]) + (rows[r],)

    assert {path_of(r) for r in range(1, budget + 1)} == want

    target_dir, drafter_dir, target, d = pair2
    prompt = [3, 99, 14, 250, 8, 8, 41]
    base = Engine(target, max_len=128).generate(prompt, 40).output_ids
    for backend in ("eager", "static"):
        res = Engine(target, load_drafter(drafter_dir, target, max_len=128), max_len=128, backend=backend,
                     window=4, tree=12).generate(prompt, 40)
        assert res.output_ids == base, backend
    with pytest.raises(Exception, match="holds at most 84 nodes"):  # 4 + 16 + 64 with the selector's top 4
        Engine(target, load_drafter(drafter_dir, target, max_len=128), max_len=128, window=4, tree=85)


def test_convert_dflash_writes_q8_0_as_llama_quantize_does(pair2, tmp_path):
    """`convert-dflash --type Q8_0`: the matrices whose rows fill Q8_0's 32-value blocks in those blocks (quantized
    from their BF16 values, as llama-quantize quantizes the BF16 file: tools/llamacpp_dflash2_check.py compares
    them byte for byte), the others in F16 (its fallback), llama.cpp's file type 7; read back bit-exact and
    decoding as target-only."""
    import gguf
    import numpy as np
    from gguf import quants

    from conftest import run_cli
    from strata.dflash.random_init import as_stored

    target_dir, drafter_dir, target, d = pair2
    bf16, q8 = tmp_path / "d2.gguf", tmp_path / "d2-q8_0.gguf"
    assert run_cli("convert-dflash", drafter_dir, bf16, "--quiet").returncode == 0  # its own tokenizer.json
    r = run_cli("convert-dflash", drafter_dir, q8, "--type", "Q8_0", "--quiet")
    assert r.returncode == 0 and "Q8_0" in r.stderr, r.stderr
    plain, blocks = gguf.GGUFReader(str(bf16)), gguf.GGUFReader(str(q8))
    assert blocks.fields["general.file_type"].contents() == 7
    by_name = {t.name: t for t in plain.tensors}
    kinds = set()
    for t in blocks.tensors:
        src = by_name[t.name]
        values = quants.dequantize(np.asarray(src.data), src.tensor_type)
        if src.tensor_type.name == "BF16" and src.shape[0] % 32 == 0:  # ggml's shape: the row first
            want = quants.quantize(values, gguf.GGMLQuantizationType.Q8_0)
            assert t.tensor_type.name == "Q8_0" and np.array_equal(np.asarray(t.data), want), t.name
        elif src.tensor_type.name == "BF16":  # rows of 8 (the codebooks): llama-quantize's fallback, F16
            assert t.tensor_type.name == "F16" and np.array_equal(np.asarray(t.data), values.astype(np.float16))
        else:
            assert t.tensor_type == src.tensor_type and np.array_equal(np.asarray(t.data), np.asarray(src.data))
        kinds.add(t.tensor_type.name)
    assert kinds == {"Q8_0", "F16", "F32"}
    mine, theirs = as_stored(load_artifact(bf16), "Q8_0"), load_artifact(q8)  # what bench's random drafters use
    assert mine.types == theirs.types and mine.blocks.keys() == theirs.blocks.keys()
    assert all(torch.equal(mine.tensors[n], t) for n, t in theirs.tensors.items())
    assert all(mine.blocks[n][0] == k and torch.equal(mine.blocks[n][1], rows)
               for n, (k, rows) in theirs.blocks.items())
    prompt = [3, 99, 14, 250, 8, 8, 41]
    res = Engine(target, load_drafter(q8, target, max_len=128), max_len=128, window=8).generate(prompt, 40)
    assert res.output_ids == Engine(target, max_len=128).generate(prompt, 40).output_ids
