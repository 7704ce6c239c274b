"""The embedded demo pair: installed with the package, the default of the commands, and sound."""

from __future__ import annotations

from strata import demo
from strata.dflash.artifact import load_artifact
from strata.dflash.drafter import load_drafter
from strata.models.loader import load_target
from strata.engine.decode import Engine
from strata.tokenizer import Tokenizer

from conftest import run_cli


def test_demo_pair_is_shipped_and_small():
    assert demo.available()
    size = sum(p.stat().st_size for p in demo.HERE.rglob("*") if p.is_file())
    assert size <= 38 * 2 ** 20  # the target, the DFlash2 drafter and the DFlash one it was trained from
    art = load_artifact(demo.DRAFTER)
    assert art.cfg.block_size == 8 and art.fmt == "gguf" and art.cfg.variant == "dflash2"
    assert load_artifact(demo.DFLASH_DRAFTER).cfg.variant == "dflash"
    # llama.cpp's layout: norms in F32, matrices in BF16, the target's vocabulary on board
    assert {art.types[n] for n, t in art.tensors.items() if t.dim() == 1} == {"F32"}
    assert {art.types[n] for n, t in art.tensors.items() if t.dim() == 2} == {"BF16"}
    r = run_cli("inspect", demo.DRAFTER, "--model", demo.TARGET)
    assert r.returncode == 0 and f"target {demo.TARGET}: fits" in r.stdout, r.stdout


def test_generate_defaults_to_the_demo_pair(tmp_path):
    stats = tmp_path / "s.json"
    r = run_cli("generate", "def quicksort(arr):", "--max-new-tokens", "40", "--stats-json", stats)
    assert r.returncode == 0, r.stderr
    import json

    data = json.loads(stats.read_text())
    assert data["drafter"] == "dflash" and data["window"] == 8 and data["new_tokens"] == 40
    target = load_target(demo.TARGET)
    tok = Tokenizer.from_folder(demo.TARGET)
    prompt = tok.encode("def quicksort(arr):")
    expected = Engine(target, max_len=2048).generate(prompt, 40, stop_ids={0}).output_ids
    assert data["output_ids"] == expected
    assert r.stdout.rstrip("\n") == tok.decode(expected)
    plain = run_cli("generate", "def quicksort(arr):", "--max-new-tokens", "40", "--no-dflash")
    assert plain.returncode == 0 and plain.stdout == r.stdout


def test_demo_drafter_accepts_more_than_chance():
    target = load_target(demo.TARGET)
    drafter = load_drafter(demo.DRAFTER, target, max_len=2048)
    prompt = Tokenizer.from_folder(demo.TARGET).encode("import os\n\n\ndef list_files(root):\n")
    res = Engine(target, drafter, max_len=2048).generate(prompt, 64)
    assert res.output_ids == Engine(target, max_len=2048).generate(prompt, 64).output_ids
    assert res.stats()["tau"] > 1.5


def test_parity_and_gate_default_to_the_demo_pair():
    r = run_cli("parity")
    assert r.returncode == 0 and "FIRST DIVERGENCE: none" in r.stdout, r.stdout + r.stderr
