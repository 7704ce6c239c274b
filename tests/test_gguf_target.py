"""GGUF targets (llama.cpp's qwen3 and llama layouts), written here with the gguf package from checkpoints
transformers wrote: they decode exactly like the same weights in a Hugging Face folder, their vocabulary
tokenizes exactly like that folder's tokenizer.json, and DFlash on a quantized target equals target-only."""

from __future__ import annotations

import json
import re
import shutil

import gguf
import numpy as np
import pytest
import torch
from gguf import quants
from safetensors.torch import load_file, save_file
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from strata.engine.decode import Engine
from strata.errors import StrataError
from strata.models.loader import load_target
from strata.tokenizer import Tokenizer as StrataTokenizer

from conftest import cli, run_cli, write_hf_drafter, write_hf_model
from test_interop import random_blocks

T = gguf.GGMLQuantizationType
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")
LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
         "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
         "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
         "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp"}
TEXTS = ["def quicksort(arr):\n    return sorted(arr)", "  héllo wörld 日本 🙂\n\n\tx = 1", "<|endoftext|>class A:",
         "it's   done\r\n", "12345 + 678"]


def gguf_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    _, _, n, rest = hf.split(".", 3)
    stem, kind = rest.rsplit(".", 1)
    return f"blk.{n}.{LAYER[stem]}.{kind}"


EXPERT_PARTS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}


def stack_experts(tensors: dict) -> dict:
    """Per-expert checkpoint matrices stacked into llama.cpp's 3-D blk.N.ffn_*_exps tensors (as its
    converter does); the rest unchanged."""
    out, stacks = {}, {}
    for name, t in tensors.items():
        parts = name.split(".")  # model.layers.N.mlp.experts.E.part.weight
        if len(parts) == 8 and parts[4] == "experts":
            stacks.setdefault(f"blk.{parts[2]}.{EXPERT_PARTS[parts[6]]}.weight", {})[int(parts[5])] = t
        else:
            out[name] = t
    for name, by_expert in stacks.items():
        out[name] = torch.stack([by_expert[e] for e in range(len(by_expert))])
    return out


def unstack_experts(name: str, values: torch.Tensor) -> dict:
    _, n, kind, _ = name.split(".")
    part = next(p for p, k in EXPERT_PARTS.items() if k == kind)
    return {f"model.layers.{n}.mlp.experts.{e}.{part}.weight": values[e] for e in range(values.shape[0])}


def interleave(w: torch.Tensor, heads: int) -> torch.Tensor:
    """What llama.cpp's converter does to a Llama q/k projection: per head, the two RoPE halves paired up."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def qwen2_tokenizer(folder, vocab: int):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXTS * 30 + ["def quicksort(arr):\n    return sorted(arr)\n"] * 40, trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return tok


def add_vocabulary(w, hf_dir, vocab_size: int) -> None:
    """The folder's byte-level BPE vocabulary (padded to the model's rows) as llama.cpp's converter writes it."""
    tok = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    by_id = {i: t for t, i in tok.get_vocab(with_added_tokens=True).items()}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list([by_id.get(i, f"[PAD{i}]") for i in range(vocab_size)])
    w.add_token_types([3 if by_id.get(i) == "<|endoftext|>" else 1 if i in by_id else 5 for i in range(vocab_size)])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m
                        for m in json.loads((hf_dir / "tokenizer.json").read_text())["model"]["merges"]])
    w.add_eos_token_id(tok.token_to_id("<|endoftext|>"))


