"""Shared fixtures: tiny checkpoints written by transformers itself, the independent reference."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ["TRITON_INTERPRET"] = "1"  # Strata's Triton kernels run in Triton's interpreter on the CPU
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)


from strata.layers.kernels.fla import transformers_in_torch  # noqa: E402

transformers_in_torch()  # the reference hybrids run transformers' torch code on the CPU


def hf_config(family: str, tie: bool = False, kv_heads: int = 2, vocab: int = 256, layers: int = 3, **kw):
    import transformers

    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=512,
                  tie_word_embeddings=tie, rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None,
                  pad_token_id=None)
    head_dim = kw.pop("head_dim", 16)
    common.update(kw)
    if family == "qwen3":
        return transformers.Qwen3Config(head_dim=head_dim, rope_theta=10000.0, **common)
    linear = dict(head_dim=head_dim, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                  linear_value_head_dim=16, linear_conv_kernel_dim=4)
    experts = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
    if family == "qwen3_5":
        return transformers.Qwen3_5TextConfig(**{**linear, **common})
    if family == "qwen3_5_moe":
        common.pop("intermediate_size")
        return transformers.Qwen3_5MoeTextConfig(**{**linear, **experts, **common})
    if family == "qwen3_next":
        return transformers.Qwen3NextConfig(**{**linear, **experts, "mlp_only_layers": [1], **common})
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(head_dim=head_dim, rope_theta=10000.0, **common)
    if family == "llama":
        return transformers.LlamaConfig(
            head_dim=head_dim, rope_theta=500000.0,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 64},
            **common)
    raise ValueError(family)


def write_hf_model(path: Path, family: str = "qwen3", seed: int = 0, max_shard_size=None, **kw):
    """Save a random model with transformers' save_pretrained (float32); returns (path, hf_model)."""
    import transformers

    torch.manual_seed(seed)
    cfg = hf_config(family, **kw)
    cls = {"qwen3": transformers.Qwen3ForCausalLM, "llama": transformers.LlamaForCausalLM,
           "qwen3_moe": transformers.Qwen3MoeForCausalLM, "qwen3_5": transformers.Qwen3_5ForCausalLM,
           "qwen3_5_moe": transformers.Qwen3_5MoeForCausalLM, "qwen3_next": transformers.Qwen3NextForCausalLM}[family]
    model = cls(cfg).eval()
    with torch.no_grad():  # norms at 1.0 hide bugs in their use: randomise them
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            if name.endswith("mlp.gate.weight"):  # a decisive router: each token's experts differ
                p.mul_(25.0)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **kwargs)
    return path, model


def add_mtp_block(folder: Path, seed: int = 5, counted: bool = True, passthrough: float = 1.0) -> Path:
    """An MTP block as Qwen3.5 / Qwen3-Next checkpoints carry it beside the decoder (mtp.*: a full-attention
    layer, fc over [normed embedding, normed hidden state], three norms stored as w of 1 + w): the last
    full-attention layer's weights, fc = passthrough x [I, 0] + noise (the embedding carried through: drafts the
    target's repetitive text partly right), random norms. counted: config.json's mtp_num_hidden_layers
    (Qwen3-Next's config has none)."""
    import json

    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    cfg = json.loads((folder / "config.json").read_text())
    last = max(n for n, t in enumerate(cfg["layer_types"]) if t == "full_attention")
    prefix, h = f"model.layers.{last}.", cfg["hidden_size"]
    tensors.update({"mtp.layers.0." + k[len(prefix):]: t.clone() for k, t in tensors.items() if k.startswith(prefix)})
    gen = torch.Generator().manual_seed(seed)
    fc = torch.randn(h, 2 * h, generator=gen) * 0.05
    fc[:, :h] += passthrough * torch.eye(h)
    tensors["mtp.fc.weight"] = fc
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{norm}.weight"] = torch.randn(h, generator=gen) * 0.1
    save_file(tensors, str(folder / "model.safetensors"))
    if counted:
        cfg["mtp_num_hidden_layers"] = 1
        (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory):
    path, _ = write_hf_model(tmp_path_factory.mktemp("qwen3"), "qwen3", seed=1)
    return path


