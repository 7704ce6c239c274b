"""Output files: checked before any work starts, written atomically, with the user's umask."""

from __future__ import annotations

import json
import os
from pathlib import Path

from .errors import StrataError


def check_output(path: str | Path, folder: bool = False, what: str = "") -> Path:
    """An output path that can be written: its parent folder exists and is writable, and the path is not
    the other kind of thing. `what` names the option in the message."""
    out = Path(path)
    where = f"{what} {out}" if what else str(out)
    if not out.parent.is_dir():
        raise StrataError(f"{where}: the folder {out.parent} does not exist")
    if folder and out.exists() and not out.is_dir():
        raise StrataError(f"{where}: exists and is a file (expected a folder to write)")
    if not folder and out.is_dir():
        raise StrataError(f"{where}: is a folder (expected a file name to write)")
    if not os.access(out.parent, os.W_OK) or (out.exists() and not os.access(out, os.W_OK)):
        raise StrataError(f"{where}: cannot write there (permission denied)")
    return out


def umask_mode(path: Path) -> None:
    """Give a file the permissions a plain open() would (some writers create files 0600)."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def write_json_atomic(path: Path, data) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)
