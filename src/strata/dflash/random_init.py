"""Random drafters for benchmarks: a drafter of a variant and size without training, in BF16 or in the blocks
`convert-dflash --type` would store, so that a draft pass can be timed on any target shape."""

from __future__ import annotations

import gguf
import torch

from ..models.loader import unpack
from .contract import Artifact, hf_to_gguf_name
from .drafter import DFlashDrafter
from .gguf_format import FILE_TYPES, storage, stored
from .model import hf_layout
from .train import TrainConfig, drafter_config_for, init_drafter


def as_stored(art: Artifact, file_type: str) -> Artifact:
    """The artifact as a GGUF of this file type loads: each tensor's stored values, and the matrices that go into
    quantized blocks kept as those blocks (what read_gguf gives for convert-dflash --type's file)."""
    if file_type not in FILE_TYPES:
        raise ValueError(f"file type {file_type!r}, expected one of {', '.join(FILE_TYPES)}")
    tensors, types, blocks = {}, {}, {}
    for name, t in art.tensors.items():
        gguf_name = hf_to_gguf_name(name)
        arr, kind = storage(t, gguf_name, file_type)
        tensors[name], types[name] = stored(t, gguf_name, file_type), kind.name
        if kind not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16,
                        gguf.GGMLQuantizationType.BF16):
            blocks[name] = (int(kind), torch.from_numpy(arr.reshape(t.shape[0], -1)))
    return Artifact(art.cfg, tensors, art.source, art.fmt, types=types, vocab=art.vocab, blocks=blocks)


def random_drafter(target, layers: int, block_size: int, seed: int = 0, variant: str = "dflash",
                   file_type: str = "BF16") -> DFlashDrafter:
    """Random weights of a drafter of this variant (DFlash2's and DSpark's additions as training starts them; the
    selector's top-k as large as llama.cpp allows up to 8: k (k + 1) <= hidden), stored as a GGUF of file_type
    stores them (BF16, or Q8_0 blocks that a GPU keeps)."""
    top_k = max(k for k in range(1, 9) if k * (k + 1) <= target.cfg.hidden_size)
    cfg = drafter_config_for(target, TrainConfig(layers=layers, block_size=block_size, variant=variant,
                                                 selector_top_k=top_k))
    model = init_drafter(cfg, seed, "cpu")
    tensors = {k: v.detach() for k, v in unpack(model.state_dict(), hf_layout(cfg)).items()}
    art = as_stored(Artifact(cfg, tensors, "<random drafter>", "random"), file_type)
    return DFlashDrafter(art, target, max_len=target.cfg.max_position_embeddings)
