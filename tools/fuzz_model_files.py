"""Fuzz the model files Strata reads before any weight: tiny checkpoints' config.json (qwen3, llama,
qwen3_moe) and a tiny Q8_0 qwen3 GGUF's metadata, each field or key deleted or set to a value of the
wrong type or range, every mutant run through `strata generate` on its own. A mutant misbehaves when
the run exits other than 0 or 2, hangs, prints a traceback, or refuses in more than one line. Never from
CI (about 20 minutes on 2 cores for the 987 config mutants, 4 for the 194 GGUF ones).

    python tools/fuzz_model_files.py config|gguf [--out results.tsv] [--only NAME ...]

Prints a count by outcome and the misbehaving mutants; --out keeps a line per mutant."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

root = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(root / "src"), str(root / "tests")]

VALUES = {"del": None, "null": None, "str": "x", "neg": -1, "zero": 0, "float": 2.5, "huge": 10 ** 12, "list": [],
          "dict": {}, "true": True, "nan": float("nan"), "inf": float("inf")}
CONFIG_EDITS = {"eos_oob": ("eos_token_id", 10 ** 6), "eos_strs": ("eos_token_id", ["a"]),
                "bos_oob": ("bos_token_id", -5), "kv_gt": ("num_key_value_heads", 8),
                "kv_nodiv": ("num_key_value_heads", 3), "hd_odd": ("head_dim", 15), "dtype_f8": ("torch_dtype", "float8"),
                "vocab_small": ("vocab_size", 100), "layers_more": ("num_hidden_layers", 5),
                "layers_less": ("num_hidden_layers", 1), "hidden_other": ("hidden_size", 128),
                "rope_bad": ("rope_scaling", {"rope_type": "yarn"}), "rope_str": ("rope_scaling", "x"),
                "rope_params_bad": ("rope_parameters", {"rope_type": "default", "rope_theta": "x"}),
                "rope_params_list": ("rope_parameters", [1]), "maxpos_small": ("max_position_embeddings", 3)}


def config_mutants(work: Path):
    """(name, folder-maker, generate args) for every config.json mutant."""
    from conftest import write_hf_model

    for family in ("qwen3", "llama", "qwen3_moe"):
        base = work / f"base-{family}"
        write_hf_model(base, family, seed=1)
        cfg = json.loads((base / "config.json").read_text())
        edits = [(key, v, VALUES[v]) for key in cfg
                 for v in (["del", "str", "list"] if key in ("architectures", "transformers_version", "model_type")
                           else VALUES)]
        edits += [(key, name, value) for name, (key, value) in CONFIG_EDITS.items()]
        for key, v, value in edits:
            def make(out, base=base, key=key, v=v, value=value):
                shutil.copytree(base, out)
                data = json.loads((out / "config.json").read_text())
                if v == "del":
                    data.pop(key, None)
                else:
                    data[key] = value
                (out / "config.json").write_text(json.dumps(data))
            yield f"{family}.{key}.{v}", make, ["--prompt-ids", "1,2,3"]


def gguf_mutants(work: Path):
    """(name, file-maker, generate args) for every GGUF metadata mutant."""
    import gguf

    from conftest import write_hf_model
    from test_gguf_target import qwen2_tokenizer, write_gguf_target

    V = gguf.GGUFValueType
    hf = work / "hf"
    write_hf_model(hf, "qwen3", seed=9, vocab=320, hidden_size=256, intermediate_size=256, head_dim=64, layers=2)
    qwen2_tokenizer(hf, 320)
    base = work / "base.gguf"
    write_gguf_target(base, hf, "qwen3", gguf.GGMLQuantizationType.Q8_0)
    values = {"del": None, "str": ("x", V.STRING, None), "zero": (0, V.UINT32, None), "neg": (-1, V.INT32, None),
              "big": (2 ** 32 - 1, V.UINT32, None), "u64": (2 ** 40, V.UINT64, None), "f": (2.5, V.FLOAT32, None),
              "nan": (float("nan"), V.FLOAT32, None), "true": (True, V.BOOL, None), "arr": ([1, 2], V.ARRAY, V.INT32),
              "sarr": (["a"], V.ARRAY, V.STRING)}
    keys = [k for k in gguf.GGUFReader(str(base)).fields if not k.startswith("GGUF.")]
    edits = [(k, v) for k in keys for v in values] + [
        ("tokenizer.ggml.add_bos_token", "true"), ("tokenizer.ggml.add_eos_token", "true"),
        ("tokenizer.ggml.eot_token_id", "big"), ("tokenizer.ggml.fim_pad_token_id", "str"),
        ("tokenizer.ggml.eom_token_id", "zero"), ("tokenizer.ggml.pre", "str"), ("tokenizer.ggml.add_space_prefix", "zero")]
    real = gguf.GGUFWriter.write_header_to_file
    for key, v in edits:
        def make(out, key=key, v=v):
            def with_edit(self, *a, **k):
                self.kv_data[0].pop(key, None)
                if values[v] is not None:
                    value, vtype, sub = values[v]
                    self.add_key_value(key, value, vtype, sub_type=sub)
                return real(self, *a, **k)
            gguf.GGUFWriter.write_header_to_file = with_edit
            try:
                write_gguf_target(out, hf, "qwen3", gguf.GGMLQuantizationType.Q8_0)
            finally:
                gguf.GGUFWriter.write_header_to_file = real
        yield f"{key}.{v}", make, ["--prompt", "def f(x):"]


def outcome(path: Path, args: list[str]) -> tuple[str, bool, str]:
    """(exit code or 'hang', whether it misbehaved, the last line it printed on stderr)."""
    try:
        r = subprocess.run([sys.executable, "-m", "strata.cli", "generate", "--model", str(path), *args,
                            "--max-new-tokens", "4"], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "PYTHONPATH": str(root / "src")})
        rc, err = str(r.returncode), r.stderr.strip()
    except subprocess.TimeoutExpired:
        rc, err = "hang", ""
    lines = [ln for ln in err.splitlines() if not ln.startswith(("prompt ", "experts", "  "))]  # info lines
    return rc, rc not in ("0", "2") or "Traceback" in err or (rc == "2" and len(lines) > 1), lines[-1] if lines else ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kind", choices=("config", "gguf"))
    ap.add_argument("--out")
    ap.add_argument("--only", nargs="*")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="strata-fuzz-"))
    mutants = [m for m in (config_mutants if args.kind == "config" else gguf_mutants)(work)
               if not args.only or m[0] in args.only]

    making = threading.Lock()

    def run(mutant):
        name, make, gen_args = mutant
        out = work / (name + (".gguf" if args.kind == "gguf" else ""))
        try:
            with making:  # the GGUF mutants patch gguf's writer while they write
                make(out)
        except Exception as e:  # noqa: BLE001 - a value gguf's writer itself refuses: not a mutant
            return name, "unwritable", False, str(e)
        result = outcome(out, gen_args)
        shutil.rmtree(out) if out.is_dir() else out.unlink()
        return (name, *result)

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(run, mutants))
    shutil.rmtree(work, ignore_errors=True)
    if args.out:
        Path(args.out).write_text("".join(f"{n}\t{rc}\t{'BAD' if bad else 'ok'}\t{line}\n" for n, rc, bad, line in results))
    print("outcomes:", dict(Counter(rc for _, rc, _, _ in results)))
    bad = [(n, rc, line) for n, rc, b, line in results if b]
    for n, rc, line in bad:
        print(f"misbehaves: {n} exit {rc}: {line}")
    print(f"{len(bad)} of {len(results)} mutants misbehave")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
