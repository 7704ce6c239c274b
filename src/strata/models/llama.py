"""Llama (2, 3, 3.1+): no q/k norms, optional attention biases, Llama 3's RoPE frequency rescaling."""

from .decoder import DenseFamily
from .registry import register


class Llama(DenseFamily):
    name = "llama"
    architectures = ("LlamaForCausalLM",)
    model_types = ("llama",)
    gguf_arch = "llama"
    gguf_qk_permuted = True  # llama.cpp's converter interleaves each head's q/k rows for its own RoPE
    gguf_rope_factors = True  # Llama 3.1+


register(Llama())
