"""`strata generate` end to end through the real entry point, and its handling of bad input."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

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


def make_tokenizer(folder, vocab_size=256, bos: bool = False):
    """A byte-level BPE tokenizer folder with a chat template; bos: one that, as Llama 3's, puts
    <|begin_of_text|> before every text it encodes (its tokenizer.json's post-processor) and whose template
    writes it too."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|begin_of_text|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["def quicksort(arr):\n    return arr\n"] * 20, trainer)
    config = {"eos_token": "<|endoftext|>",
              "chat_template": "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                               "{% if add_generation_prompt %}<assistant>{% endif %}"}
    if bos:
        tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                           special_tokens=[("<|begin_of_text|>", 1)])
        config.update(bos_token="<|begin_of_text|>", chat_template="{{ bos_token }}" + config["chat_template"])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return tok


@pytest.mark.parametrize("bos", [False, True])
def test_generate_text_with_tokenizer(tmp_path, bos):
    """Text prompts, plain and through the chat template, become the ids transformers' own tokenizer gives
    for the folder: with one BOS where the tokenizer adds it (and the template writes it)."""
    import transformers

    path, _ = write_hf_model(tmp_path / "m", "qwen3", seed=2, vocab=300)
    make_tokenizer(path, 300, bos)
    theirs = transformers.AutoTokenizer.from_pretrained(path)
    prompt = "def quicksort(arr):"
    ids = theirs(prompt).input_ids
    assert (ids[0] == 1) == bos and ids.count(1) == bos
    expected = Engine(load_target(path), max_len=512).generate(ids, 10).output_ids
    r = run_cli("generate", "--model", path, "--prompt", prompt, "--max-new-tokens", "10", "--stats-json",
                tmp_path / "p.json")
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "p.json").read_text())["prompt_ids"] == ids
    assert r.stdout.rstrip("\n") == theirs.decode(expected, skip_special_tokens=True)
    chat = run_cli("generate", "--model", path, "--prompt", "hi", "--chat", "--max-new-tokens", "3",
                   "--stats-json", tmp_path / "c.json")
    assert chat.returncode == 0, chat.stderr
    want = theirs.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True)
    want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
    assert json.loads((tmp_path / "c.json").read_text())["prompt_ids"] == want
    assert want.count(1) == bos