def write_gguf_target(path, hf_dir, arch: str, matrix_type=T.F32, seed: int = 0, fuse_qkv: bool = False) -> dict:
    """The checkpoint in llama.cpp's layout (norms F32, matrices `matrix_type`, the folder's vocabulary; fuse_qkv:
    each layer's q, k, v rows in one attn_qkv, as the converter's --fuse-qkv writes them). Returns the values
    stored, under the checkpoint's names, in Strata's (un-interleaved) row order."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    tensors = load_file(hf_dir / "model.safetensors")
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    theta = cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in (("block_count", cfg["num_hidden_layers"]), ("context_length", cfg["max_position_embeddings"]),
                       ("embedding_length", cfg["hidden_size"]), ("feed_forward_length", cfg["intermediate_size"]),
                       ("attention.head_count", heads), ("attention.head_count_kv", kv_heads),
                       ("attention.key_length", cfg["head_dim"]), ("attention.value_length", cfg["head_dim"])):
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.rope.freq_base", theta)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    add_vocabulary(w, hf_dir, cfg["vocab_size"])
    if arch == "llama":  # Llama 3's RoPE scaling travels as per-frequency divisors, as llama.cpp stores it
        import transformers
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](transformers.LlamaConfig.from_pretrained(hf_dir), "cpu")
        d = cfg["head_dim"]
        base = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        w.add_tensor("rope_freqs.weight", (base / scaled.float()).numpy())
    if arch == "qwen3moe":
        w.add_uint32(f"{arch}.expert_count", cfg.get("num_experts", cfg.get("num_local_experts")))
        w.add_uint32(f"{arch}.expert_used_count", cfg["num_experts_per_tok"])
        w.add_uint32(f"{arch}.expert_feed_forward_length", cfg["moe_intermediate_size"])
    tensors = stack_experts(tensors)
    gen = np.random.default_rng(seed)
    stored, qkv = {}, {}
    for name, t in tensors.items():
        t = t.float()
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            t = interleave(t, heads if "q_proj" in name else kv_heads)
        if t.dim() == 3:  # stacked experts: the matrices' type, each expert's rows whole blocks
            flat = t.reshape(-1, t.shape[-1])
            arr = flat.numpy() if matrix_type == T.F32 else quants.quantize(flat.numpy(), matrix_type) \
                if matrix_type in (T.Q8_0, T.Q4_0) else random_blocks(matrix_type, *flat.shape, gen)
            values = torch.from_numpy(quants.dequantize(arr, matrix_type).reshape(t.shape).copy()) \
                if matrix_type != T.F32 else t
            arr = arr.reshape(*t.shape[:2], -1)
            w.add_tensor(name, arr, raw_shape=arr.shape, raw_dtype=matrix_type if matrix_type != T.F32 else T.F32)
            stored.update(unstack_experts(name, values))
            continue
        if t.dim() == 1 or matrix_type == T.F32 or name.endswith("mlp.gate.weight"):  # routers stay F32
            arr, qtype, values = t.numpy(), T.F32, t
        elif matrix_type in (T.F16, T.BF16):
            half = t.to(torch.float16 if matrix_type == T.F16 else torch.bfloat16)
            arr = half.view(torch.int16).numpy().view(np.uint16) if matrix_type == T.BF16 else half.numpy()
            qtype, values = matrix_type, half.float()
        else:
            arr = quants.quantize(t.numpy(), matrix_type) if matrix_type in (T.Q8_0, T.Q4_0) else \
                random_blocks(matrix_type, t.shape[0], t.shape[1], gen)
            qtype, values = matrix_type, torch.from_numpy(quants.dequantize(arr, matrix_type).reshape(t.shape))
        part = re.search(r"layers\.(\d+)\.self_attn\.([qkv])_proj\.weight", name) if fuse_qkv else None
        if part:
            parts = qkv.setdefault(part.group(1), {})
            parts[part.group(2)] = arr
            if len(parts) == 3:
                fused = np.concatenate([parts[x] for x in "qkv"])
                w.add_tensor(f"blk.{part.group(1)}.attn_qkv.weight", fused, raw_shape=fused.shape, raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name(name), arr, raw_shape=arr.shape, raw_dtype=qtype)
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            h = heads if "q_proj" in name else kv_heads
            values = values.reshape(h, values.shape[0] // h // 2, 2, -1).transpose(1, 2).reshape(values.shape)
        stored[name] = values
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


def dequantized_folder(folder, hf_dir, stored):
    """The same values as a Hugging Face folder: the reference a GGUF target must decode exactly like."""
    folder.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(hf_dir / f, folder / f)
    save_file({k: v.contiguous() for k, v in stored.items()}, str(folder / "model.safetensors"))
    return folder


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf-target")
    out = {}
    for family in ("qwen3", "llama"):  # rows of 256: every k-quant block whole
        path, _ = write_hf_model(d / family, family, seed=9, vocab=320, hidden_size=256, intermediate_size=256,
                                 head_dim=64, layers=2)
        qwen2_tokenizer(path, 320)
        out[family] = path
    return d, out


@pytest.mark.parametrize("family,qtype", [("qwen3", T.F32), ("llama", T.F32), ("qwen3", T.BF16), ("llama", T.F16),
                                          ("qwen3", T.Q8_0), ("llama", T.Q4_0), ("qwen3", T.Q4_K), ("llama", T.Q5_K),
                                          ("qwen3", T.Q6_K), ("llama", T.IQ4_XS)], ids=lambda x: getattr(x, "name", x))
def test_gguf_target_decodes_like_its_weights_in_a_folder(checkpoints, family, qtype):
    d, hf = checkpoints
    path = d / f"{family}-{qtype.name}.gguf"
    stored = write_gguf_target(path, hf[family], family, qtype, seed=qtype.value)
    ref_dir = dequantized_folder(d / f"{family}-{qtype.name}-ref", hf[family], stored)
    got, ref = load_target(path), load_target(ref_dir)
    for (name, a), b in zip(got.state_dict().items(), ref.state_dict().values()):
        assert torch.equal(a, b), name
    prompt = torch.randint(0, 320, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    assert Engine(got, max_len=128).generate(prompt, 24).output_ids == \
        Engine(ref, max_len=128).generate(prompt, 24).output_ids


@pytest.mark.parametrize("qtype", [T.F32, T.Q8_0], ids=lambda x: x.name)
def test_a_fused_qkv_reads_as_its_parts(checkpoints, qtype):
    """A llama file whose q, k, v are one attn_qkv (the converter's --fuse-qkv, q and k rows interleaved inside
    it) loads as the file with the parts, dequantized at load and in its blocks (each part's rows restored)."""
    from strata.layers.quant import QuantWeight

    d, hf = checkpoints
    fused, parts = d / f"llama-{qtype.name}-fused.gguf", d / f"llama-{qtype.name}-parts.gguf"
    write_gguf_target(fused, hf["llama"], "llama", qtype, seed=3, fuse_qkv=True)
    write_gguf_target(parts, hf["llama"], "llama", qtype, seed=3)
    for quantized in (False, True) if qtype != T.F32 else (False,):
        a, b = load_target(fused, quantized=quantized), load_target(parts, quantized=quantized)
        for la, lb in zip(a.layers, b.layers):
            wa, wb = la.self_attn.qkv_proj.weight, lb.self_attn.qkv_proj.weight
            assert isinstance(wa, QuantWeight) == quantized
            assert torch.equal(wa.dequantize(), wb.dequantize()) if quantized else torch.equal(wa, wb)


def test_gguf_vocabulary_tokenizes_like_the_folder_and_drives_the_cli(checkpoints):
    d, hf = checkpoints
    path = d / "qwen3-tok.gguf"
    stored = write_gguf_target(path, hf["qwen3"], "qwen3", T.Q8_0)
    from strata.gguf_file import read

    ours = StrataTokenizer.from_gguf(read(path)[0], path)
    theirs = StrataTokenizer.from_folder(hf["qwen3"])
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text), text
        assert ours.encode_prompt(text) == theirs.encode_prompt(text) == theirs.encode(text), text
        assert ours.decode(ours.encode(text)) == theirs.decode(theirs.encode(text))
    assert ours.end_ids == {0}  # <|endoftext|>, which llama.cpp stops at
    ref_dir = dequantized_folder(d / "qwen3-tok-ref", hf["qwen3"], stored)
    a = run_cli("generate", "--model", path, "--prompt", TEXTS[0], "--max-new-tokens", "12")
    b = run_cli("generate", "--model", ref_dir, "--prompt", TEXTS[0], "--max-new-tokens", "12")
    assert a.returncode == 0 and a.stdout == b.stdout, a.stderr


