"""The CPU's products over GGUF blocks (host_blocks.c): experts an expert cache keeps in host memory run there in
their blocks, reading a quarter to a half of the bytes their bfloat16 values would, as llama.cpp's -ncmoe does.

The C source is compiled once per machine with the system's C compiler (the one Triton's launchers need too),
for this CPU (-march=native), without fused multiply-adds in the decoding so that a row decodes exactly as
gguf.quants.dequantize decodes it. Without a compiler, `library()` is None and the experts are kept as values."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import itertools
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from .qtypes import BLOCKS, KERNEL_TYPES, table

SOURCE = Path(__file__).with_name("host_blocks.c")
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-shared", "-fPIC")
I64, PTR = ctypes.c_int64, ctypes.c_void_p


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "strata" / "host_blocks"


def _cpu_key() -> str:
    """What -march=native depends on: the machine and its CPU's feature flags."""
    flags = ""
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")),
                     "")
    except OSError:
        pass
    return platform.machine() + flags


def _compile(source: bytes, out: Path) -> bool:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return False
    out.parent.mkdir(parents=True, exist_ok=True)
    for extra in (("-fopenmp",), ()):  # without OpenMP the products run on one thread
        with tempfile.TemporaryDirectory() as tmp:
            src, lib = Path(tmp) / "host_blocks.c", Path(tmp) / "host_blocks.so"
            src.write_bytes(source)
            done = subprocess.run([compiler, *FLAGS, *extra, "-o", str(lib), str(src), "-lm"],
                                  capture_output=True)
            if done.returncode == 0:
                os.replace(shutil.copy(lib, out.with_suffix(".tmp")), out)
                return True
    return False


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels (built at the first call, then found in cache_dir()), or None without a C compiler."""
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join(FLAGS).encode() + _cpu_key().encode()).hexdigest()[:16]
    path = cache_dir() / f"host_blocks-{key}.so"
    if not path.exists() and not _compile(source, path):
        return None
    lib = ctypes.CDLL(str(path))
    lib.strata_dequantize.argtypes = [ctypes.c_int, PTR, I64, I64, I64, PTR, PTR]
    lib.strata_expert_pairs.argtypes = [I64, PTR, PTR, PTR, PTR, I64, I64,
                                        ctypes.c_int, PTR, I64, I64, PTR, ctypes.c_int, PTR, I64, I64, PTR,
                                        PTR, PTR, ctypes.c_int]
    return lib


def takes(qtype: int) -> bool:
    """Whether host experts of this type run in their blocks here."""
    return qtype in KERNEL_TYPES and library() is not None


def dequantize(data: torch.Tensor, qtype: int, cols: int) -> torch.Tensor:
    """A [rows, row_bytes] uint8 matrix of blocks on the CPU -> float32 [rows, cols], decoded as the experts'
    products decode it."""
    block, size = BLOCKS[qtype]
    assert data.dtype == torch.uint8 and data.shape[1] == cols // block * size and cols % 256 == 0
    data = data.contiguous()
    out = torch.empty(data.shape[0], cols, dtype=torch.float32)
    library().strata_dequantize(int(qtype), data.data_ptr(), data.shape[0], data.shape[1], cols,
                                table(torch.device("cpu"), qtype).data_ptr(), out.data_ptr())
    return out


def expert_pairs(x: torch.Tensor, groups: list[tuple[int, list[int]]], gate_up, down,
                 threads: int | None = None) -> torch.Tensor:
    """SwiGLU experts over their rows: x [N, H] (the layer's rows on the CPU), groups [(expert, its rows of
    x)], gate_up / down the host's QuantExperts ([E, 2I, H], [E, H, I]) -> [pairs, H] float32, the pairs
    in the groups' order."""
    lib = library()
    x = x.to(torch.float32).contiguous()
    experts = torch.tensor([e for e, _ in groups], dtype=torch.int64)
    start = torch.tensor([0, *itertools.accumulate(len(r) for _, r in groups)], dtype=torch.int64)
    rows = torch.tensor([r for _, rs in groups for r in rs], dtype=torch.int64)
    hidden, inter = x.shape[1], down.cols
    act = torch.empty(len(rows), 2 * inter, dtype=torch.float32)
    y = torch.empty(len(rows), hidden, dtype=torch.float32)
    gu, dn = gate_up.data, down.data
    assert gu.is_contiguous() and dn.is_contiguous() and gate_up.cols == hidden
    cpu = torch.device("cpu")
    lib.strata_expert_pairs(len(groups), experts.data_ptr(), start.data_ptr(), rows.data_ptr(), x.data_ptr(),
                            hidden, inter,
                            int(gate_up.qtype), gu.data_ptr(), gu.stride(0), gu.stride(1),
                            table(cpu, gate_up.qtype).data_ptr(),
                            int(down.qtype), dn.data_ptr(), dn.stride(0), dn.stride(1),
                            table(cpu, down.qtype).data_ptr(),
                            act.data_ptr(), y.data_ptr(), threads or torch.get_num_threads())
    return y
