"""The gated delta rule on the GPU through fla-core (flash-linear-attention's Triton kernels): the fused
recurrent kernel for decode, verify and a rollback's replay (its variable-length mode takes the rows to
replay as a device tensor, so no host read and a CUDA graph can hold it), the chunked kernel for prefill.
Same contract as ops.gated_delta_rule (the reference and the CPU path); with TRITON_INTERPRET=1 the tests
run these very kernels on the CPU."""

from __future__ import annotations

import functools
import os
import sys

import torch

#: prefill chunks longer than this take fla's chunked kernel (its setup costs more than a few rows' loop)
CHUNKED_MIN_ROWS = 64


@functools.cache
def _ops():
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except Exception:  # noqa: BLE001 - any import failure (no fla-core, no Triton) leaves the torch path
        return None
    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule


def available(device: torch.device) -> bool:
    """fla-core's kernels can run on this device's tensors (a CUDA GPU, or Triton's interpreter)."""
    if torch.device(device).type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    return _ops() is not None


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor, rows: torch.Tensor | None = None, chunked: bool = False,
                     tiled: bool = False):
    """ops.gated_delta_rule's arguments and results; outputs in v's dtype. chunked: the chunked kernel
    (prefill; its state after the rows, not bit-identical to the recurrent kernel's). fla's kernels serve
    key heads in a row, so tiled ones are repeated to the value heads first."""
    from ..ops import value_heads

    chunk, recurrent = _ops()
    if tiled:
        q, k = value_heads(q, v.shape[1], True), value_heads(k, v.shape[1], True)
    kwargs = dict(g=g[None].float(), beta=beta[None].float(), initial_state=state[None].float(),
                  output_final_state=True, use_qk_l2norm_in_kernel=True)
    if rows is not None:
        kwargs["cu_seqlens"] = torch.cat([torch.zeros(1, dtype=torch.long, device=q.device), rows.view(1).long()])
    run = chunk if chunked and rows is None else recurrent
    out, final = run(q[None].contiguous(), k[None].contiguous(), v[None].contiguous(), **kwargs)
    return out[0], final[0]


def transformers_in_torch() -> None:
    """transformers' hybrids (Qwen3.5, Qwen3-Next) pick fla-core's kernels whenever it is installed, and
    those cannot run on a CPU: a CPU reference imports their modules while fla-core is hidden, so they keep
    their torch code. No effect on modules transformers already imported."""
    saved = {name: sys.modules.pop(name) for name in list(sys.modules) if name == "fla" or name.startswith("fla.")}
    sys.modules["fla"] = None  # an import of it raises ImportError
    try:
        for name in ("qwen3_5", "qwen3_5_moe", "qwen3_next"):
            try:
                __import__(f"transformers.models.{name}.modeling_{name}")
            except ImportError:
                pass
    finally:
        del sys.modules["fla"]
        sys.modules.update(saved)
