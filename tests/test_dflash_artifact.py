"""The DFlash artifact: converter, strict loader, export, inspect, and the refusals."""

from __future__ import annotations

import json
import re
import struct

import gguf
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from safetensors.torch import load_file, save_file

from strata.dflash import contract as C
from strata.dflash.artifact import load_artifact
from strata.dflash.converter import convert_hf_to_gguf
from strata.errors import ArtifactError

from conftest import run_cli, write_hf_drafter


@pytest.mark.parametrize("layers,dtype", [(1, torch.bfloat16), (2, torch.float32), (5, torch.float16)])
def test_convert_read_back_and_round_trip(tmp_path, layers, dtype):
    src = write_hf_drafter(tmp_path / "hf", layers=layers, dtype=dtype, taps=(0, 1, 2), seed=layers,
                           block_in_dflash_config=layers == 2)
    out = tmp_path / "d.gguf"
    r = run_cli("convert-dflash", src, out)
    assert r.returncode == 0, r.stderr
    assert "read-back bit-exact" in r.stderr

    source = load_file(src / "model.safetensors")
    art = load_artifact(out)
    assert len(art.tensors) == 11 * layers + 3
    for name, t in source.items():  # independent check: 2-D are the RNE-rounded source, 1-D its exact float32
        if t.dim() == 1:
            assert art.tensors[name].dtype == torch.float32 and torch.equal(art.tensors[name], t.float()), name
            continue
        ref = t.to(torch.bfloat16) if dtype != torch.float32 else torch.from_numpy(_rne_bf16(t.numpy()))
        assert torch.equal(art.tensors[name].view(torch.int16), ref.view(torch.int16)), name

    reader = gguf.GGUFReader(str(out))
    fields = reader.fields
    assert bytes(fields["general.architecture"].parts[-1]).decode() == "dflash"
    assert [int(fields["dflash.target_layers"].parts[i][0]) for i in fields["dflash.target_layers"].data] == [1, 2, 3]
    assert fields["dflash.target_layers"].types == [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32]
    assert int(fields["dflash.block_size"].parts[-1][0]) == 8
    assert fields["dflash.block_size"].types == [gguf.GGUFValueType.UINT32]
    assert int(fields["tokenizer.ggml.mask_token_id"].parts[-1][0]) == 255
    for key, value in [("dflash.block_count", layers), ("dflash.embedding_length", 64),
                       ("dflash.feed_forward_length", 96), ("dflash.attention.head_count", 4),
                       ("dflash.attention.head_count_kv", 2), ("dflash.attention.key_length", 16),
                       ("dflash.attention.value_length", 16), ("dflash.context_length", 4096)]:
        assert int(fields[key].parts[-1][0]) == value, key
    assert float(fields["dflash.rope.freq_base"].parts[-1][0]) == 1e6
    shapes = {t.name: [int(x) for x in t.shape] for t in reader.tensors}
    assert len(shapes) == 11 * layers + 3
    assert shapes["fc.weight"] == [3 * 64, 64]
    assert shapes["blk.0.attn_q.weight"] == [64, 64] and shapes["blk.0.attn_k.weight"] == [64, 32]
    assert shapes["blk.0.ffn_down.weight"] == [96, 64] and shapes["enc.output_norm.weight"] == [64]
    for t in reader.tensors:  # what llama.cpp's converter writes: norms in F32, matrices in BF16
        assert t.tensor_type == (gguf.GGMLQuantizationType.F32 if len(t.shape) == 1 else
                                 gguf.GGMLQuantizationType.BF16), t.name
    assert bytes(fields["general.type"].parts[-1]).decode() == "model"
    assert int(fields["general.file_type"].parts[-1][0]) == 32 and int(fields["general.quantization_version"].parts[-1][0]) == 2
    assert bytes(fields["tokenizer.ggml.model"].parts[-1]).decode() == "gpt2"
    assert bytes(fields["tokenizer.ggml.pre"].parts[-1]).decode() == "gpt-2"
    assert len(fields["tokenizer.ggml.tokens"].data) == 256 and len(fields["tokenizer.ggml.token_type"].data) == 256

    back = tmp_path / "back"
    r = run_cli("export-dflash", out, back)
    assert r.returncode == 0, r.stderr
    again = load_file(back / "model.safetensors")
    assert set(again) == set(source)
    for name, t in again.items():
        assert t.dtype == art.tensors[name].dtype and torch.equal(t, art.tensors[name])
    if dtype == torch.bfloat16:  # HF -> GGUF -> HF keeps every BF16 source value exactly
        for name, t in source.items():
            assert torch.equal(again[name].to(torch.bfloat16).view(torch.int16), t.view(torch.int16))
    cfg = json.loads((back / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["dflash_config"] == {"mask_token_id": 255, "target_layer_ids": [0, 1, 2]}
    assert cfg["block_size"] == 8 and cfg["rms_norm_eps"] == 1e-6
    assert load_artifact(back).cfg == art.cfg


def _rne_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits, round to nearest even, written independently of torch."""
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype(np.uint16).view(np.int16)


def test_default_taps_rule(tmp_path):
    src = write_hf_drafter(tmp_path / "hf", taps=(1, 9, 17, 25, 33), with_taps=False, num_target_layers=36,
                           target_hidden=64)
    art = load_artifact(src)
    assert art.cfg.target_layer_ids == [1, 9, 17, 25, 33]
    convert_hf_to_gguf(src, tmp_path / "d.gguf", progress=False)
    r = gguf.GGUFReader(str(tmp_path / "d.gguf"))
    f = r.fields["dflash.target_layers"]
    assert [int(f.parts[i][0]) for i in f.data] == [2, 10, 18, 26, 34]
    assert C.default_target_layers(1, 36) == [18]


def test_inspect(tmp_path):
    src = write_hf_drafter(tmp_path / "hf", layers=5)
    out = tmp_path / "d.gguf"
    convert_hf_to_gguf(src, out, progress=False)
    r = run_cli("inspect", out)
    assert r.returncode == 0, r.stderr
    assert "tensors: 58" in r.stdout and "verdict: OK" in r.stdout
    assert "taps (HF layer ids): [0, 2]" in r.stdout and "(GGUF boundaries, dflash.target_layers): [1, 3]" in r.stdout
    assert "block size: 8" in r.stdout and "mask token id: 255" in r.stdout


# ------------------------------------------------------------------ refusals

def _gguf_from(tmp_path, mutate_tensors=None, mutate_kv=None, types=None):
    """Write a GGUF by hand (the gguf package's writer) with controlled damage."""
    src = write_hf_drafter(tmp_path / "hf", layers=1)
    art = load_artifact(src)
    from strata.dflash.gguf_format import metadata as gguf_metadata

    path = tmp_path / "bad.gguf"
    w = gguf.GGUFWriter(str(path), "dflash")
    kv = {k: (kind, v) for k, kind, v in gguf_metadata(art.cfg)}
    if mutate_kv:
        mutate_kv(kv)
    for key, (kind, value) in kv.items():
        if kind == "int32_array":
            w.add_key_value(key, value, gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.INT32)
        else:
            getattr(w, f"add_{kind}")(key, value)
    tensors = {C.hf_to_gguf_name(n): t.to(torch.bfloat16) for n, t in art.tensors.items()}
    if mutate_tensors:
        mutate_tensors(tensors)
    for name, t in tensors.items():
        kind = (types or {}).get(name, "bf16")
        if kind == "bf16":
            arr = t.contiguous().view(torch.int16).numpy().view(np.uint16)
            w.add_tensor(name, arr, raw_shape=arr.shape, raw_dtype=gguf.GGMLQuantizationType.BF16)
        elif kind == "f32":
            w.add_tensor(name, t.float().numpy())
        elif kind == "f16":
            w.add_tensor(name, t.half().numpy())
        elif kind == "q8_0":
            from gguf.quants import quantize

            data = quantize(t.float().numpy(), gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _expect_refusal(path, needle, cli=False):
    with pytest.raises(ArtifactError) as e:
        load_artifact(path)
    assert needle in str(e.value) and str(e.value).startswith(str(path))
    if cli:  # the same error through the real command line: its verdict and exit code 2
        r = run_cli("inspect", path)
        assert r.returncode == 2, r.stdout + r.stderr
        assert needle in r.stdout, r.stdout


def _drop(name):
    return lambda t: t.pop(name)


def _add(name, shape=(4, 64)):
    return lambda t: t.__setitem__(name, torch.zeros(shape, dtype=torch.bfloat16))


@pytest.mark.parametrize("mutate,needle", [
    (_drop("blk.0.ffn_up.weight"), "missing layers.0.mlp.up_proj.weight"),
    (_add("blk.0.extra.weight"), "unexpected blk.0.extra.weight"),
    (lambda t: t.__setitem__("blk.0.attn_k.weight", torch.zeros(16, 64, dtype=torch.bfloat16)),
     "tensor 'blk.0.attn_k.weight' has shape [16, 64]"),
    (_add("blk.0.attn_conv_base.weight"), "DFlash2"),
    (_add("blk.0.attn_conv_proj.weight"), "DFlash2"),
    (_add("blk.0.ffn_conv_proj.weight"), "DFlash2"),
    (_add("selector_hidden.weight"), "DFlash2 (candidate selector)"),
    (_add("selector_predecessor.weight"), "DFlash2 (candidate selector)"),
    (_add("markov_w1.weight"), "missing markov_head.markov_w2.weight"),
    (_add("markov_head.weight"), "DSpark (Markov head)"),
    (_add("confidence_head.weight"), "confidence head"),
    (_add("conf_proj.weight"), "confidence head"),
    (_add("token_embd.weight"), "its own embedding"),
    (_add("output.weight"), "its own LM head"),
    (_add("d2t", (8,)), "d2t/t2d"),
])
def test_gguf_tensor_refusals(tmp_path, mutate, needle):
    _expect_refusal(_gguf_from(tmp_path, mutate_tensors=mutate), needle, cli=needle.startswith("DSpark"))


def test_gguf_type_refusals(tmp_path):
    """A norm (1-D) must be a float type; quantized types are for matrices."""
    path = _gguf_from(tmp_path, types={"blk.0.attn_norm.weight": "q8_0"})
    _expect_refusal(path, "tensor 'blk.0.attn_norm.weight' has type Q8_0, expected one of BF16, F16, F32", cli=True)


@pytest.mark.parametrize("mutate,needle", [
    (lambda kv: kv.pop("dflash.block_size"), "missing metadata key 'dflash.block_size'"),
    (lambda kv: kv.__setitem__("dflash.block_size", ("uint32", 1)), "block_size must be an integer >= 2"),
    (lambda kv: kv.pop("tokenizer.ggml.mask_token_id"), "missing metadata key 'tokenizer.ggml.mask_token_id'"),
    (lambda kv: kv.pop("dflash.target_layers"), "'dflash.target_layers' must be a non-empty integer array"),
    (lambda kv: kv.__setitem__("dflash.target_layers", ("int32_array", [0, 3])), "must be >= 1"),
    (lambda kv: kv.__setitem__("dflash.attention.layer_norm_rms_epsilon", ("string", "tiny")), "'dflash.attention.layer_norm_rms_epsilon' must be"),
    (lambda kv: kv.__setitem__("dflash.attention.head_count", ("uint32", 3)), "not a multiple of kv head count"),
])
def test_gguf_metadata_refusals(tmp_path, mutate, needle):
    _expect_refusal(_gguf_from(tmp_path, mutate_kv=mutate), needle)


def test_wrong_architecture_refused(tmp_path):
    path = tmp_path / "llama.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("x", np.zeros(4, dtype=np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    _expect_refusal(path, "general.architecture is 'llama', expected 'dflash'")


@pytest.mark.parametrize("extra,needle", [
    ({"layers.0.attention_conv.weight": (4, 4)}, "DFlash2"),
    ({"candidate_selector.weight": (4, 4)}, "DFlash2 (candidate selector)"),
    ({"markov_head.weight": (4, 4)}, "DSpark"),
    ({"embed_tokens.weight": (256, 64)}, "its own embedding"),
    ({"lm_head.weight": (256, 64)}, "its own LM head"),
    ({"t2d": (256,)}, "d2t/t2d"),
])
def test_hf_refusals(tmp_path, extra, needle):
    src = write_hf_drafter(tmp_path / "hf", extra_tensors={k: torch.zeros(s) for k, s in extra.items()})
    _expect_refusal(src, needle, cli=needle == "DFlash2")


def test_dflash2_architecture_without_its_config_refused(tmp_path):
    src = write_hf_drafter(tmp_path / "hf", extra_config={"architectures": ["DFlash2DraftModel"]})
    _expect_refusal(src, "architecture DFlash2DraftModel needs dflash_config's conv_kernel_size, conv_group_size, "
                         "selector_rank, selector_top_k")


def test_failed_conversion_leaves_nothing(tmp_path):
    src = write_hf_drafter(tmp_path / "hf")
    sd = load_file(src / "model.safetensors")
    del sd["layers.1.mlp.down_proj.weight"]
    save_file(sd, src / "model.safetensors")
    (tmp_path / "out").mkdir()
    out = tmp_path / "out" / "d.gguf"
    r = run_cli("convert-dflash", src, out)
    assert r.returncode == 2
    assert "missing layers.1.mlp.down_proj.weight" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not any((tmp_path / "out").iterdir())


def test_readback_mismatch_aborts_and_cleans_up(tmp_path, monkeypatch):
    """A writer that corrupts one tensor must fail the read-back check and leave no output."""
    import strata.dflash.converter as conv

    real = conv.write_gguf

    def corrupting(path, cfg, tensors, vocab, name, progress=False, qtype="BF16"):
        tensors = dict(tensors)
        t = tensors["layers.0.mlp.up_proj.weight"].clone()
        t.view(torch.int16)[0, 0] ^= 1
        tensors["layers.0.mlp.up_proj.weight"] = t
        real(path, cfg, tensors, vocab, name, progress, qtype)

    monkeypatch.setattr(conv, "write_gguf", corrupting)
    out = tmp_path / "d.gguf"
    with pytest.raises(ArtifactError, match="read-back of tensor 'layers.0.mlp.up_proj.weight' differs"):
        convert_hf_to_gguf(write_hf_drafter(tmp_path / "hf"), out, progress=False)
    assert list(tmp_path.glob("*.gguf*")) == [] and list(tmp_path.glob(".d.gguf*")) == []


# ------------------------------------------------------------------ corruption (hypothesis)

@pytest.fixture(scope="module")
def valid_gguf(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz")
    src = write_hf_drafter(d / "hf", layers=1, hidden=32, heads=2, kv_heads=1, head_dim=16, intermediate=32,
                           taps=(0,))
    out = d / "d.gguf"
    convert_hf_to_gguf(src, out, progress=False)
    return out.read_bytes()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_truncated_or_flipped_file_is_artifact_error_or_valid(tmp_path_factory, valid_gguf, data):
    blob = bytearray(valid_gguf)
    if data.draw(st.booleans(), label="truncate"):
        blob = blob[: data.draw(st.integers(0, len(blob) - 1), label="cut")]
    else:
        for _ in range(data.draw(st.integers(1, 4), label="flips")):
            i = data.draw(st.integers(0, len(blob) - 1), label="at")
            blob[i] ^= 1 << data.draw(st.integers(0, 7), label="bit")
    path = tmp_path_factory.mktemp("c") / "c.gguf"
    path.write_bytes(bytes(blob))
    try:
        art = load_artifact(path)
    except ArtifactError as e:
        assert str(e).startswith(str(path))
    else:
        assert len(art.tensors) == 14


@pytest.mark.parametrize("key, field, value, message", [
    # an array length the file cannot hold: gguf's reader would build a view per claimed item
    ("dflash.target_layers", "count", 2 ** 62, "'dflash.target_layers' claims 4611686018427387904 items"),
    # a layer count that would size the tensor table
    ("dflash.block_count", "value", 2 ** 25 + 1, "num_layers 33554433 is not a drafter's"),
])
def test_corrupt_counts_are_refused_before_allocation(tmp_path, valid_gguf, key, field, value, message):
    blob = bytearray(valid_gguf)
    at = blob.index(key.encode()) + len(key)  # then: u32 type, then the value (arrays: u32 item type, u64 count)
    if field == "count":
        blob[at + 8: at + 16] = struct.pack("<Q", value)
    else:
        blob[at + 4: at + 8] = struct.pack("<I", value)
    path = tmp_path / "c.gguf"
    path.write_bytes(bytes(blob))
    with pytest.raises(ArtifactError, match=re.escape(f"{path}: ") + ".*" + re.escape(message)):
        load_artifact(path)
