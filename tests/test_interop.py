"""llama.cpp interoperability of drafter files: files laid out as llama.cpp's converter and quantizer
write them (built here with the gguf package, independently of Strata's writer) load and decode in
Strata; Strata's converter writes that layout with the target's vocabulary; quantized drafters are
dequantized exactly as gguf's reference does and decode losslessly."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from gguf import quants
from safetensors.torch import load_file

from strata.dflash.artifact import load_artifact
from strata.dflash.drafter import load_drafter
from strata.engine.decode import Engine
from strata.errors import ArtifactError
from strata.models.loader import load_target

from conftest import run_cli, write_byte_tokenizer, write_hf_drafter, write_hf_model

T = gguf.GGMLQuantizationType
LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
         "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
         "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
         "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
GLOBAL = {"fc.weight": "fc.weight", "hidden_norm.weight": "enc.output_norm.weight", "norm.weight": "output_norm.weight"}


def lcpp_name(hf: str) -> str:
    if hf in GLOBAL:
        return GLOBAL[hf]
    _, n, rest = hf.split(".", 2)
    return f"blk.{n}.{LAYER[rest.removesuffix('.weight')]}.weight"


def random_blocks(qtype, rows: int, cols: int, gen: np.random.Generator) -> np.ndarray:
    """Valid blocks of a k-quant or i-quant type: random bytes, with every f16 scale field set to a finite
    value (a random f16 can be Inf or NaN)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = gen.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    scale = np.float16(0.002 if qtype == T.IQ4_XS else 0.0005)
    halves = {T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [size - 2], T.IQ4_XS: [0], T.Q3_K: [size - 2],
              T.IQ3_XXS: [0]}[qtype]
    for at in halves:
        raw[..., at:at + 2] = np.frombuffer(scale.tobytes(), dtype=np.uint8)
    return raw.reshape(rows, -1)


