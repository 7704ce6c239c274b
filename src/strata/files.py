"""Output files: checked before any work starts, written atomically, with the user's umask.

An output is written to a temporary file beside it and renamed into place, so the path must be a
regular file or a new name: a device, FIFO or socket there would be replaced by a regular file, and is
refused; a symbolic link is written through (its target is replaced, the link stays). An output is
never one of the command's own inputs, compared by inode, so hard links and other spellings of the
same file are caught too."""

from __future__ import annotations

import contextlib
import json
import os
import stat
import tempfile
from collections.abc import Iterable
from pathlib import Path

from .errors import StrataError

#: what a path holds, for the kinds an output must not replace
KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
         (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a folder"))


def kind_of(mode: int) -> str:
    return next((name for test, name in KINDS if test(mode)), "not a regular file")


def check_output(path: str | Path, folder: bool = False, what: str = "",
                 inputs: Iterable[str | Path | None] = ()) -> Path:
    """The path to write (a symbolic link's target), after checking that it can be written without
    destroying anything: the folder exists and a file can be created in it, the path is a regular file
    or a new name (a folder, new or existing, with folder=True), and it is none of `inputs` (files, or
    folders whose files the command reads). `what` names the option in the messages."""
    given = Path(path)
    where = f"{what} {given}" if what else str(given)
    out = given
    if given.is_symlink():
        try:
            out = given.resolve(strict=False)
        except (OSError, RuntimeError) as e:
            raise StrataError(f"{where}: a symbolic link that does not resolve ({e})") from None
    try:
        st = out.stat()
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise StrataError(f"{where}: {e.strerror or e}") from None
    if st is not None and folder and not stat.S_ISDIR(st.st_mode):
        raise StrataError(f"{where}: exists and is {'a file' if stat.S_ISREG(st.st_mode) else kind_of(st.st_mode)} "
                          f"(expected a folder to write)")
    if st is not None and not folder and not stat.S_ISREG(st.st_mode):
        if stat.S_ISDIR(st.st_mode):
            raise StrataError(f"{where}: is a folder (expected a file name to write)")
        raise StrataError(f"{where}: is {kind_of(st.st_mode)}, which writing a file there would replace "
                          f"(expected a regular file or a new name)")
    if not out.parent.is_dir():
        raise StrataError(f"{where}: the folder {out.parent} does not exist")
    probe(out if st is not None and folder else out.parent, where)
    if st is not None and not os.access(out, os.W_OK):
        raise StrataError(f"{where}: cannot write there (permission denied)")
    clash = input_clash(st, folder, inputs)
    if clash:
        raise StrataError(f"{where}: {clash}; writing there would destroy it (choose another path)")
    return out


def probe(folder: Path, where: str) -> None:
    """A file can be created in folder and removed again (what the atomic write needs): refuses read-only
    and pseudo file systems (/proc, /sys) before the work, also for root, whom permission bits let pass."""
    try:
        fd, name = tempfile.mkstemp(dir=folder, prefix=".strata-probe-")
    except OSError as e:
        raise StrataError(f"{where}: cannot create a file in {folder} ({e.strerror or e})") from None
    os.close(fd)
    os.unlink(name)


def input_clash(st: os.stat_result | None, folder: bool, inputs) -> str | None:
    """Why an output of this stat would overwrite one of the inputs, or None: a file output that is an
    input file, or a file in an input folder (same inode); a folder output that is an input folder, or
    holds an input file."""
    if st is None:
        return None
    out = (st.st_dev, st.st_ino)
    for given in inputs:
        if given is None or str(given) == "-":
            continue
        p = Path(given)
        try:
            s = p.stat()
        except OSError:
            continue
        if stat.S_ISDIR(s.st_mode):
            if folder and (s.st_dev, s.st_ino) == out:
                return f"is an input folder of this command ({p})"
            if not folder:
                for entry in os.scandir(p):
                    with contextlib.suppress(OSError):
                        e = entry.stat()
                        if (e.st_dev, e.st_ino) == out:
                            return f"is an input of this command ({entry.path})"
        elif not folder and (s.st_dev, s.st_ino) == out:
            return f"is an input of this command ({p})"
        elif folder:
            parent = p.parent.stat()
            if (parent.st_dev, parent.st_ino) == out:
                return f"holds an input of this command ({p})"
    return None


def umask_mode(path: Path) -> None:
    """Give a file the permissions a plain open() would (some writers create files 0600)."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


@contextlib.contextmanager
def replacing(path: Path):
    """A temporary file beside path (same suffix) to write; renamed over path when the block succeeds,
    removed when it fails. Refuses a path that is no longer a regular file or a new name."""
    path = Path(path)
    with contextlib.suppress(FileNotFoundError):
        mode = path.stat().st_mode
        if not stat.S_ISREG(mode):
            raise StrataError(f"{path}: is {kind_of(mode)} now; not replaced")
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=path.suffix or ".tmp")
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        umask_mode(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_json_atomic(path: Path, data) -> None:
    with replacing(path) as tmp:
        tmp.write_text(json.dumps(data, indent=2))
