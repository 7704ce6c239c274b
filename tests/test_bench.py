"""`strata bench` on the CPU (tiny shape): every section present, oracle at full acceptance, outputs
identical across Strata's paths and transformers' generate, a JSON and a plot written."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import run_cli

from strata.bench.plot import title


def test_bench_tiny_cpu(tmp_path):
    out = tmp_path / "b.json"
    (tmp_path / "index.jsonl").write_text(json.dumps({"file": "b.json", "commit": "old"}) + "\n" +
                                          json.dumps({"file": "a.json", "commit": "kept"}) + "\n")
    r = run_cli("bench", "--shape", "tiny", "--drafter-layers", "1", "--block-size", "4", "--prompt-len", "24",
                "--new-tokens", "17", "--runs", "1", "--out", out, timeout=600)
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 10_000
    assert data["copy_bandwidth_GBps"] > 0 and data["floor_tok_s"] > 0 and data["weight_bytes"] > 0
    assert data["window"] == 4 and data["new_tokens"] == 17
    oracle = data["dflash_oracle"]
    assert oracle["identical_to_target_only"] and data["dflash"]["identical_to_target_only"]
    assert oracle["tau"] > 3.0 and oracle["per_position_acceptance"] == [1.0, 1.0, 1.0]
    assert oracle["rounds"] == 4  # 16 tokens after the prefill's first one, 4 per round
    for section in ("target_only", "dflash_oracle", "dflash"):
        assert data[section]["tok_s"] > 0
    assert set(data["dflash"]["split"]) == {"draft_ms", "verify_ms", "other_ms"}
    assert data["hf"]["eager"]["identical_to_strata"], data["hf"]
    assert data["ratios"]["target_only_vs_hf_eager"] > 0
    assert "target-only" in r.stderr and "HF generate (eager)" in r.stderr
    index = [json.loads(line) for line in (tmp_path / "index.jsonl").read_text().splitlines()]
    assert [e["file"] for e in index] == ["a.json", "b.json"] and index[0]["commit"] == "kept"  # its line replaced
    entry = index[1]
    assert entry["commit"] == data["commit"] and entry["model"] == "tiny" and entry["plot"] == "b.png"
    assert entry["mode"] == "eager W=4 random 1-layer drafter" and entry["quant"] == "float32"
    assert entry["metric"]["target_only_tok_s"] == round(data["target_only"]["tok_s"], 1)


def test_bench_without_out_prints_and_writes_nothing(tmp_path):
    r = run_cli("bench", "--shape", "tiny", "--prompt-len", "4", "--new-tokens", "3", "--runs", "1", "--hf", "none",
                cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "target-only" in r.stderr and "wrote" not in r.stderr
    assert list(tmp_path.iterdir()) == []


def test_plot_title_names_the_model_and_its_file_type():
    """A committed quantized bench's plot is titled with its --quant file type, not only the activations' dtype."""
    committed = Path(__file__).parents[1] / "bench/results/bench-qwen3-8b-Q4_K_M-h100-c02f3e3.json"
    result = json.loads(committed.read_text())
    assert title(result) == "qwen3-8b-Q4_K_M, 36L h4096, NVIDIA H100 80GB HBM3, bfloat16, prompt 512, 256 new, W=16"
    del result["model"]
    assert title(result).startswith("36L h4096, NVIDIA H100")


def test_bench_random_dflash2_and_dspark_drafters(tmp_path):
    """--drafter-variant: a random DFlash2 or DSpark drafter of the shape (what the selector's and the Markov head's
    costs are measured with), --drafter-type Q8_0 stored as convert-dflash --type Q8_0 stores it; DFlash with it
    equals target-only."""
    for variant, kind in (("dflash2", "BF16"), ("dspark", "Q8_0")):
        out = tmp_path / f"{variant}.json"
        r = run_cli("bench", "--shape", "tiny", "--drafter-layers", "1", "--drafter-variant", variant, "--block-size",
                    "4", "--prompt-len", "8", "--new-tokens", "9", "--runs", "1", "--hf", "none", "--out", out,
                    "--drafter-type", kind)
        assert r.returncode == 0, r.stderr
        data = json.loads(out.read_text())
        name = f"random 1-layer {variant}" + (" Q8_0" if kind == "Q8_0" else "")
        assert data["drafter"] == name and data["dflash"]["identical_to_target_only"]


def test_bench_mtp_on_a_random_hybrid_shape(tmp_path):
    """--mtp on a hybrid --shape: its random MTP block drafts (the round's draft and verify costs, and the speed at
    the oracle's acceptance), output equal to target-only; a shape without a block is refused in one line."""
    out = tmp_path / "mtp.json"
    r = run_cli("bench", "--shape", "tiny-hybrid", "--mtp", "--spec", "3", "--prompt-len", "8", "--new-tokens", "9",
                "--runs", "1", "--hf", "none", "--out", out)
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    assert data["drafter"] == "the model's MTP block (random)" and data["dflash"]["drafter"] == "mtp"
    assert data["dflash"]["identical_to_target_only"] and data["dflash"]["tok_s_at_oracle_tau"] > 0
    assert "MTP W=3" in r.stderr
    r = run_cli("bench", "--shape", "tiny", "--mtp", "--runs", "1", "--hf", "none")
    assert r.returncode == 2 and r.stderr.strip().endswith("has no MTP block (the hybrid shapes have one: tiny-hybrid, "
                                                           "qwen3.5-9b, qwen3.5-35b-a3b)")