def test_dflash_on_a_quantized_target_equals_target_only(checkpoints):
    d, hf = checkpoints
    path = d / "qwen3-q4k-dflash.gguf"
    write_gguf_target(path, hf["qwen3"], "qwen3", T.Q4_K, seed=5)
    target = load_target(path)
    drafter_dir = write_hf_drafter(d / "drafter", layers=1, hidden=256, heads=4, kv_heads=2, head_dim=64,
                                   intermediate=256, taps=(0, 1), num_target_layers=2, vocab=320, mask_token_id=319)
    from strata.dflash.drafter import load_drafter

    prompt = [5, 17, 200, 31, 7]
    base = Engine(target, max_len=128).generate(prompt, 40).output_ids
    for static in (False, True):
        res = Engine(target, load_drafter(drafter_dir, target, max_len=128), max_len=128, backend="static" if static else "eager")
        assert res.generate(prompt, 40).output_ids == base


def edited_target(path, hf_dir, edit, monkeypatch) -> None:
    """write_gguf_target with edit(writer) applied to its metadata before the header is written."""
    real = gguf.GGUFWriter.write_header_to_file

    def with_edit(self, *a, **k):
        edit(self)
        return real(self, *a, **k)

    monkeypatch.setattr(gguf.GGUFWriter, "write_header_to_file", with_edit)
    write_gguf_target(path, hf_dir, "qwen3")
    monkeypatch.undo()


def put(key: str, value, vtype=gguf.GGUFValueType.UINT32, sub=None):
    """An edit that sets (or with value None drops) a metadata key."""
    def edit(w):
        w.kv_data[0].pop(key, None)
        if value is not None:
            w.add_key_value(key, value, vtype, sub_type=sub)
    return edit


V = gguf.GGUFValueType


