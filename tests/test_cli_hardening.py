"""What a new user's run broke, each through the real command line: context length, output paths,
threads, the context's end, help and version, prompts from files and stdin, file modes, summaries."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import stat
import subprocess
import sys

import pytest
import torch

from strata.demo import DRAFTER as DEMO_DRAFTER
from strata.engine.decode import Engine
from strata.engine.runner import ModelRunner
from strata.models.loader import load_target
from strata.models.random_init import qwen3_config
from strata.models.shapes import SHAPES

from conftest import cli, run_cli, write_byte_tokenizer, write_hf_drafter


def test_context_past_the_model_is_refused_unless_allowed(qwen3_dir, tmp_path):
    r = run_cli("generate", "--model", qwen3_dir, "--prompt-ids", "1,2", "--max-model-len", "4096")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "--max-model-len 4096 exceeds the model's context of 512 tokens" in r.stderr
    assert "--allow-long-context" in r.stderr
    stats = tmp_path / "s.json"
    r = run_cli("generate", "--model", qwen3_dir, "--prompt-ids", "1,2", "--max-model-len", "600",
                "--allow-long-context", "--max-new-tokens", "4", "--stats-json", stats)
    assert r.returncode == 0, r.stderr
    assert json.loads(stats.read_text())["new_tokens"] == 4


def test_chunked_prefill_gives_the_same_logits_and_tokens(qwen3_dir, monkeypatch):
    """Prefill memory is linear in the prompt because it runs in chunks; chunks change nothing."""
    target = load_target(qwen3_dir)
    prompt = torch.randint(0, 256, (150,), generator=torch.Generator().manual_seed(2)).tolist()
    whole = Engine(target, max_len=512)
    assert whole.runner.prefill_rows(150) >= 150  # a short prompt is one chunk
    assert 64 <= whole.runner.prefill_rows(100_000) < whole.runner.prefill_rows(1000)
    want = whole.runner.prefill(prompt)
    out = whole.generate(prompt, 24).output_ids
    monkeypatch.setattr(ModelRunner, "prefill_rows", lambda self, n: 16)
    chunked = Engine(target, max_len=512)
    got = chunked.runner.prefill(prompt)
    assert (got.logits - want.logits).abs().max() <= 1e-5
    assert chunked.generate(prompt, 24).output_ids == out


def test_outputs_are_checked_before_the_work(qwen3_dir, tmp_path):
    r = run_cli("generate", "--model", qwen3_dir, "--prompt-ids", "1,2", "--stats-json", tmp_path / "no" / "s.json")
    assert r.returncode == 2 and "--stats-json" in r.stderr and "does not exist" in r.stderr and not r.stdout
    r = run_cli("gate", "--stats-json", tmp_path, "--max-new-tokens", "2")
    assert r.returncode == 2 and "is a folder" in r.stderr
    blocker = tmp_path / "file"
    blocker.write_text("x")
    r = run_cli("export-dflash", "src/strata/demo/drafter.gguf", blocker)
    assert r.returncode == 2 and "exists and is a file" in r.stderr
    r = run_cli("convert-dflash", tmp_path, tmp_path / "missing" / "d.gguf")
    assert r.returncode == 2 and "does not exist" in r.stderr and not (tmp_path / "missing").exists()
    r = run_cli("bench", "--shape", "tiny", "--out", tmp_path / "missing" / "b.json")
    assert r.returncode == 2 and "--out" in r.stderr and not (tmp_path / "missing").exists()
    r = run_cli("bench", "--shape", "tiny", "--out", tmp_path / "b.png")  # the JSON's name, not its plot's
    assert r.returncode == 2 and "expected the JSON's file name" in r.stderr and not list(tmp_path.glob("b.*"))
    (tmp_path / "c.png").mkdir()
    r = run_cli("bench", "--shape", "tiny", "--out", tmp_path / "c.json")
    assert r.returncode == 2 and "--out's plot" in r.stderr and "is a folder" in r.stderr
    assert not (tmp_path / "c.json").exists()
    r = run_cli("init-random", tmp_path / "missing" / "m")
    assert r.returncode == 2 and not (tmp_path / "missing").exists()


def test_threads_default_to_one_and_follow_the_user(qwen3_dir, tmp_path):
    stats = tmp_path / "s.json"
    base = ["generate", "--model", qwen3_dir, "--prompt-ids", "1,2", "--max-new-tokens", "2", "--stats-json", stats]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    for extra, omp, want in (([], None, 1), (["--threads", "2"], None, 2), ([], "2", 2)):
        r = run_cli(*base, *extra, env={**env, **({"OMP_NUM_THREADS": omp} if omp else {})})
        assert r.returncode == 0, r.stderr
        assert json.loads(stats.read_text())["threads"] == want, (extra, omp)
    r = run_cli(*base, "--threads", "0")
    assert r.returncode == 2 and "--threads must be between 1 and the" in r.stderr


def test_the_context_end_is_reported(tmp_path):
    stats = tmp_path / "s.json"
    r = run_cli("generate", "--prompt-ids", "5,6,7", "--max-new-tokens", "10000000", "--max-model-len", "40",
                "--stats-json", stats)
    assert r.returncode == 0, r.stderr
    data = json.loads(stats.read_text())
    assert data["new_tokens"] == 40 + 1 - 3 and data["finish_reason"] == "length" and data["limit"] == "context"
    assert "stopped at the end of the context (40 tokens, --max-model-len)" in r.stderr
    r = run_cli("generate", "--prompt-ids", "5,6,7", "--max-new-tokens", "4", "--stats-json", stats)
    assert json.loads(stats.read_text())["limit"] == "max_new_tokens" and "context" not in r.stderr


def test_version_help_and_only_the_options_a_command_uses():
    from strata import __version__
    from strata import cli
    from strata.cli_options import build_parser

    r = run_cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"strata {__version__}"
    r = subprocess.run([sys.executable, "-m", "strata", "--version"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == f"strata {__version__}"  # python -m strata
    parser = build_parser(cli)
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    for name, sub in commands.items():
        for action in sub._actions:
            if not isinstance(action, argparse._HelpAction):
                assert action.help, f"strata {name}: {action.dest} has no help"
    for command in ("gate", "parity", "taps", "bench"):
        r = run_cli(command, "--temperature", "0.8")
        assert r.returncode == 2 and "unrecognized arguments: --temperature" in r.stderr, command
    assert run_cli("gate", "--prompt-lookup", "2").returncode == 2


def test_prompt_from_a_file_and_from_stdin(tmp_path):
    prompt = "def quicksort(arr):"
    direct = run_cli("generate", prompt, "--max-new-tokens", "8", "--no-dflash")
    path = tmp_path / "p.txt"
    path.write_text(prompt)
    from_file = run_cli("generate", "--prompt-file", path, "--max-new-tokens", "8", "--no-dflash")
    from_stdin = run_cli("generate", "--prompt-file", "-", "--max-new-tokens", "8", "--no-dflash", input=prompt)
    assert direct.returncode == 0 and direct.stdout == from_file.stdout == from_stdin.stdout
    huge = "x = 1\n" * 35_000  # 210 KB: more than argv can carry
    r = run_cli("generate", "--prompt-file", "-", "--no-dflash", input=huge)
    assert r.returncode == 2 and "does not fit the context of 2048" in r.stderr  # it was read whole
    r = run_cli("generate", "--prompt-file", tmp_path / "none.txt")
    assert r.returncode == 2 and "--prompt-file" in r.stderr
    r = run_cli("generate", prompt, "--prompt-file", path)
    assert r.returncode == 2 and "exactly one of" in r.stderr


def test_written_files_follow_the_umask(tmp_path):
    def umask_022():
        os.umask(0o022)

    assert run_cli("init-random", tmp_path / "m", preexec_fn=umask_022).returncode == 0
    assert run_cli("export-dflash", "src/strata/demo/drafter.gguf", tmp_path / "e", preexec_fn=umask_022,
                   cwd=os.getcwd()).returncode == 0
    for path in (tmp_path / "m" / "model.safetensors", tmp_path / "e" / "model.safetensors",
                 tmp_path / "e" / "config.json"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, path


def test_summary_of_one_token_and_the_round_split_on_the_cpu(tmp_path):
    r = run_cli("generate", "--prompt-ids", "5,6,7", "--max-new-tokens", "1")
    assert r.returncode == 0 and "no decode round" in r.stderr and "0.0 tok/s" not in r.stderr
    stats = tmp_path / "s.json"
    r = run_cli("generate", "--prompt-ids", "5,6,7", "--max-new-tokens", "24", "--stats-json", stats)
    data = json.loads(stats.read_text())
    assert data["rounds"] > 0 and data["draft_s"] > 0 and data["verify_s"] > 0
    assert data["draft_s"] + data["verify_s"] <= data["decode_s"]


def test_an_output_never_replaces_a_device_a_fifo_or_a_link(tmp_path):
    drafter = write_hf_drafter(tmp_path / "d")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    specials = {fifo: stat.S_ISFIFO}
    device = tmp_path / "full"
    try:  # /dev/full's numbers: a character device that is not the machine's own
        os.mknod(device, 0o666 | stat.S_IFCHR, os.makedev(1, 7))
        specials[device] = stat.S_ISCHR
    except PermissionError:
        pass
    for path, kind in specials.items():
        for args in (("generate", "--prompt-ids", "1,2", "--stats-json", path), ("gate", "--stats-json", path),
                     ("bench", "--shape", "tiny", "--out", path), ("convert-dflash", drafter, path)):
            code, err = cli(*args)
            assert code == 2 and "which writing a file there would replace" in err, (args, err)
            assert len(err.strip().splitlines()) == 1 and kind(os.lstat(path).st_mode), args
    real, link = tmp_path / "real.json", tmp_path / "link.json"
    link.symlink_to(real)  # written through: the link stays, its target gets the statistics
    code, err = cli("generate", "--prompt-ids", "5,6,7", "--max-new-tokens", "3", "--stats-json", link)
    assert code == 0 and link.is_symlink() and json.loads(real.read_text())["new_tokens"] == 3, err
    names = ["d", "link.json", "real.json", *(p.name for p in specials)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names)
    for args in (("generate", "--prompt-ids", "1,2", "--stats-json", "/proc/strata.json"),
                 ("gate", "--stats-json", "/sys/strata.json"), ("convert-dflash", drafter, "/proc/d.gguf")):
        code, err = cli(*args)  # pseudo file systems take no new file: refused before the work, also for root
        assert code == 2 and "cannot create a file in" in err, (args, err)


def test_an_output_never_overwrites_the_commands_own_inputs(tmp_path, qwen3_dir):
    model = shutil.copytree(qwen3_dir, tmp_path / "m")
    drafter = write_hf_drafter(tmp_path / "d", taps=(0, 2))
    write_byte_tokenizer(model, 256)
    prompt = tmp_path / "p.txt"
    prompt.write_text("def quicksort(arr):")
    os.link(prompt, tmp_path / "also-p.json")
    before = {p: p.read_bytes() for p in [*model.iterdir(), *drafter.iterdir(), prompt]}
    for args in (("convert-dflash", drafter, drafter / "model.safetensors"),
                 ("convert-dflash", drafter, model / "tokenizer.json", "--target", model),
                 ("generate", "--model", model, "--prompt-ids", "1,2", "--stats-json", model / "config.json"),
                 ("generate", "--prompt-file", prompt, "--stats-json", tmp_path / "also-p.json"),
                 ("gate", "--model", model, "--dflash", drafter, "--stats-json", drafter / "tokenizer.json"),
                 ("bench", "--model", model, "--out", model / "model.safetensors"),
                 ("train-drafter", "--target", model, "--data", prompt, "--out", model),
                 ("train-drafter", "--target", model, "--data", prompt, "--out", tmp_path)):
        code, err = cli(*args)
        assert code == 2 and "an input" in err and "would destroy it" in err, (args, err)
    code, err = cli("init-random", model)
    assert code == 2 and "not empty" in err and "--force" in err
    assert {p: p.read_bytes() for p in before} == before
    (model / "model.safetensors.index.json").write_text("{}")  # --force: the folder becomes the new model
    code, err = cli("init-random", model, "--force", "--shape", "tiny")
    assert code == 0 and "removed model.safetensors.index.json" in err
    assert load_target(model).cfg.num_layers == 4 and not (model / "model.safetensors.index.json").exists()


@pytest.mark.parametrize("args,needle", [
    (("generate", "def", "--tree", "100000"), "--tree 100000: a verify step of 100001 rows does not fit the "
                                              "context of 2048 tokens"),
    (("generate", "def", "--tree", "100000", "--max-model-len", "300000", "--allow-long-context"), "GiB, more than"),
    (("generate", "def", "--spec", "8", "--max-model-len", "8"), "--spec 8: a verify step of 8 rows"),
    (("generate", "def", "--threads", "100000"), "--threads must be between 1 and the"),
    (("bench", "--shape", "tiny", "--runs", "0"), "--runs must be >= 1, got 0"),
    (("bench", "--shape", "tiny", "--runs", "-1"), "--runs must be >= 1, got -1"),
    (("bench", "--shape", "tiny", "--prompt-len", "5000"), "--prompt-len 5000 does not fit the context of 2048"),
    (("bench", "--shape", "tiny", "--verify-windows", "4", "100000"), "--verify-windows 100000: a verify step"),
    (("bench", "--shape", "tiny", "--drafter-layers", "1", "--tree", "8", "100000"), "--tree 100000: a verify step"),
])
def test_every_size_is_bounded_before_the_work(args, needle):
    code, err = cli(*args)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err


def test_a_server_with_an_impossible_tree_is_refused_before_it_loads():
    r = run_cli("serve", "--tree", "100000", "--port", "9", timeout=60)
    assert r.returncode == 2 and "--tree 100000: a verify step of 100001 rows" in r.stderr


def test_inputs_that_are_not_what_they_claim_get_one_clear_line(tmp_path, qwen3_dir):
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(DEMO_DRAFTER.read_bytes()[:3_000_000])
    code, err = cli("generate", "def", "--dflash", truncated)
    assert code == 2 and "cut.gguf: truncated at tensor 'blk." in err and "run past the end of the file" in err, err
    for option in ("--dflash", "--model"):
        code, err = cli("generate", "def", option, "/dev/null")
        assert code == 2 and "/dev/null: is a character device (expected a" in err, err
    code, err = cli("generate", "--model", qwen3_dir, "--prompt-ids", "1,2", "--stop-ids", "7,256")
    assert code == 2 and "--stop-ids: token id 256 outside the vocabulary 0..255" in err, err
    code, err = cli("generate", "--model", qwen3_dir, "--prompt-ids", "1,2", "--expert-cache", "64")
    assert code == 2 and "--expert-cache: the target is a dense model" in err, err
    moe = tmp_path / "moe"
    moe.mkdir()
    (moe / "config.json").write_text(json.dumps(qwen3_config(**{**SHAPES["tiny-moe"], "mlp_only_layers": [1, 4]})))
    code, err = cli("generate", "--model", moe, "--prompt-ids", "1,2")
    assert code == 2 and "'mlp_only_layers' names layer 4, outside the model's 4 layers 0..3" in err, err
