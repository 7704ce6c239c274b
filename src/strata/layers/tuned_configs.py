"""The autotuners' choices kept between processes, so that a restarted server or a second bench on the same
GPU does not tune again: the quantized kernels' block shapes are measured at first use, and for an 8B
Q4_K_M target that took 88 s for the decode step and 335 s more for a 16-row verify on the H200.

One JSON file per device name and Triton version (in $STRATA_CACHE_DIR, else ~/.cache/strata), holding for
each autotuned kernel its choices as (autotune key, index in its configuration list). Choices are kept only
while the kernels' source file and the kernel's configuration list are what they were when measured;
anything unreadable is ignored (the kernels tune again). STRATA_AUTOTUNE_CACHE=0 turns it off."""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

_SAVED: dict[str, int] = {}  # file -> choices written there by this process


def enabled() -> bool:
    return os.environ.get("STRATA_AUTOTUNE_CACHE", "1") != "0"


def cache_file(device_name: str, triton_version: str) -> Path:
    root = Path(os.environ.get("STRATA_CACHE_DIR") or Path.home() / ".cache" / "strata")
    return root / f"autotune-{re.sub(r'[^A-Za-z0-9_.-]+', '_', device_name)}-triton{triton_version}.json"


def _identity(tuner, source: str) -> str:
    """What a choice is valid for: the kernels' source and the tuner's configuration list."""
    configs = "\n".join(str(c) for c in tuner.configs)
    return hashlib.sha256(f"{source}\n{configs}".encode()).hexdigest()


def restore(tuners: dict, path: Path, source: str) -> int:
    """Put the file's choices into the tuners ({name: triton Autotuner}) that still match; how many."""
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return 0
    restored = 0
    for name, tuner in tuners.items():
        entry = saved.get(name) if isinstance(saved, dict) else None
        if not isinstance(entry, dict) or entry.get("id") != _identity(tuner, source):
            continue
        for choice in entry.get("choices") or []:
            try:
                key, index = choice
                tuner.cache[tuple(key)] = tuner.configs[index]
                restored += 1
            except (TypeError, ValueError, IndexError):
                continue
    _SAVED[str(path)] = _count(tuners)
    return restored


def _count(tuners: dict) -> int:
    return sum(len(t.cache) for t in tuners.values())


def save(tuners: dict, path: Path, source: str) -> bool:
    """Write the tuners' choices (with what the file holds for other kernels), if any are new since this
    process last read or wrote the file; written whole or not at all. Whether it wrote."""
    if _count(tuners) == _SAVED.get(str(path), 0):
        return False
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
        saved = saved if isinstance(saved, dict) else {}
    except (OSError, ValueError):
        saved = {}
    for name, tuner in tuners.items():
        index = {id(c): i for i, c in enumerate(tuner.configs)}
        choices = [[list(key), index[id(config)]] for key, config in tuner.cache.items() if id(config) in index]
        if choices:
            saved[name] = {"id": _identity(tuner, source), "choices": choices}
    try:
        text = json.dumps(saved)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except (OSError, TypeError, ValueError):  # a read-only home, a key JSON cannot hold: the next run tunes again
        return False
    _SAVED[str(path)] = _count(tuners)
    return True