@pytest.mark.parametrize("edit,needle", [
    (put("general.architecture", "mamba", V.STRING), "general.architecture 'mamba' is not supported"),
    (put("qwen3.expert_count", 8), "'qwen3.expert_count' = 8 asks for mixture-of-experts"),
    (put("qwen3.rope.dimension_count", 32), "asks for partial RoPE"),
    (put("qwen3.attention.causal", False, V.BOOL), "'qwen3.attention.causal' = False asks for non-causal attention"),
    (put("qwen3.block_count", 10 ** 7), "'qwen3.block_count' = 10000000, but the file's tensors are of 2 layers"),
    (put("qwen3.context_length", None), "'qwen3.context_length' is missing (expected a positive 32-bit integer)"),
    (put("qwen3.context_length", 2 ** 32 - 1), "'qwen3.context_length' must be a positive 32-bit integer, got 4294967295"),
    (put("qwen3.attention.head_count_kv", 0), "'qwen3.attention.head_count_kv' must be a positive 32-bit integer"),
    (put("qwen3.attention.layer_norm_rms_epsilon", "abc", V.STRING), "must be a positive finite number, got 'abc'"),
    (put("qwen3.rope.freq_base", float("inf"), V.FLOAT32), "'qwen3.rope.freq_base' must be a positive finite number"),
    (put("x", [[1], [2]], V.ARRAY, V.ARRAY), "metadata 'x' is an array of arrays"),
    (put("tokenizer.ggml.token_type", [1] * 10, V.ARRAY, V.INT32), "'tokenizer.ggml.token_type' holds 10 entries for 320"),
    (put("tokenizer.ggml.eos_token_id", "0", V.STRING), "'tokenizer.ggml.eos_token_id' must be a token id below 320"),
    (put("tokenizer.ggml.merges", None), "'tokenizer.ggml.merges' is missing"),
    (put("tokenizer.chat_template", 7), "'tokenizer.chat_template' must be a string"),
], ids=lambda x: x if isinstance(x, str) else "")
def test_gguf_targets_strata_cannot_run_are_refused_by_key(checkpoints, edit, needle, monkeypatch):
    """What the loader reads before the weights (the hyper-parameters and the vocabulary), each wrong value
    refused naming its key, as llama.cpp refuses the file."""
    from strata.pair import tokenizer_of
    from strata.models.loader import load_model_config

    d, hf = checkpoints
    path = d / "refused.gguf"
    edited_target(path, hf["qwen3"], edit, monkeypatch)
    with pytest.raises(StrataError) as e:
        load_model_config(path)
        tokenizer_of(path)
    assert str(e.value).startswith(str(path)) and needle in str(e.value), str(e.value)


def test_gguf_target_errors_reach_the_cli_in_one_line(checkpoints, monkeypatch, tmp_path):
    """A vocabulary of a kind Strata cannot rebuild leaves the model running on ids, and text is refused
    saying why; a cache that cannot fit is refused before it is allocated: exit 2, one line."""
    d, hf = checkpoints
    path = tmp_path / "bert.gguf"
    edited_target(path, hf["qwen3"], put("tokenizer.ggml.model", "bert", V.STRING), monkeypatch)
    r = run_cli("generate", "--model", path, "--prompt-ids", "1,2", "--max-new-tokens", "2")
    assert r.returncode == 0, r.stderr
    r = run_cli("generate", "--model", path, "--prompt", "hello")
    assert r.returncode == 2 and "'bert' is not supported" in r.stderr and "use --prompt-ids" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    huge = tmp_path / "huge.gguf"
    edited_target(huge, hf["qwen3"], put("qwen3.context_length", 2 * 10 ** 8), monkeypatch)
    r = run_cli("generate", "--model", huge, "--prompt-ids", "1,2")
    assert r.returncode == 2 and "a KV cache of 200000000 positions" in r.stderr and "--max-model-len" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    target = tmp_path / "target.gguf"  # a target's file given as the drafter is called what it is
    write_gguf_target(target, hf["qwen3"], "qwen3")
    code, err = cli("generate", "--model", hf["qwen3"], "--prompt-ids", "1,2", "--dflash", target)
    assert code == 2 and "general.architecture is 'qwen3'" in err and "give it as --model" in err, err


