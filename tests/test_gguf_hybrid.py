"""llama.cpp's hybrid GGUF targets (qwen35, qwen35moe, qwen3next), written as its converter and llama-quantize lay
them out (tests/hybrid_layout.py) from tiny checkpoints transformers writes: greedy decoding equals transformers'
on the values each file holds, eagerly and in static shapes, on the quantized kernels too; speculation with partial
acceptance (the hybrid rollback) and the expert budget change no token; an MTP block is skipped; bad metadata is a
one-line error."""

from __future__ import annotations

import shutil

import gguf
import pytest
import torch
from safetensors.torch import load_file, save_file

from strata.engine.decode import Engine
from strata.engine.prompt_lookup import PromptLookupDrafter
from strata.models.loader import load_target

from conftest import cli, write_hf_drafter, write_hf_model
from hybrid_layout import ARCH, COMMON, SHAPES, from_gguf, to_gguf, write
from test_gguf_target import qwen2_tokenizer
from test_hybrid import Truncating

T = gguf.GGMLQuantizationType
PROMPT = [5, 17, 200, 31, 7, 5, 17, 200, 31, 9, 64]


@pytest.fixture(scope="module")
def hybrids(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf-hybrid")
    out = {}
    for family in ARCH:
        path, _ = write_hf_model(d / family, family, seed=31, vocab=320, **COMMON, **SHAPES[family])
        qwen2_tokenizer(path, 320)
        out[family] = path
    return d, out


def reference(d, hf_dir, stored, name):
    """transformers' model of the values a file holds (its config, the stored values as its checkpoint)."""
    import transformers

    folder = d / name
    folder.mkdir()
    shutil.copy(hf_dir / "config.json", folder / "config.json")
    save_file({k: v.contiguous() for k, v in stored.items()}, str(folder / "model.safetensors"))
    return transformers.AutoModelForCausalLM.from_pretrained(folder).eval()


def transformers_greedy(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def test_the_layout_reads_back_into_the_checkpoint(hybrids):
    """to_gguf then from_gguf gives the checkpoint back (the norms' +1 and A's -exp within float32 rounding)."""
    _, hf = hybrids
    import json

    for family, folder in hf.items():
        tensors = load_file(folder / "model.safetensors")
        cfg = json.loads((folder / "config.json").read_text())
        back = from_gguf(to_gguf(tensors, cfg, family), cfg, family)
        assert back.keys() == tensors.keys()
        for name, t in tensors.items():
            assert torch.allclose(back[name], t.float(), rtol=1e-6, atol=1e-6), name


@pytest.mark.parametrize("family,qtype", [("qwen3_5", T.F32), ("qwen3_5_moe", T.F32), ("qwen3_next", T.F32),
                                          ("qwen3_5", T.Q4_K), ("qwen3_5_moe", T.Q8_0), ("qwen3_next", T.Q5_K),
                                          ("qwen3_5_moe", T.IQ4_XS), ("qwen3_next", T.Q3_K)],
                         ids=lambda x: getattr(x, "name", x))
def test_hybrid_gguf_decodes_as_transformers_on_its_values(hybrids, family, qtype):
    d, hf = hybrids
    path = d / f"{family}-{qtype.name}.gguf"
    stored = write(path, hf[family], family, qtype, seed=int(qtype), mtp=qtype == T.Q8_0)
    want = transformers_greedy(reference(d, hf[family], stored, f"{family}-{qtype.name}-ref"), PROMPT, 24)
    target = load_target(path)
    for backend in ("eager", "static"):
        assert Engine(target, max_len=128, backend=backend).generate(PROMPT, 24).output_ids == want, backend


def test_quantized_hybrid_rows_stay_in_their_blocks(hybrids):
    """On the quantized kernels' path every matrix stays in the file's blocks, the rows the loader reorders or
    picks (partial RoPE's q/k order, qwen3next's b and a of ssm_ba) moved as whole quantized rows: each holds
    the values the file dequantized at load holds."""
    from strata.layers.quant import QuantWeight

    d, hf = hybrids
    for family in ("qwen3_5", "qwen3_next"):
        path = d / f"{family}-kept.gguf"
        write(path, hf[family], family, T.Q8_0, seed=3)
        kept, plain = load_target(path, quantized=True), load_target(path).state_dict()
        matrices = {f"{name}.{attr}": v for name, m in kept.named_modules() for attr, v in vars(m).items()
                    if isinstance(v, QuantWeight)}
        assert {"layers.0.linear_attn.in_proj.weight", "layers.3.self_attn.qkv_proj.weight"} <= set(matrices)
        for name, w in matrices.items():
            assert torch.equal(w.dequantize().float(), plain[name].float()), name
        assert kept.dequantized == {}


def test_types_without_a_device_kernel_are_dequantized_at_load_and_said_so(hybrids):
    """Q5_0 matrices (no device kernel) load as floats on the kernels' path, named with their bytes; Q3_K ones
    stay in their blocks."""
    from strata.models.loader import dequantized_report

    d, hf = hybrids
    path = d / "q5_0.gguf"
    write(path, hf["qwen3_5"], "qwen3_5", T.Q5_0, seed=4)
    kept = load_target(path, quantized=True)
    assert kept.dequantized["blk.0.attn_qkv.weight"] == ("Q5_0", 512 * 256 * 4)
    line = dequantized_report(kept, path)
    assert "Q5_0" in line and "blk.0.attn_qkv.weight (Q5_0)" in line and "float32" in line and \
        len(line.splitlines()) == 1
    path = d / "q3_k.gguf"
    write(path, hf["qwen3_5"], "qwen3_5", T.Q3_K, seed=4)
    assert load_target(path, quantized=True).dequantized == {}


def test_speculation_and_the_expert_budget_on_a_hybrid_gguf(hybrids):
    """A DFlash drafter, prompt lookup and every acceptance length of a drafter (each a rollback of the recurrent
    state) equal target-only, eagerly and in static shapes; experts kept in host memory change no token."""
    from strata.dflash.drafter import load_drafter

    d, hf = hybrids
    path = d / "moe-spec.gguf"
    write(path, hf["qwen3_5_moe"], "qwen3_5_moe", T.Q8_0, seed=7)
    target = load_target(path)
    base = Engine(target, max_len=128).generate(PROMPT, 40).output_ids
    drafter_dir = write_hf_drafter(d / "drafter", layers=1, hidden=256, heads=4, kv_heads=2, head_dim=64,
                                   intermediate=256, taps=(0, 2), num_target_layers=4, vocab=320, mask_token_id=319)
    for backend in ("eager", "static"):
        dflash = Engine(target, load_drafter(drafter_dir, target, max_len=128), max_len=128, backend=backend)
        assert dflash.generate(PROMPT, 40).output_ids == base
        lookup = Engine(target, PromptLookupDrafter(3), max_len=128, window=8, backend=backend)
        assert lookup.generate(PROMPT, 40).output_ids == base
        res = Engine(target, Truncating(PROMPT + base, 8, 320), max_len=128, window=8,
                     backend=backend).generate(PROMPT, 40)
        assert res.output_ids == base and res.accept_lengths[:8] == [1, 2, 3, 4, 5, 6, 7, 8]
    from strata.models.placement import place_experts

    budget = load_target(path, place=lambda m: place_experts(m, "cpu", 1, 128))
    assert sum(layer.mlp.host_experts for layer in budget.layers) > 0
    assert Engine(budget, max_len=128).generate(PROMPT, 40).output_ids == base


def test_hybrid_gguf_metadata_errors_are_one_line(hybrids, monkeypatch, tmp_path):
    d, hf = hybrids
    real = gguf.GGUFWriter.write_header_to_file
    cases = [("qwen35.ssm.time_step_rank", 3, "time_step_rank"),
             ("qwen35.rope.dimension_count", 200, "rope.dimension_count"),
             ("qwen35.nextn_predict_layers", 4, "nextn_predict_layers"),
             ("qwen35.attention.recurrent_layers", None, None)]
    for key, value, needle in cases:
        def edit(w, key=key, value=value):
            w.kv_data[0].pop(key, None)
            if value is not None:
                w.add_uint32(key, value)
            return real(w)

        monkeypatch.setattr(gguf.GGUFWriter, "write_header_to_file", edit)
        path = tmp_path / f"{key}.gguf"
        write(path, hf["qwen3_5"], "qwen3_5")
        monkeypatch.undo()
        if needle is None:  # without the list, every fourth layer attends (llama.cpp's default interval)
            assert load_target(path).cfg.linear.layers == [0, 1, 2]
            continue
        code, err = cli("generate", "--model", path, "--prompt-ids", "1,2", "--max-new-tokens", "2")
        assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err


#: the tiny hybrid with experts in every layer and a shared one (Qwen3.5-MoE's layout: qwen35moe)
TINY_HYBRID_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=32)


@pytest.mark.parametrize("overrides", [{}, TINY_HYBRID_MOE], ids=["qwen35", "qwen35moe"])
def test_init_random_writes_a_shape_as_a_gguf_file(tmp_path, overrides):
    """The random GGUF of a shape reads back as the shape's config (the types llama-quantize would give it: rows
    of 64 values are not whole Q4_K blocks, so Q8_0) and decodes as its values do in a folder."""
    from strata.models.random_gguf import write_random_gguf
    from strata.models.random_init import shape_config

    path = tmp_path / "tiny.gguf"
    counts = write_random_gguf(path, "tiny-hybrid", "Q4_K_M", seed=2, **overrides)
    assert set(counts) == {"F32", "Q8_0"} and counts["Q8_0"] > 10
    fam, cfg, _ = shape_config("tiny-hybrid", **overrides)
    got = load_target(path)
    assert got.cfg.family == fam.name and got.cfg.moe == cfg.moe and got.cfg.rope.rotary_dim == cfg.rope.rotary_dim
    assert (got.cfg.linear.layers, got.cfg.linear.v_heads, got.cfg.linear.tiled) == (cfg.linear.layers, 4, True)
    assert len(Engine(got, max_len=64).generate([1, 2, 3], 8).output_ids) == 8


def test_init_random_gguf_from_the_command_line(tmp_path):
    path = tmp_path / "r.gguf"
    code, err = cli("init-random", "--shape", "tiny-hybrid", "--quant", "Q8_0", path)
    assert code == 0 and "Q8_0" in err and path.is_file(), err
    code, err = cli("init-random", "--shape", "tiny-hybrid", "--quant", "Q8_0", path)
    assert code == 2 and "--force" in err, err
    code, err = cli("generate", "--model", path, "--prompt-ids", "1,2", "--max-new-tokens", "3")
    assert code == 0, err


def test_a_q3_k_m_file_keeps_its_q3_k_and_iq3_xxs_blocks(tmp_path):
    """Q3_K_M and IQ3_XXS random files of a tiny hybrid with 256-wide rows: their Q3_K / IQ3_XXS matrices stay in
    their blocks on the kernels' path (nothing dequantized at load), holding the values the CPU's load gives.
    The file types --quant offers are the recipes Strata writes."""
    from strata.cli_options import QUANTS
    from strata.layers.quant import RECIPES, QuantWeight
    from strata.models.random_gguf import write_random_gguf

    assert QUANTS == list(RECIPES)
    for recipe, kind in (("Q3_K_M", "Q3_K"), ("IQ3_XXS", "IQ3_XXS")):
        path = tmp_path / f"{recipe}.gguf"
        counts = write_random_gguf(path, "tiny-hybrid", recipe, hidden_size=256, intermediate_size=256, head_dim=64,
                                   linear_key_head_dim=64, linear_value_head_dim=64)
        assert counts[kind] >= 10, counts
        kept, plain = load_target(path, quantized=True), load_target(path).state_dict()
        assert kept.dequantized == {}
        for name, m in kept.named_modules():
            for attr, w in vars(m).items():
                if isinstance(w, QuantWeight) and any(s.qtype == getattr(T, kind) for s in w.segments):
                    assert torch.equal(w.dequantize().float(), plain[f"{name}.{attr}"].float()), name


def test_bench_quantizes_a_random_hybrid_as_llama_quantize_would():
    """`bench --shape ... --quant` on a hybrid (with experts): its matrices in blocks, the routers and the
    DeltaNet convolution left in float (they were refused as matrices of 4-value rows); it decodes."""
    from strata.layers.quant import QuantWeight
    from strata.models.random_init import random_target

    wide = dict(hidden_size=256, intermediate_size=256, head_dim=64, linear_key_head_dim=64, linear_value_head_dim=64,
                **{**TINY_HYBRID_MOE, "moe_intermediate_size": 256, "shared_expert_intermediate_size": 256})
    kept = random_target("tiny-hybrid", quant="Q4_K_M", quantized=True, **wide)
    mixer, mlp = kept.layers[0].mixer, kept.layers[0].mlp
    assert isinstance(mixer.in_proj.weight, QuantWeight) and isinstance(mixer.conv_weight, torch.nn.Parameter)
    assert isinstance(mlp.shared_expert_gate.weight, torch.nn.Parameter) and isinstance(mlp.gate.weight,
                                                                                        torch.nn.Parameter)
    plain = random_target("tiny-hybrid", quant="Q4_K_M", **wide)
    assert len(Engine(plain, max_len=64).generate([1, 2, 3], 4).output_ids) == 4


@pytest.mark.parametrize("qtype", [T.F32, T.Q8_0], ids=lambda x: x.name)
def test_fused_qkv_and_gate_up_experts_load_as_their_parts(hybrids, qtype):
    """A file with the converter's --fuse-qkv and --fuse-gate-up-exps tensors (attn_qkv of a full-attention layer,
    ffn_gate_up_exps) loads as the file with the parts: the same values, dequantized at load and in their blocks
    (QuantWeight, QuantExperts), and the same tokens."""
    from strata.layers.quant import QuantExperts, QuantWeight

    d, hf = hybrids
    plain, fused = d / f"parts-{qtype.name}.gguf", d / f"fused-{qtype.name}.gguf"
    write(plain, hf["qwen3_5_moe"], "qwen3_5_moe", qtype, seed=9)
    write(fused, hf["qwen3_5_moe"], "qwen3_5_moe", qtype, seed=9, fuse=True)
    names = {t.name for t in gguf.GGUFReader(fused).tensors}
    assert "blk.3.attn_qkv.weight" in names and "blk.0.ffn_gate_up_exps.weight" in names and \
        "blk.3.attn_q.weight" not in names
    a, b = load_target(fused), load_target(plain)
    for name, t in b.state_dict().items():
        assert torch.equal(a.state_dict()[name], t), name
    assert Engine(a, max_len=64).generate(PROMPT, 12).output_ids == \
        Engine(b, max_len=64).generate(PROMPT, 12).output_ids
    if qtype != T.F32:
        ka, kb = load_target(fused, quantized=True), load_target(plain, quantized=True)
        for la, lb in zip(ka.layers, kb.layers):
            pairs = [(la.mlp.gate_up_proj, lb.mlp.gate_up_proj)]
            if hasattr(la.mixer, "qkv_proj"):
                pairs.append((la.mixer.qkv_proj.weight, lb.mixer.qkv_proj.weight))
            for wa, wb in pairs:
                assert isinstance(wa, (QuantWeight, QuantExperts)) and torch.equal(wa.dequantize(), wb.dequantize())
