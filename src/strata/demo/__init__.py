"""The embedded demo pair: a small Qwen3-architecture code model trained on the Python standard
library (tools/make_demo.py) and a DFlash2 drafter trained for it (block size 8). They are the
default of every command when no --model is given, so Strata runs offline out of the box. The DFlash
drafter the DFlash2 one was trained from ships beside it (DFLASH_DRAFTER, `--dflash` takes its path)."""

from pathlib import Path

HERE = Path(__file__).resolve().parent
TARGET = HERE / "target"
DRAFTER = HERE / "drafter.gguf"
DFLASH_DRAFTER = HERE / "drafter-dflash.gguf"
EVAL_PROMPTS = HERE / "eval_prompts.json"


def available() -> bool:
    return (TARGET / "model.safetensors").is_file() and DRAFTER.is_file()
