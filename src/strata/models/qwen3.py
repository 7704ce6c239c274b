"""Qwen3 (dense): a Llama-lineage decoder with per-head RMSNorm on q and k."""

from .decoder import DenseFamily
from .registry import register


class Qwen3(DenseFamily):
    name = "qwen3"
    architectures = ("Qwen3ForCausalLM",)
    model_types = ("qwen3",)
    gguf_arch = "qwen3"
    qk_norm = True


register(Qwen3())
