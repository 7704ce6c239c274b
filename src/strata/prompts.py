"""Prompt sets for the tools (parity, taps, gate): ids given on the command line, a prompts file, the
demo's held-out prompts, or a default set."""

from __future__ import annotations

import json
from pathlib import Path

from .errors import StrataError

DEFAULT_PROMPTS = [
    "def quicksort(arr):",
    "import os\n\ndef list_python_files(root):",
    "class Stack:\n    def __init__(self):",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"",
]


def parse_ids(text: str, what: str) -> list[int]:
    parts = text.replace(" ", "").split(",")
    if parts[-1] == "":  # a trailing comma
        parts.pop()
    try:
        if "" in parts:
            raise ValueError
        return [int(x) for x in parts]
    except ValueError:
        raise StrataError(f"{what}: expected comma-separated integers, got {text!r}") from None


def read_prompts_file(path: str) -> list[str]:
    """A .json file holds a list of strings; any other file holds one prompt per line."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise StrataError(f"--prompts {path}: {e.strerror}") from None
    if path.endswith(".json"):
        try:
            prompts = json.loads(text)
        except json.JSONDecodeError as e:
            raise StrataError(f"--prompts {path}: not valid JSON ({e})") from None
        if not isinstance(prompts, list) or not all(isinstance(p, str) and p for p in prompts) or not prompts:
            raise StrataError(f"--prompts {path}: expected a non-empty JSON list of non-empty strings")
        return prompts
    prompts = [ln for ln in text.splitlines() if ln.strip()]
    if not prompts:
        raise StrataError(f"--prompts {path}: no prompts in the file")
    return prompts


def prompt_set(pair, prompt_ids: list[str] | None, prompts_file: str | None) -> list[list[int]]:
    """--prompt-ids (repeatable) / --prompts FILE / the demo's held-out prompts / a default text set /
    (no tokenizer) three random prompts."""
    if prompt_ids:
        return [parse_ids(p, "--prompt-ids") for p in prompt_ids]
    texts = read_prompts_file(prompts_file) if prompts_file else None
    if texts is None and pair.using_demo:
        from . import demo

        texts = read_prompts_file(str(demo.EVAL_PROMPTS))
    if texts is None and pair.tokenizer is not None:
        texts = DEFAULT_PROMPTS
    if texts is not None:
        tokenizer = pair.text_tokenizer()
        return [tokenizer.encode_prompt(t) for t in texts]
    import torch

    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, pair.target.cfg.vocab_size, (n,), generator=gen).tolist() for n in (1, 7, 60)]