def test_chat_templates_render_as_transformers_renders_them(tmp_path):
    """What transformers gives chat templates: loop controls, {% generation %} blocks, strftime_now, a
    tojson that keeps non-ASCII and HTML characters, raise_exception."""
    import transformers

    from strata.errors import StrataError
    from strata.tokenizer import Tokenizer as StrataTokenizer

    make_tokenizer(tmp_path, 300)
    template = ("{% for m in messages %}{% if loop.index > 3 %}{% break %}{% endif %}"
                "{% if m.role == 'assistant' %}{% generation %}<a>{{ m.content }}</a>{% endgeneration %}"
                "{% else %}<{{ m.role }}>{{ m.content | tojson }}{{ {'k': [1, m.content]} | tojson(indent=1) }}"
                "{% endif %}{% endfor %}[{{ strftime_now('%Y-%m-%d') }}]"
                "{% if add_generation_prompt %}<a>{% endif %}")
    messages = [{"role": "system", "content": "héllo <b> & 'q' 日本"}, {"role": "user", "content": "x\ny"},
                {"role": "assistant", "content": "z"}, {"role": "user", "content": "never shown"}]
    ours = StrataTokenizer.from_folder(tmp_path)
    ours.chat_template = template
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    want = theirs.apply_chat_template(messages, chat_template=template, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(messages) == want and "never shown" not in want
    ours.chat_template = "{{ raise_exception('no system role') }}"
    with pytest.raises(StrataError, match="chat template: no system role"):
        ours.apply_chat_template(messages)


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


@pytest.mark.parametrize("edit,needle", [
    ({"rms_norm_eps": 0}, "field 'rms_norm_eps' must be a positive number, got 0"),
    ({"rms_norm_eps": "x"}, "field 'rms_norm_eps' must be a positive number, got 'x'"),
    ({"max_position_embeddings": 2.5}, "field 'max_position_embeddings' must be a positive integer, got 2.5"),
    ({"num_key_value_heads": "2"}, "field 'num_key_value_heads' must be a positive integer, got '2'"),
    ({"head_dim": -16}, "field 'head_dim' must be a positive integer, got -16"),
    ({"attention_bias": "no"}, "field 'attention_bias' must be true or false, got 'no'"),
    ({"tie_word_embeddings": 1}, "field 'tie_word_embeddings' must be true or false, got 1"),
    ({"eos_token_id": 2.0}, "field 'eos_token_id' must be a token id or a list of them, got 2.0"),
    ({"rope_parameters": [1]}, "field 'rope_parameters' must be an object, got [1]"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": "1e4"}}, "field 'rope_theta' must be a positive number"),
    ({"num_hidden_layers": 10 ** 12}, "num_hidden_layers is 1000000000000, but the checkpoint holds 3 layers"),
    ({"use_sliding_window": True, "sliding_window": 64, "layer_types": ["full_attention", "sliding_attention"] * 2},
     "use_sliding_window gives layers 1.. a sliding window of 64, which is not supported"),
], ids=lambda x: "-".join(x) if isinstance(x, dict) else "")
def test_bad_config_values_are_refused_by_field(tmp_path, qwen3_dir, edit, needle):
    """config.json's values are checked by type and range before any weight is used, each refusal naming
    the field (a layer count past the checkpoint's before a layout of that many layers is built)."""
    from strata.errors import StrataError

    path = tmp_path / "m"
    shutil.copytree(qwen3_dir, path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, **edit}))
    with pytest.raises(StrataError, match=re.escape(needle)):
        load_target(path)


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


def test_a_bad_prompt_is_refused_before_the_weights_load(qwen3_dir, monkeypatch, capsys):
    """A prompt past the context, with an id outside the vocabulary, or text without a tokenizer is found
    from config.json and the tokenizer alone: the weights never load."""
    from strata import cli, pair

    monkeypatch.setattr(pair, "load_target", lambda *a, **k: pytest.fail("the weights were loaded"))
    for args, needle in [(["--prompt-ids", ",".join(["1"] * 40), "--max-model-len", "32"], "does not fit the context"),
                         (["--prompt-ids", "1,999"], "outside the vocabulary"), (["hello"], "no tokenizer.json")]:
        assert cli.main(["generate", "--model", str(qwen3_dir), *args]) == 2
        assert needle in capsys.readouterr().err


def test_the_layout_options_are_one_backend_and_setting_errors_name_the_options():
    from argparse import Namespace

    from strata.cli import FLAGS, backend
    from strata.engine.config import EngineConfig
    from strata.engine.prompt_lookup import PromptLookupDrafter
    from strata.errors import SettingError, StrataError

    def args(**kw):
        return Namespace(**{"eager": False, "static": False, "no_graphs": False, "no_compile": False,
                            "no_triton": False, "device": "cpu", **kw})

    assert backend(args()) == "eager" and backend(args(device="cuda", eager=True)) == "eager"
    assert backend(args(device="cuda")) == backend(args(static=True)) == "graphs+triton"
    assert backend(args(device="cuda", no_triton=True)) == "graphs+compile"
    assert backend(args(static=True, no_compile=True, no_triton=True)) == "graphs"  # the lowest named wins
    assert backend(args(device="cuda", no_triton=True, no_graphs=True)) == "static"
    for bad in (args(eager=True, static=True), args(device="cuda", eager=True, no_graphs=True), args(no_compile=True)):
        with pytest.raises(StrataError):
            backend(bad)
    with pytest.raises(SettingError) as e:
        EngineConfig(window=300).window_for(PromptLookupDrafter(3))
    assert str(e.value) == "window 300: must be between 2 and the drafter's largest window 256"
    assert e.value.named(FLAGS) == "--spec 300: must be between 2 and the drafter's largest window 256"
