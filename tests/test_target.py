"""The target decoder against transformers' own implementation."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from strata.dflash.drafter import load_drafter
from strata.engine.decode import Engine
from strata.engine.sampling import SamplingParams
from strata.errors import StrataError
from strata.models.loader import check_tensors, dequantize_fp8, load_target
from strata.models.random_init import random_target

from conftest import cache_equal, cli, forward_at, write_hf_drafter, write_hf_model

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


def write_fp8(folder: Path, block: int) -> None:
    """A checkpoint folder made block-scaled FP8 as Qwen publishes it: each projection matrix in e4m3 with a
    float32 weight_scale_inv per block (its largest magnitude over e4m3's 448), embeddings and norms kept."""
    tensors = load_file(folder / "model.safetensors")
    for name in [n for n in tensors if n.endswith("proj.weight")]:
        w = tensors[name]
        grid = w.reshape(w.shape[0] // block, block, w.shape[1] // block, block)
        scale = grid.abs().amax(dim=(1, 3)) / 448
        tensors[name] = (grid / scale[:, None, :, None]).reshape(w.shape).to(torch.float8_e4m3fn)
        tensors[name + "_scale_inv"] = scale
    save_file(tensors, str(folder / "model.safetensors"))
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [block, block]}
    (folder / "config.json").write_text(json.dumps(cfg))


def test_block_scaled_fp8_checkpoints_decode_as_transformers_dequantizes_them(tmp_path):
    import transformers

    path, _ = write_hf_model(tmp_path / "fp8", "qwen3", seed=5)
    write_fp8(path, 32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)  # on a CPU it dequantizes
    prompt = [3, 17, 99, 4, 250]
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt):].tolist()
    model = load_target(path)
    assert torch.equal(model.layers[1].mlp.down_proj.weight, hf.model.layers[1].mlp.down_proj.weight.detach())
    assert Engine(model).generate(prompt, 24).output_ids == ref
    fp8 = torch.tensor([[1.5, -2.0, 0.25, 3.0, 1.0]]).repeat(5, 1).to(torch.float8_e4m3fn)  # partial last blocks
    scale = torch.tensor([[2.0, 3.0], [5.0, 7.0]])
    got = dequantize_fp8({"w": fp8, "w_scale_inv": scale}, (4, 4), "x")["w"]
    assert torch.equal(got, torch.tensor([[[1.5, -2.0, 0.25, 3.0, 1.0]]]).repeat(5, 1, 1)[:, 0]
                       * torch.tensor([[2.0] * 4 + [3.0]] * 4 + [[5.0] * 4 + [7.0]]))


@pytest.mark.parametrize("edit,needle", [
    (dict(config={"quantization_config": {"quant_method": "bitsandbytes", "load_in_8bit": True}},
          tensors={"model.layers.0.mlp.down_proj.weight": torch.int8, "model.layers.0.mlp.down_proj.SCB": None}),
     "quantization_config.quant_method 'bitsandbytes' is not supported"),
    (dict(config={"quantization_config": {"quant_method": "fp8", "activation_scheme": "static"}}),
     "weight_block_size must be [rows, cols]"),
    (dict(config={"quantization_config": {"quant_method": "fp8", "weight_block_size": [32, 32]}},
          tensors={"model.layers.0.mlp.down_proj.weight": torch.float8_e4m3fn}),
     "FP8 tensor 'model.layers.0.mlp.down_proj.weight' has no 'model.layers.0.mlp.down_proj.weight_scale_inv'"),
    (dict(tensors={"model.layers.0.mlp.down_proj.weight": torch.float8_e4m3fn}),
     "tensor 'model.layers.0.mlp.down_proj.weight' has dtype float8_e4m3fn, expected float32"),
    (dict(tensors={"model.layers.1.self_attn.q_proj.weight": torch.int32}),
     "tensor 'model.layers.1.self_attn.q_proj.weight' has dtype int32"),
    (dict(tensors={"model.norm.weight": torch.bool}), "tensor 'model.norm.weight' has dtype bool"),
], ids=["bitsandbytes", "fp8-per-tensor", "fp8-no-scale", "f8-no-config", "int32", "bool"])
def test_checkpoints_strata_cannot_run_are_refused_by_field_or_tensor(qwen3_dir, tmp_path, edit, needle):
    folder = shutil.copytree(qwen3_dir, tmp_path / "m")
    tensors = load_file(folder / "model.safetensors")
    for name, dtype in edit.get("tensors", {}).items():
        tensors[name] = torch.ones(4) if dtype is None else tensors[name].to(dtype)
    save_file(tensors, str(folder / "model.safetensors"))
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, **edit.get("config", {})}))
    code, err = cli("generate", "--model", folder, "--prompt-ids", "1,2", "--max-new-tokens", "2")
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err


def test_non_finite_weights_stop_the_decode_with_an_error_and_check_tensors_finds_them(qwen3_dir, tmp_path):
    folder = shutil.copytree(qwen3_dir, tmp_path / "m")
    tensors = load_file(folder / "model.safetensors")
    prompt = [1, 2, 3]
    others = torch.ones(256, dtype=torch.bool)
    others[prompt] = False
    tensors["model.embed_tokens.weight"][others] = float("nan")  # the prompt is fine, what follows it is not
    save_file(tensors, str(folder / "model.safetensors"))
    model = load_target(folder)
    drafter = write_hf_drafter(tmp_path / "d", taps=(0, 2), block_size=4)
    for kw in (dict(), dict(backend="static"), dict(params=SamplingParams(0.8, seed=1)), dict(drafter=drafter),
               dict(drafter=drafter, tree=6)):
        d = kw.pop("drafter", None)
        params = kw.pop("params", SamplingParams())
        engine = Engine(model, load_drafter(d, model) if d else None, **kw)
        with pytest.raises(StrataError, match="the target's logits at position 3 are not finite"):
            engine.generate(prompt, 8, params=params)
    code, err = cli("generate", "--model", folder, "--prompt-ids", "1,2,4", "--max-new-tokens", "8")
    assert code == 2 and "logits at position 2 are not finite (NaN or inf)" in err and "--check-tensors" in err, err
    code, err = cli("generate", "--model", folder, "--prompt-ids", "1,2", "--check-tensors")
    assert code == 2 and "--check-tensors: tensor 'embed_tokens.weight' holds 16192 non-finite values" in err, err
    quantized = random_target("tiny", quant="Q8_0", quantized=True, hidden_size=256, intermediate_size=256, head_dim=64)
    check_tensors(quantized, "q")
    segment = quantized.layers[2].mlp.down_proj.weight.segments[0]
    segment.data[7, 34:36] = torch.tensor([0x00, 0x7C], dtype=torch.uint8)  # block 2 of row 7: d = +inf
    with pytest.raises(StrataError, match="'layers.2.mlp.down_proj.weight' holds 1 quantized blocks whose scales"):
        check_tensors(quantized, "q")