def spm_layout(user=()) -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece (BPE) model's pieces as llama.cpp's converter lays them out: <unk>, <s>, </s>, the 256
    byte tokens, user tokens, then pieces scored by merge order (a BPE that tokenizers trains on
    U+2581-joined text); (tokens, scores, types)."""
    from tokenizers import normalizers

    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    bpe.pre_tokenizer = pre_tokenizers.Split("\u2581", behavior="merged_with_next")
    bpe.train_from_iterator(TEXTS * 50, trainers.BpeTrainer(vocab_size=300))
    pieces = sorted(bpe.get_vocab(), key=bpe.get_vocab().get)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + list(user)
    types = [2, 3, 3] + [6] * 256 + [4] * len(user)
    tokens += [p for p in pieces if p not in tokens]
    scores = [0.0] * len(types) + [-float(i) for i in range(len(tokens) - len(types))]
    types += [1] * (len(tokens) - len(types))
    return tokens, scores, types


def spm_vocab_file(path, add_space_prefix=None, user=(), add_bos=None) -> tuple[list[str], list[float]]:
    """spm_layout's vocabulary (a llama model's) in a GGUF file."""
    tokens, scores, types = spm_layout(user)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    if add_space_prefix is not None:
        w.add_add_space_prefix(add_space_prefix)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    return tokens, scores


def spm_reference(text: str, tokens: list[str], scores: list[float], space_prefix: bool, whole: list[str]) -> list[int]:
    """llama.cpp's SentencePiece tokenizer (llama-vocab.cpp), spelled out: the text split at whole tokens
    (control, unknown, user-defined); each other fragment gets a space before it where it starts the text
    or follows a whole token, spaces become U+2581, and from single characters the adjacent pair whose
    concatenation is the best-scoring token merges (the leftmost among equals) until none is a token;
    characters outside the vocabulary become their UTF-8 byte tokens."""
    ids = {}
    for i, t in enumerate(tokens):
        ids.setdefault(t, i)
    out, after_whole, rest = [], True, text
    while rest:
        at = min(((rest.find(w), -len(w), w) for w in whole if w in rest), default=None)
        fragment = rest if at is None else rest[:at[0]]
        if fragment:
            syms = list(("\u2581" if space_prefix and after_whole else "") + fragment.replace(" ", "\u2581"))
            while True:
                best = None
                for k in range(len(syms) - 1):
                    merged = syms[k] + syms[k + 1]
                    if merged in ids and (best is None or scores[ids[merged]] > best[0]):
                        best = (scores[ids[merged]], k)
                if best is None:
                    break
                syms[best[1]:best[1] + 2] = [syms[best[1]] + syms[best[1] + 1]]
            for s in syms:
                out += [ids[s]] if s in ids else [ids[f"<0x{b:02X}>"] for b in s.encode()]
            after_whole = False
        if at is None:
            break
        out.append(ids[at[2]])
        after_whole, rest = True, rest[at[0] + len(at[2]):]
    return out


SPM_TEXTS = TEXTS + ["Hello world, the quick fox", " leading", "  two spaces", "trailing ", "x", "\n", "   ",
                     "<s>hello</s> world", "hello<s>world", "<unk> token", "Ω≈ç√∫ unseen €", "the the thethe", "a\u2581b",
                     "tool<tool>call ZZ end"]


SPM_VOCABS = [(None, (), None), (False, (), False), (None, ("<tool>", "ZZ"), None)]


@pytest.mark.parametrize("space_prefix,user,add_bos", SPM_VOCABS)
def test_sentencepiece_vocabularies_tokenize_as_llama_cpp_does(tmp_path, space_prefix, user, add_bos):
    """A llama-model (SentencePiece BPE) vocabulary: encodes every text as llama.cpp's tokenizer does
    (spm_reference; the same texts checked against llama.cpp's llama-tokenize with
    tools/llamacpp_tokenize_check.py), merging pieces, falling back to bytes, keeping whole tokens whole,
    a prompt after the BOS llama.cpp adds unless tokenizer.ggml.add_bos_token is false, and decodes back
    to the text."""
    from strata.gguf_file import read

    path = tmp_path / "spm.gguf"
    tokens, scores = spm_vocab_file(path, space_prefix, user, add_bos)
    tok = StrataTokenizer.from_gguf(read(path)[0], path)
    whole = ["<unk>", "<s>", "</s>", *user]
    merged = 0
    for text in SPM_TEXTS:
        want = spm_reference(text, tokens, scores, space_prefix is not False, whole)
        assert tok.encode(text) == want, text
        assert tok.encode_prompt(text) == [1] * (add_bos is not False) + want, text
        merged += len(want) < len(text)
        if not any(w in text for w in whole + ["\u2581"]):  # text after a whole token gains a space, and a
            assert tok.decode(want) == text, text  # U+2581 in the text decodes as one
    assert merged > len(SPM_TEXTS) // 2  # the pieces did merge


def spm_tokenizer_folder(folder, spaces="legacy", user=()) -> Tokenizer:
    """spm_layout's model as a Hugging Face folder holds a converted SentencePiece model (Llama 2, Mistral):
    a tokenizer.json BPE with byte fallback whose merges are every split of each piece into two pieces, in
    the pieces' score order (as transformers' converter writes them), <unk>, <s>, </s> and the user tokens
    added; its spaces made U+2581 by normalizers with one before the text ("legacy"), or by a Metaspace
    pre-tokenizer that puts one before each part ("always") or none ("never"). Returns the tokenizer."""
    from tokenizers import AddedToken, normalizers

    tokens, _, types = spm_layout(user)
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = [(p[:k], p[k:]) for i, p in enumerate(tokens) if types[i] == 1 for k in range(1, len(p))
              if p[:k] in vocab and p[k:] in vocab]
    hf = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    if spaces == "legacy":
        hf.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    else:
        hf.pre_tokenizer = pre_tokenizers.Metaspace("\u2581", prepend_scheme=spaces, split=False)
    hf.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
                                   + [decoders.Strip(" ", 1, 0)] * (spaces != "never"))
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    hf.add_tokens([AddedToken(t, normalized=False) for t in user])
    folder.mkdir(parents=True, exist_ok=True)
    hf.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True, "add_eos_token": False,
        "chat_template": "{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}"}))
    return hf


#: spm_tokenizer_folder's variants: how spaces become U+2581, and user tokens
SPM_FOLDERS = [("legacy", ()), ("always", ("<tool>", "ZZ")), ("never", ())]


def spm_folder_vocab_file(path, folder, spaces, user):
    """spm_tokenizer_folder's folder written as a llama vocabulary (from_tokenizer_folder) in a GGUF file;
    (the folder's tokenizer, the vocabulary)."""
    from strata.gguf_vocab import from_tokenizer_folder

    hf = spm_tokenizer_folder(folder, spaces, user)
    vocab = from_tokenizer_folder(folder, vocab_size=len(hf.get_vocab()) + 2)
    vocab_only_file(path, vocab, "llama")
    return hf, vocab


@pytest.mark.parametrize("spaces,user", SPM_FOLDERS)
def test_a_sentencepiece_folder_becomes_a_llama_vocabulary_that_tokenizes_as_it_does(tmp_path, spaces, user):
    """A Hugging Face folder of a converted SentencePiece model (a byte-fallback BPE) written as llama.cpp's
    llama vocabulary, as a drafter GGUF carries its target's: the pieces, their kinds and scores that merge
    in the merges' order, BOS, EOS and the template. Read back, it tokenizes every text as llama.cpp's
    algorithm does (spm_reference; tools/llamacpp_tokenize_check.py runs llama.cpp's llama-tokenize on the
    same files) and as the folder's own tokenizer does (the tokenizers library, the peer), but where a
    Metaspace tokenizer meets a part of the text that starts with a space: it puts no U+2581 before that
    one, llama.cpp (and Llama 2's normalizers) do."""
    from strata.gguf_file import read

    path = tmp_path / "spm.gguf"
    hf, vocab = spm_folder_vocab_file(path, tmp_path / "spm", spaces, user)
    tokens, _, types = spm_layout(user)
    assert vocab.model == "llama" and vocab.tokens == tokens + ["[PAD%d]" % len(tokens), "[PAD%d]" % (len(tokens) + 1)]
    assert vocab.token_types == types + [5, 5]
    assert (vocab.special, vocab.add_special) == ({"bos": 1, "eos": 2, "unk": 0}, {"bos": True, "eos": False})
    assert vocab.add_space_prefix is (spaces != "never") and vocab.chat_template.startswith("{% for m")
    tok = StrataTokenizer.from_gguf(read(path)[0], path)
    whole = ["<unk>", "<s>", "</s>", *user]
    alike = 0
    for text in SPM_TEXTS:
        want = spm_reference(text, vocab.tokens, vocab.scores, spaces != "never", whole)
        assert tok.encode(text) == want, text
        assert tok.encode_prompt(text) == [1] + want, text
        parts = re.split("|".join(map(re.escape, whole)), text)
        if spaces != "always" or not any(p.startswith(" ") for p in parts):  # Metaspace adds no U+2581 before
            assert hf.encode(text, add_special_tokens=False).ids == want, text  # a space; llama.cpp does
            alike += 1
    assert alike >= len(SPM_TEXTS) // 2


def test_a_byte_fallback_folder_without_sentencepiece_spaces_is_refused(tmp_path):
    from strata.gguf_vocab import from_tokenizer_folder

    spm_tokenizer_folder(tmp_path, "legacy")
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    spec["normalizer"] = None
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(StrataError, match="tokenizer.json: a byte-fallback BPE whose spaces do not become U"):
        from_tokenizer_folder(tmp_path)


def gpt2_vocab_file(path, folder, pre="qwen2", extra=(), keys=None) -> dict[str, int]:
    """The byte-level BPE vocabulary of a tokenizer folder in a GGUF file, as llama.cpp's converter writes
    it, with `extra` control tokens appended and `keys` (tokenizer.ggml.NAME -> value) set; its token ids."""
    from strata.gguf_vocab import CONTROL, from_tokenizer_folder

    vocab = from_tokenizer_folder(folder, pre=pre)
    vocab.tokens += list(extra)
    vocab.token_types += [CONTROL] * len(extra)
    for key, value in (keys or {}).items():
        if key.endswith("_token_id"):
            vocab.special[key.removesuffix("_token_id")] = value
        else:
            vocab.add_special[key.removeprefix("add_").removesuffix("_token")] = value
    vocab_only_file(path, vocab, "qwen3")
    return {t: i for i, t in enumerate(vocab.tokens)}


def vocab_only_file(path, vocab, arch: str) -> None:
    """A GGUF file of `arch` holding only a vocabulary (as llama-tokenize reads one)."""
    w = gguf.GGUFWriter(str(path), arch)
    vocab.write(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()


#: GGUF vocabularies (pre-tokenizer, extra control tokens, keys) whose BOS / EOS and end-of-generation
#: tokens llama.cpp decides by their kind and keys (checked against llama-tokenize by
#: tools/llamacpp_tokenize_check.py); the BOS / EOS llama.cpp adds, and the tokens it stops at, by text
GPT2_VOCABS = {
    "qwen": ("qwen2", ("<|im_start|>", "<|im_end|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<|fim_prefix|>"),
             {"eos_token_id": 0}, (None, None), {"<|endoftext|>", "<|im_end|>", "<|fim_pad|>", "<|repo_name|>",
                                                 "<|file_sep|>"}),
    "llama3": ("llama-bpe", ("<|begin_of_text|>", "<|eot_id|>", "<|eom_id|>"), {"bos_token_id": 320},
               ("<|begin_of_text|>", None), {"<|endoftext|>", "<|eot_id|>", "<|eom_id|>"}),
    "llama3-keys": ("llama-bpe", ("<|begin_of_text|>", "<|end_of_text|>", "<|end|>", "<|return|>", "<|call|>"),
                    {"bos_token_id": 320, "add_bos_token": True, "add_eos_token": True, "eos_token_id": 321,
                     "fim_pad_token_id": 5}, ("<|begin_of_text|>", "<|end_of_text|>"),
                    {"<|endoftext|>", "<|end_of_text|>", "<|return|>", "<|call|>", 5}),
    "qwen-default-bos": ("qwen2", (), {"add_bos_token": True}, (11, None), {"<|endoftext|>"}),
    "gpt-2": ("gpt-2", (), {}, (None, None), {"<|endoftext|>"}),
    "qwen35": ("qwen35", (), {}, (None, None), {"<|endoftext|>"}),
    "smollm": ("smollm", (), {}, (None, None), {"<|endoftext|>"}),
    "tekken": ("tekken", (), {}, (11, None), {"<|endoftext|>"}),
    "deepseek-r1-qwen": ("deepseek-r1-qwen", (), {}, (None, None), {"<|endoftext|>"}),
}
#: texts whose pieces tell the pre-tokenizers apart: letter case, digit runs, combining marks, '/'
PRE_TEXTS = TEXTS + ["HelloWORLD fooBar x1234567", " e\u0301t\u00e9 na\u0308ive", "path/to/file.py\r\n  'LL 'Re"]


def wide_tokenizer(folder, vocab: int = 700):
    """A byte-level BPE trained without splitting its texts (PRE_TEXTS), so that its merges cross the
    places where pre-tokenizers split: how a pre-tokenizer splits shows in the ids."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(PRE_TEXTS * 40, trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return tok


@pytest.mark.parametrize("name", GPT2_VOCABS)
def test_gguf_vocabularies_add_bos_and_stop_as_llama_cpp_does(checkpoints, tmp_path, name):
    """A prompt gets the BOS / EOS llama.cpp adds (by the vocabulary's kind, or its add_bos/add_eos keys;
    a missing bos_token_id takes llama.cpp's default id), a chat prompt one BOS however the template writes
    it, and generation stops at every token llama.cpp's end-of-generation list holds."""
    from strata.gguf_file import read

    pre, extra, keys, (bos, eos), ends = GPT2_VOCABS[name]
    path = tmp_path / f"{name}.gguf"
    ids = gpt2_vocab_file(path, checkpoints[1]["qwen3"], pre, extra, keys)
    tok = StrataTokenizer.from_gguf(read(path)[0], path)
    by = lambda x: ids[x] if isinstance(x, str) else x  # noqa: E731
    head, tail = [by(bos)] if bos is not None else [], [by(eos)] if eos is not None else []
    for text in PRE_TEXTS:
        assert tok.encode_prompt(text) == head + tok.encode(text) + tail, text
        assert tok.decode(tok.encode(text)) == text.replace("<|endoftext|>", "")  # specials not shown
    assert tok.end_ids == {by(x) for x in ends}
    tok.chat_template = "{{ bos_token }}{% for m in messages %}[{{ m.content }}]{% endfor %}{{ eos_token }}"
    body = tok.encode("[hi][there]")
    assert tok.encode_chat([{"role": "user", "content": "hi"}, {"role": "user", "content": "there"}]) == \
        (head or tok.encode(tok.special.get("bos_token", ""))) + body + (tail or tok.encode(tok.special.get("eos_token", "")))


def test_a_vocabulary_that_adds_a_bos_it_lacks_is_refused(tmp_path):
    from strata.gguf_vocab import NORMAL, Vocab

    vocab = Vocab(model="gpt2", pre="qwen2", tokens=["a", "b", "ab"], token_types=[NORMAL] * 3, merges=["a b"],
                  add_special={"bos": True})
    with pytest.raises(StrataError, match="metadata key 'tokenizer.ggml.add_bos_token' adds a BOS token to every "
                                          "prompt, but no 'tokenizer.ggml.bos_token_id' names one"):
        vocab.to_tokenizers("v.gguf")
    vocab.pre, vocab.add_special = "llama-bpe", {}
    with pytest.raises(StrataError, match="by default"):
        vocab.to_tokenizers("v.gguf")


@pytest.mark.parametrize("pre", ["gpt-2", "qwen2", "qwen35", "llama-bpe", "smollm", "tekken"])
def test_byte_level_pre_tokenizers_tokenize_as_the_models_own_tokenizers(tmp_path, pre):
    """A GGUF vocabulary of each pre-tokenizer llama.cpp names (on a vocabulary whose merges cross the places
    pre-tokenizers split) encodes as the tokenizer.json of the models it is named for does: GPT-2's regex,
    Qwen2's, Qwen3.5's (combining marks kept with letters), Llama 3's (digits by three, whole-word tokens
    unmerged), SmolLM's (digits alone), Mistral Nemo's tekken (letter case). llama.cpp's own spelling of
    tekken keeps combining marks apart, as Strata does; that text is left out here (the same vocabularies
    match llama-tokenize on every text: tools/llamacpp_tokenize_check.py)."""
    from tokenizers import Regex
    from strata.gguf_file import read
    from strata.gguf_vocab import PRE_TOKENIZERS

    folder = tmp_path / "wide"
    folder.mkdir()
    theirs = wide_tokenizer(folder)
    spec = PRE_TOKENIZERS[pre]
    theirs.model.ignore_merges = spec.ignore_merges
    if spec.hf_split:
        theirs.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(spec.hf_split), behavior="isolated"),
                                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        theirs.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True)] * (pre == "smollm")
                                                       + [pre_tokenizers.ByteLevel(add_prefix_space=False)])
    gpt2_vocab_file(tmp_path / "v.gguf", folder, pre)
    ours = StrataTokenizer.from_gguf(read(tmp_path / "v.gguf")[0], tmp_path / "v.gguf")
    texts = [t for t in PRE_TEXTS if pre != "tekken" or "\u0301" not in t]
    assert [ours.encode(t) for t in texts] == [theirs.encode(t, add_special_tokens=False).ids for t in texts]


