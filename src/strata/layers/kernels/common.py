"""What the kernel modules' host code shares: whether Triton kernels can run, block-shape arithmetic, dot
precision, and Triton's autotune cache."""

from __future__ import annotations

import inspect
import os

import torch


def available(device) -> bool:
    """Triton kernels can run on this device's tensors (a CUDA GPU, or the interpreter)."""
    if torch.device(device).type != "cuda" and not interpreting():
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    """Triton's interpreter runs the kernels (TRITON_INTERPRET=1: the CPU tests)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def pow2(n: int) -> int:
    """The smallest power of two >= n (>= 1): Triton's block shapes."""
    return 1 << max(n - 1, 0).bit_length()


def precision(x: torch.Tensor) -> str:
    """float32 models keep full-precision dots (Triton's default would round their inputs to TF32)."""
    return "ieee" if x.dtype == torch.float32 else "tf32"


#: shared memory a program's pipelined tiles may take (an H200 block can have 227 KiB)
SHARED_BYTES = 200 << 10


def fitting_stages(stages: int, stage_bytes: int) -> int:
    """Pipeline stages whose tiles fit SHARED_BYTES, Triton buffering stages - 1 of them: float32 dots (full
    precision) stage both operands, stage_bytes a step (the default skinny tiles took 245760 bytes at 4
    stages, 442368 with gate/up, compiled for sm_90); 16-bit ones far less, so they keep theirs."""
    return max(2, min(stages, 1 + SHARED_BYTES // stage_bytes))


def disk_cache(triton) -> dict:
    """triton.autotune's keywords that keep its measurements in Triton's cache directory (~/.triton/cache,
    $TRITON_CACHE_DIR; Triton 3.4 and later), keyed by the kernel's source and its helpers', the tuning key
    and the configuration list: a restarted server on the same GPU chooses without measuring again (an 8B
    Q4_K_M target's decode and verify shapes take minutes to tune)."""
    return {"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters else {}
