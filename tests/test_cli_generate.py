"""`strata generate` end to end through the real entry point, and its handling of bad input."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers

from strata.models.loader import load_target
from strata.engine.decode import Engine

from conftest import run_cli, write_hf_model


def test_generate_ids_and_stats(qwen3_dir, tmp_path):
    stats = tmp_path / "s.json"
    r = run_cli("generate", "--model", qwen3_dir, "--prompt-ids", "5,6,7,8", "--max-new-tokens", "12",
                "--stats-json", stats)
    assert r.returncode == 0, r.stderr
    data = json.loads(stats.read_text())
    expected = Engine(load_target(qwen3_dir), max_len=512).generate([5, 6, 7, 8], 12).output_ids
    assert data["output_ids"] == expected
    assert r.stdout.strip() == ",".join(map(str, expected))
    assert data["prompt_ids"] == [5, 6, 7, 8] and data["new_tokens"] == 12
    assert set(data) >= {"prefill_s", "decode_s", "tok_s"}
    assert "prompt 4 tokens, new 12 tokens" in r.stderr


def test_stop_id_ends_generation(qwen3_dir, tmp_path):
    full = Engine(load_target(qwen3_dir), max_len=512).generate([5, 6, 7, 8], 12).output_ids
    stop = full[5]
    cut = full[: full.index(stop) + 1]
    r = run_cli("generate", "--model", qwen3_dir, "--prompt-ids", "5,6,7,8", "--max-new-tokens", "12",
                "--stop-ids", str(stop))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == ",".join(map(str, cut))


def make_tokenizer(folder, vocab_size=256):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["def quicksort(arr):\n    return arr\n"] * 20, trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|endoftext|>",
        "chat_template": "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}",
    }))
    return tok


def test_generate_text_with_tokenizer(tmp_path):
    path, _ = write_hf_model(tmp_path / "m", "qwen3", seed=2, vocab=300)
    tok = make_tokenizer(path, 300)
    prompt = "def quicksort(arr):"
    ids = tok.encode(prompt).ids
    expected = Engine(load_target(path), max_len=512).generate(ids, 10).output_ids
    r = run_cli("generate", "--model", path, "--prompt", prompt, "--max-new-tokens", "10")
    assert r.returncode == 0, r.stderr
    assert r.stdout.rstrip("\n") == tok.decode(expected)
    chat = run_cli("generate", "--model", path, "--prompt", "hi", "--chat", "--max-new-tokens", "3",
                   "--stats-json", tmp_path / "c.json")
    assert chat.returncode == 0, chat.stderr
    assert json.loads((tmp_path / "c.json").read_text())["prompt_ids"] == tok.encode("<user>hi<assistant>").ids


def test_eos_from_generation_config(qwen3_dir, tmp_path):
    path = tmp_path / "m"
    shutil.copytree(qwen3_dir, path)
    full = Engine(load_target(path), max_len=512).generate([5, 6, 7, 8], 12).output_ids
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [full[2]]}))
    r = run_cli("generate", "--model", path, "--prompt-ids", "5,6,7,8", "--max-new-tokens", "12")
    assert r.stdout.strip() == ",".join(map(str, full[: full.index(full[2]) + 1]))


def _broken(tmp_path, qwen3_dir, how):
    path = tmp_path / "m"
    shutil.copytree(qwen3_dir, path)
    cfg = json.loads((path / "config.json").read_text())
    if how == "no-config":
        (path / "config.json").unlink()
    elif how == "arch":
        cfg["architectures"] = ["MambaForCausalLM"]
        (path / "config.json").write_text(json.dumps(cfg))
    elif how in ("missing", "shape"):
        from safetensors.torch import load_file, save_file

        sd = load_file(path / "model.safetensors")
        if how == "missing":
            del sd["model.layers.1.mlp.up_proj.weight"]
        else:
            sd["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(3, 64)
        save_file(sd, path / "model.safetensors")
    return path


@pytest.mark.parametrize("how,needle", [
    ("no-config", "config.json"),
    ("arch", "unknown architecture ['MambaForCausalLM']"),
    ("missing", "missing tensor 'model.layers.1.mlp.up_proj.weight'"),
    ("shape", "tensor 'model.layers.1.self_attn.k_proj.weight' has shape [3, 64], expected [32, 64]"),
])
def test_bad_model_is_one_line_exit_2(tmp_path, qwen3_dir, how, needle):
    path = _broken(tmp_path, qwen3_dir, how)
    r = run_cli("generate", "--model", path, "--prompt-ids", "1,2", "--max-new-tokens", "2")
    assert r.returncode == 2
    assert needle in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("args,needle", [
    (["--prompt-ids", ""], "empty prompt"),
    (["--prompt-ids", ",".join(["1"] * 40), "--max-model-len", "32"], "does not fit the context of 32"),
    (["--prompt-ids", "1,x"], "--prompt-ids"),
    (["--prompt-ids", "1,999"], "outside the vocabulary"),
    (["--prompt", "hello"], "no tokenizer.json"),
    (["--prompt-ids", "1", "--max-new-tokens", "0"], "max_new_tokens must be >= 1"),
    (["--prompt-ids", "1", "--max-model-len", "0"], "--max-model-len must be >= 2"),
])
def test_bad_prompt_is_one_line_exit_2(qwen3_dir, args, needle):
    r = run_cli("generate", "--model", qwen3_dir, *args)
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