def run_cli(*args, timeout=300, **kw) -> subprocess.CompletedProcess:
    """Run the real `strata` entry point in a subprocess."""
    return subprocess.run([sys.executable, "-m", "strata.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, **kw)


def cli(*args) -> tuple[int, str]:
    """The `strata` command run in this process (for what ends before or soon after a small model loads):
    its exit code and what it wrote to stderr."""
    import contextlib
    import io

    from strata.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main([str(a) for a in args])
    return code, err.getvalue()


def write_hf_drafter(path: Path, layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
                     head_dim: int = 16, intermediate: int = 96, taps=(0, 2), target_hidden: int | None = None,
                     block_size: int = 8, mask_token_id: int = 255, num_target_layers: int = 3, vocab: int = 256,
                     dtype=torch.bfloat16, seed: int = 0, block_in_dflash_config=False, with_taps=True,
                     scale: float = 0.05, extra_config: dict | None = None, extra_tensors: dict | None = None,
                     tokenizer: bool = True):
    """A drafter in the reference Hugging Face format (config.json + model.safetensors), random weights;
    with tokenizer, a byte-level BPE tokenizer.json of `vocab` tokens beside them (what convert-dflash
    otherwise takes from --target)."""
    import json

    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    target_hidden = target_hidden or hidden
    dcfg = {"mask_token_id": mask_token_id}
    if with_taps:
        dcfg["target_layer_ids"] = list(taps)
    cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": hidden,
           "intermediate_size": intermediate, "num_hidden_layers": layers, "num_attention_heads": heads,
           "num_key_value_heads": kv_heads, "head_dim": head_dim, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
           "vocab_size": vocab, "num_target_layers": num_target_layers, "max_position_embeddings": 4096,
           "dflash_config": dcfg}
    if block_in_dflash_config:
        dcfg["block_size"] = block_size
    else:
        cfg["block_size"] = block_size
    cfg.update(extra_config or {})
    (path / "config.json").write_text(json.dumps(cfg))
    gen = torch.Generator().manual_seed(seed)
    q, kv = heads * head_dim, kv_heads * head_dim
    shapes = {"fc.weight": (hidden, len(taps) * target_hidden), "hidden_norm.weight": (hidden,),
              "norm.weight": (hidden,)}
    for n in range(layers):
        p = f"layers.{n}."
        shapes.update({p + "input_layernorm.weight": (hidden,), p + "self_attn.q_proj.weight": (q, hidden),
                       p + "self_attn.k_proj.weight": (kv, hidden), p + "self_attn.v_proj.weight": (kv, hidden),
                       p + "self_attn.o_proj.weight": (hidden, q), p + "self_attn.q_norm.weight": (head_dim,),
                       p + "self_attn.k_norm.weight": (head_dim,), p + "post_attention_layernorm.weight": (hidden,),
                       p + "mlp.gate_proj.weight": (intermediate, hidden), p + "mlp.up_proj.weight": (intermediate, hidden),
                       p + "mlp.down_proj.weight": (hidden, intermediate)})
    tensors = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        else:
            t = torch.randn(shape, generator=gen) * scale
        tensors[name] = t.to(dtype)
    tensors.update(extra_tensors or {})
    save_file(tensors, str(path / "model.safetensors"))
    if tokenizer:
        write_byte_tokenizer(path, vocab)
    return path


def write_byte_tokenizer(folder: Path, vocab: int):
    """A byte-level BPE tokenizer.json (GPT-2 pre-tokenizer) of at most `vocab` tokens, trained on a line of
    code; with more than 256 tokens the first is <|endoftext|>."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"] if vocab > 256 else [],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["def quicksort(arr):\n    return sorted(arr)\n"] * 20, trainer)
    tok.save(str(folder / "tokenizer.json"))
    if vocab > 256:
        (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return tok


def forward_at(model, tokens, start: int, cache, taps=None, kv_len: int | None = None, kernels=None, logits="all"):
    """The model's one forward over tokens at positions start.., attending over kv_len cells (by default
    exactly those written so far): what the model runner's steps call."""
    from strata.layers.kernels import EAGER
    from strata.layers.modules import Step

    positions = torch.arange(start, start + tokens.shape[-1])
    return model(tokens, Step(positions, kv_len or start + tokens.shape[-1], kernels or EAGER), cache, taps or (),
                 logits)


def cache_equal(a, b, cells: int, atol: float) -> bool:
    """Two caches hold the same first `cells` cells in every layer (within atol)."""
    return all((x.k[:cells] - y.k[:cells]).abs().max() <= atol and (x.v[:cells] - y.v[:cells]).abs().max() <= atol
               for x, y in zip(a.layers, b.layers))


def observe(drafter, tokens: list[int], start: int, taps, kernels=None):
    from strata.engine.drafter import Commit
    from strata.layers.kernels import EAGER

    drafter.observe(Commit(start, list(tokens), taps, torch.arange(start, start + len(tokens)), kernels or EAGER))


def propose(drafter, anchor: int, pos: int, n: int, kv_len: int | None = None, kernels=None):
    from strata.engine.drafter import DraftRequest
    from strata.layers.kernels import EAGER

    return drafter.propose(DraftRequest(anchor, pos, n, torch.tensor([anchor]), torch.tensor([pos]),
                                        kv_len or pos + n + 1, kernels or EAGER, rate=True))


def small_pair(d: Path):
    """The tests' small qwen3 target and a 2-layer drafter that reaches useful acceptance on it:
    (target folder, drafter folder, loaded target)."""
    from strata.models.loader import load_target

    target_dir, _ = write_hf_model(d / "target", "qwen3", seed=21)
    drafter_dir = write_hf_drafter(d / "drafter", layers=2, taps=(0, 2), block_size=8, seed=4, scale=0.2)
    return target_dir, drafter_dir, load_target(target_dir)


def bench_tiny_shape(tmp_path: Path, shape: str) -> dict:
    """`strata bench` on a tiny random shape with transformers' generate beside it: the result JSON."""
    import json

    out = tmp_path / f"{shape}.json"
    r = run_cli("bench", "--shape", shape, "--drafter-layers", "1", "--block-size", "8", "--prompt-len", "16",
                "--new-tokens", "16", "--runs", "1", "--hf", "eager", "--out", out)
    assert r.returncode == 0, r.stderr
    return json.loads(out.read_text())
