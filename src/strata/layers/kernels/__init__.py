"""Strata's kernels: the strategy modules call (strategy.py: eager ops, torch.compile'd groups, or Triton
kernels where their shapes allow) and the kernels under it. Host modules (dense, attention, norms,
quantized, x8, delta, fla) import their Triton code (the jit_* modules) only when a kernel is first
launched, so that a CPU run needs no Triton and the tests' TRITON_INTERPRET=1 reaches every kernel;
qtypes keys the GGUF block types by gguf's own enum, tuning holds the block shapes and limits, options
the switches (KernelOptions)."""

from .options import KernelOptions
from .strategy import ATTENTION_KINDS, EAGER, GROUPS, Activation, Kernels, TritonKernels, select_kernels, unwrap

__all__ = ["ATTENTION_KINDS", "EAGER", "GROUPS", "Activation", "KernelOptions", "Kernels", "TritonKernels",
           "select_kernels", "unwrap"]