def test_convert_dflash_carries_a_sentencepiece_targets_vocabulary(tmp_path):
    """convert-dflash --target over a folder of a converted SentencePiece model: the drafter GGUF holds the
    llama vocabulary (gguf's reader sees its kind, tokens, their kinds and scores), and inspect reads it."""
    from strata.gguf_vocab import from_tokenizer_folder

    spm_tokenizer_folder(tmp_path / "target", "legacy")
    tokens, _, types = spm_layout()
    write_hf_drafter(tmp_path / "drafter", vocab=len(tokens), mask_token_id=len(tokens) - 1, tokenizer=False)
    out = tmp_path / "drafter.gguf"
    r = run_cli("convert-dflash", tmp_path / "drafter", out, "--target", tmp_path / "target")
    assert r.returncode == 0, r.stderr
    fields = gguf.GGUFReader(str(out)).fields
    assert bytes(fields["tokenizer.ggml.model"].parts[-1]).decode() == "llama"
    assert [bytes(fields["tokenizer.ggml.tokens"].parts[i]).decode()
            for i in fields["tokenizer.ggml.tokens"].data] == tokens
    assert [int(fields["tokenizer.ggml.token_type"].parts[i][0])
            for i in fields["tokenizer.ggml.token_type"].data] == types
    scores = [float(fields["tokenizer.ggml.scores"].parts[i][0]) for i in fields["tokenizer.ggml.scores"].data]
    assert scores == from_tokenizer_folder(tmp_path / "target", len(tokens)).scores
    r = run_cli("inspect", out)
    assert r.returncode == 0 and f"vocabulary: llama (pre-tokenizer None), {len(tokens)} tokens" in r.stdout, r.stdout
