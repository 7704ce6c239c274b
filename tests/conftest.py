"""Shared fixtures: tiny checkpoints written by transformers itself, the independent reference."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(2)


def hf_config(family: str, tie: bool = False, kv_heads: int = 2, vocab: int = 256, layers: int = 3, **kw):
    import transformers

    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=512,
                  tie_word_embeddings=tie, rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None,
                  pad_token_id=None)
    common.update(kw)
    if family == "qwen3":
        return transformers.Qwen3Config(head_dim=16, rope_theta=10000.0, **common)
    if family == "llama":
        return transformers.LlamaConfig(
            head_dim=16, rope_theta=500000.0,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 64},
            **common)
    raise ValueError(family)


def write_hf_model(path: Path, family: str = "qwen3", seed: int = 0, max_shard_size=None, **kw):
    """Save a random model with transformers' save_pretrained (float32); returns (path, hf_model)."""
    import transformers

    torch.manual_seed(seed)
    cfg = hf_config(family, **kw)
    cls = transformers.Qwen3ForCausalLM if family == "qwen3" else transformers.LlamaForCausalLM
    model = cls(cfg).eval()
    with torch.no_grad():  # norms at 1.0 hide bugs in their use: randomise them
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **kwargs)
    return path, model


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory):
    path, _ = write_hf_model(tmp_path_factory.mktemp("qwen3"), "qwen3", seed=1)
    return path


def run_cli(*args, timeout=300, **kw) -> subprocess.CompletedProcess:
    """Run the real `strata` entry point in a subprocess."""
    return subprocess.run([sys.executable, "-m", "strata.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, **kw)
