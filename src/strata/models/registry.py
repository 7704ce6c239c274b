"""Model families by architecture name. Adding an architecture is one file under models/ that defines
a Family, plus its module name in FAMILY_MODULES."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Callable, Protocol, runtime_checkable

from torch import nn

from ..errors import StrataError
from .config import ModelConfig

#: modules under strata.models that each register one or more families on import
FAMILY_MODULES = ("qwen3", "llama", "qwen3_moe", "qwen3_5")  # qwen3_5 also registers qwen3_5_moe, qwen3_next


@runtime_checkable
class Family(Protocol):
    """One architecture: how its Hugging Face config reads, which modules it builds, and where each of
    the checkpoint's tensors goes (the packing of q/k/v and gate/up into fused parameters included).
    decoder.DenseFamily implements it for the Llama lineage; register() refuses what does not, and a test
    checks every family's methods against these signatures."""

    name: str
    architectures: tuple[str, ...]  # config.json "architectures" entries
    model_types: tuple[str, ...]  # "model_type" values, for configs without architectures
    gguf_arch: str  # llama.cpp's general.architecture for this family's GGUF files ("": none)

    def config(self, hf: dict, where: Path) -> ModelConfig:
        """Hyper-parameters from a config.json."""

    def build(self, cfg: ModelConfig) -> nn.Module:
        """The model's modules (a DecoderLM), without weights."""

    def hf_layout(self, cfg: ModelConfig) -> dict[str, list[tuple[str, tuple]]]:
        """parameter name -> [(checkpoint tensor name, shape), ...], concatenated along dim 0 in order."""

    def finish(self, state: dict, cfg: ModelConfig) -> dict:
        """A Hugging Face checkpoint's packed parameters -> the values the modules compute with (a family
        whose checkpoint stores a norm as 1 + w, or rotates a head's dims in another order, converts here)."""

    def gguf_config(self, kv: dict, tensors: dict, where: str) -> ModelConfig:
        """Hyper-parameters from a llama.cpp GGUF file's metadata and tensor table."""

    def gguf_layout(self, cfg: ModelConfig) -> dict[str, list[tuple[str, tuple, Callable | None]]]:
        """As hf_layout, for llama.cpp's tensor names and shapes; the third field undoes what the converter
        did to the tensor's rows (a function of its rows, float or quantized blocks alike: a reordering
        or a selection of them; of the values, for a vector), or None."""


_FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    if not isinstance(family, Family):
        raise TypeError(f"{family!r} does not implement models.registry.Family")
    _FAMILIES[family.name] = family
    return family


def families() -> dict[str, Family]:
    for module in FAMILY_MODULES:
        importlib.import_module(f"{__package__}.{module}")
    return _FAMILIES


def family(name: str) -> Family:
    return families()[name]


def family_for_gguf(arch, where) -> Family:
    found = next((f for f in families().values() if f.gguf_arch and f.gguf_arch == arch), None)
    if found is None:
        supported = [f.gguf_arch for f in families().values() if f.gguf_arch]
        raise StrataError(f"{where}: general.architecture {arch!r} is not supported; supported: {', '.join(supported)}")
    return found


def family_for(hf: dict, where: Path) -> Family:
    """The family of a config.json: by its architectures, else (none listed) by its model_type."""
    archs = hf.get("architectures") or []
    fams = families().values()
    found = next((f for a in archs for f in fams if a in f.architectures), None)
    if found is None and not archs:
        found = next((f for f in fams if hf.get("model_type") in f.model_types), None)
    if found is None:
        supported = [a for f in fams for a in f.architectures]
        raise StrataError(f"{where}: unknown architecture {archs or hf.get('model_type')!r}; "
                          f"supported: {', '.join(supported)}")
    return found