def write_lcpp_gguf(path, src_dir, vocab_dir, matrix_type=T.BF16, seed=0, extra_kv=None):
    """A drafter as llama.cpp's converter (and llama-quantize) lay it out: llama.cpp's key names, the
    target's vocabulary, norms in F32, matrices in `matrix_type`. Returns {hf name: the values stored}."""
    from tokenizers import Tokenizer

    cfg = json.loads((src_dir / "config.json").read_text())
    tensors = load_file(src_dir / "model.safetensors")
    w = gguf.GGUFWriter(str(path), "dflash")
    w.add_type("model")
    w.add_name("lcpp-layout drafter")
    w.add_uint32("dflash.block_count", cfg["num_hidden_layers"])
    w.add_uint32("dflash.context_length", cfg["max_position_embeddings"])
    w.add_uint32("dflash.embedding_length", cfg["hidden_size"])
    w.add_uint32("dflash.feed_forward_length", cfg["intermediate_size"])
    w.add_uint32("dflash.attention.head_count", cfg["num_attention_heads"])
    w.add_uint32("dflash.attention.head_count_kv", cfg["num_key_value_heads"])
    w.add_float32("dflash.rope.freq_base", cfg["rope_theta"])
    w.add_float32("dflash.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    w.add_uint32("dflash.attention.key_length", cfg["head_dim"])
    w.add_uint32("dflash.attention.value_length", cfg["head_dim"])
    w.add_uint32("general.file_type", 32)
    w.add_uint32("dflash.block_size", cfg["block_size"])
    w.add_key_value("dflash.target_layers", [i + 1 for i in cfg["dflash_config"]["target_layer_ids"]],
                    gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.INT32)
    w.add_uint32("general.quantization_version", 2)
    tok = Tokenizer.from_file(str(vocab_dir / "tokenizer.json"))
    by_id = {i: t for t, i in tok.get_vocab(with_added_tokens=True).items()}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list([by_id.get(i, f"[PAD{i}]") for i in range(cfg["vocab_size"])])
    w.add_token_types([1 if i in by_id else 5 for i in range(cfg["vocab_size"])])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m  # tokenizers' newer pairs, as strings
                        for m in json.loads((vocab_dir / "tokenizer.json").read_text())["model"]["merges"]])
    w.add_uint32("tokenizer.ggml.mask_token_id", cfg["dflash_config"]["mask_token_id"])
    for key, (kind, value) in (extra_kv or {}).items():
        getattr(w, f"add_{kind}")(key, value)
    gen = np.random.default_rng(seed)
    stored = {}
    for name, t in tensors.items():
        if t.dim() == 1:
            arr, qtype = t.float().numpy(), T.F32
            stored[name] = torch.from_numpy(arr.copy())
        elif matrix_type == T.BF16:
            arr, qtype = t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16), T.BF16
            stored[name] = t.to(torch.bfloat16)
        else:
            if matrix_type in (T.Q8_0, T.Q4_0, T.MXFP4):
                arr = quants.quantize(t.float().numpy(), matrix_type)
            else:
                arr = random_blocks(matrix_type, t.shape[0], t.shape[1], gen)
            qtype = matrix_type
            stored[name] = torch.from_numpy(quants.dequantize(arr, matrix_type).reshape(t.shape))
        w.add_tensor(lcpp_name(name), arr, raw_shape=arr.shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A target with a tokenizer and a drafter folder without one (as published drafters come)."""
    d = tmp_path_factory.mktemp("interop")
    target_dir, _ = write_hf_model(d / "target", "qwen3", seed=21, hidden_size=256)
    write_byte_tokenizer(target_dir, 256)
    # every matrix row a whole number of 256-wide k-quant blocks
    drafter_dir = write_hf_drafter(d / "drafter", layers=2, taps=(0, 2), hidden=256, heads=4, kv_heads=2,
                                   head_dim=64, intermediate=256, block_size=8, seed=4, scale=0.1, tokenizer=False)
    target = load_target(target_dir)
    prompt = [3, 99, 14, 250, 8, 8, 41]
    base = Engine(target, max_len=256).generate(prompt, 48).output_ids
    return d, target_dir, drafter_dir, target, prompt, base


def test_llama_cpp_layout_decodes_like_its_reference_source(pair):
    d, target_dir, drafter_dir, target, prompt, base = pair
    path = d / "lcpp.gguf"
    stored = write_lcpp_gguf(path, drafter_dir, target_dir)
    art = load_artifact(path)
    assert art.types["norm.weight"] == "F32" and art.types["fc.weight"] == "BF16"
    for name, t in stored.items():
        assert art.tensors[name].dtype == t.dtype and torch.equal(art.tensors[name], t), name
    assert art.vocab is not None and len(art.vocab.tokens) == 256
    ref = Engine(target, load_drafter(drafter_dir, target, max_len=256), max_len=256).generate(prompt, 48)
    got = Engine(target, load_drafter(path, target, max_len=256), max_len=256).generate(prompt, 48)
    assert got.output_ids == ref.output_ids == base
    assert got.accept_lengths == ref.accept_lengths  # the same proposals, round by round


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_0, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_XS, T.MXFP4],
                         ids=lambda t: t.name)
def test_quantized_drafters_load_as_gguf_dequantizes_and_decode_losslessly(pair, qtype):
    d, target_dir, drafter_dir, target, prompt, base = pair
    path = d / f"{qtype.name}.gguf"
    stored = write_lcpp_gguf(path, drafter_dir, target_dir, matrix_type=qtype, seed=qtype.value)
    art = load_artifact(path)
    source = load_file(drafter_dir / "model.safetensors")
    for name, t in stored.items():
        assert torch.equal(art.tensors[name], t), name  # bit for bit gguf.quants.dequantize
        if t.dim() == 2 and qtype == T.Q8_0:  # and it is the source up to the format's own error
            assert (t - source[name].float()).abs().max() <= source[name].float().abs().max() / 127
    assert {art.types[n] for n in stored if stored[n].dim() == 2} == {qtype.name}
    res = Engine(target, load_drafter(path, target, max_len=256), max_len=256).generate(prompt, 48)
    assert res.output_ids == base
    sampled = Engine(target, load_drafter(path, target, max_len=256), max_len=256, backend="static")
    assert sampled.generate(prompt, 48).output_ids == base

    back = d / f"{qtype.name}-hf"
    r = run_cli("export-dflash", path, back)
    assert r.returncode == 0, r.stderr
    exported = load_file(back / "model.safetensors")
    for name, t in stored.items():
        assert torch.equal(exported[name], t), name


def test_convert_carries_the_targets_vocabulary_and_checks(pair):
    d, target_dir, drafter_dir, target, prompt, base = pair
    out = d / "strata.gguf"
    r = run_cli("convert-dflash", drafter_dir, out)
    assert r.returncode == 2 and "has no tokenizer.json; give the target model with --target" in r.stderr
    assert not out.exists()
    r = run_cli("convert-dflash", drafter_dir, out, "--target", target_dir)
    assert r.returncode == 0, r.stderr
    fields = gguf.GGUFReader(str(out)).fields
    tokens = [bytes(fields["tokenizer.ggml.tokens"].parts[i]).decode() for i in fields["tokenizer.ggml.tokens"].data]
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(target_dir / "tokenizer.json")).get_vocab()
    assert tokens == [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    lcpp = d / "lcpp-same.gguf"
    write_lcpp_gguf(lcpp, drafter_dir, target_dir)
    ours, theirs = load_artifact(out), load_artifact(lcpp)
    assert ours.vocab.difference(theirs.vocab) is None
    for name in theirs.tensors:  # the same values, and the same storage types
        assert torch.equal(ours.tensors[name], theirs.tensors[name]) and ours.types[name] == theirs.types[name]

    ok = run_cli("inspect", out, "--model", target_dir)
    assert ok.returncode == 0 and "fits" in ok.stdout and "vocabulary: gpt2 (pre-tokenizer gpt-2), 256 tokens" in ok.stdout
    assert "tensors: 25 (15 BF16, 10 F32)" in ok.stdout
    other = d / "other-target"
    write_hf_model(other, "qwen3", seed=3, hidden_size=256)
    write_byte_tokenizer(other, 256)
    tok = json.loads((other / "tokenizer.json").read_text())  # the same size, two tokens swapped
    v = tok["model"]["vocab"]
    a, b = list(v)[10:12]
    v[a], v[b] = v[b], v[a]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    bad = run_cli("inspect", out, "--model", other)
    assert bad.returncode == 2 and "verdict: INVALID: its vocabulary differs" in bad.stdout, bad.stdout
    assert "token 10 is" in bad.stdout


@pytest.mark.parametrize("key,kind,value,needle", [
    ("dflash.attention.value_scale", "float32", 0.5, "asks for an attention value scale"),
    ("dflash.hidden_act", "string", "gelu", "asks for an MLP activation other than SiLU"),
    ("dflash.attention.causal", "bool", True, "asks for causal attention inside the block"),
    ("dflash.rope.dimension_count", "uint32", 8, "asks for partial RoPE"),
])
def test_llama_cpp_features_strata_lacks_are_refused(pair, key, kind, value, needle):
    d, target_dir, drafter_dir, *_ = pair
    path = d / "refused.gguf"
    write_lcpp_gguf(path, drafter_dir, target_dir, extra_kv={key: (kind, value)})
    with pytest.raises(ArtifactError, match=needle):
        load_artifact(path)


def test_llama_cpp_scale_keys_are_read_and_written(pair, tmp_path):
    d, target_dir, drafter_dir, target, prompt, base = pair
    path = d / "scaled.gguf"
    write_lcpp_gguf(path, drafter_dir, target_dir, extra_kv={"dflash.logit_scale": ("float32", 0.5),
                                                             "dflash.embedding_scale": ("float32", 2.0)})
    art = load_artifact(path)
    assert art.cfg.output_multiplier == 0.5 and art.cfg.input_embedding_scale == 2.0
    back = tmp_path / "hf"
    assert run_cli("export-dflash", path, back).returncode == 0
    out = tmp_path / "again.gguf"
    assert run_cli("convert-dflash", back, out, "--target", target_dir).returncode == 0
    fields = gguf.GGUFReader(str(out)).fields
    assert float(fields["dflash.logit_scale"].parts[-1][0]) == 0.5
    assert float(fields["dflash.embedding_scale"].parts[-1][0]) == 2.0
    assert load_artifact(out).cfg == art.cfg
