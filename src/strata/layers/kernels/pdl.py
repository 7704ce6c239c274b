"""Programmatic dependent launch (PDL, Hopper and later) for the decode step's kernels.

A batch-1 step is hundreds of short kernels, and between two of them the GPU idles while one kernel's
last programs drain and the next is launched. Launched with PDL, a kernel is launched while the one
before it drains; its programs wait (jit_common.settle: griddepcontrol.wait) until every kernel before
them has finished and its writes are visible, before they read or write anything, and only then let the
kernel after them launch, so at most one kernel waits ahead. torch.compile's kernels get the same from
inductor's own flag. Kernels launched without PDL are ordered as usual; the interpreter and older GPUs run
the same kernels with the flag off. STRATA_PDL=0 turns it off (A/B runs); inductor's flag holds for the
process from the first compiled kernel set on."""

from __future__ import annotations

import functools
import os

import torch

from .common import interpreting


def enabled(device) -> bool:
    """Kernels on this device launch with PDL."""
    if interpreting() or os.environ.get("STRATA_PDL", "1") == "0":
        return False
    device = torch.device(device)
    return device.type == "cuda" and _hopper(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _hopper(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def options(device) -> dict:
    """A Triton kernel launch's keyword arguments: its PDL constexpr, and Triton's launch flag when set."""
    return {"PDL": True, "launch_pdl": True} if enabled(device) else {"PDL": False}


def compiled(device) -> None:
    """torch.compile's kernels launch with PDL too (inductor's flag, where this torch has it)."""
    import torch._inductor.config as inductor

    if enabled(device) and hasattr(inductor.triton, "enable_pdl"):
        inductor.triton.enable_pdl = True
