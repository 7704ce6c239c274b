"""The GGUF block types Strata's kernels take, as gguf defines them (GGMLQuantizationType, GGML_QUANT_SIZES),
and what the host code checks a matrix of blocks by."""

from __future__ import annotations

import functools

import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf.quants import IQ2_XXS, IQ3_XXS as IQ3_XXS_REFERENCE, IQ4_NL

Q4_0, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_XS = T.Q4_0, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_XS
Q3_K, IQ3_XXS = T.Q3_K, T.IQ3_XXS
#: the types the device kernels take (Q3_K and IQ3_XXS only on the float-tile kernels); other GGUF types are
#: dequantized at load
KERNEL_TYPES = (Q4_0, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_XS, Q3_K, IQ3_XXS)
#: (weights per block, bytes per block) of each, as gguf gives them
BLOCKS = {t: GGML_QUANT_SIZES[t] for t in KERNEL_TYPES}
#: IQ4_XS's 16 non-linear levels (IQ4_NL's, as gguf's reference decodes them)
IQ4_VALUES = tuple(int(v) for v in IQ4_NL.kvalues)
#: IQ4_VALUES as int8, 4 to a little-endian int32 (the word kernels' byte-permute table)
IQ4_WORDS = tuple(int.from_bytes(bytes(v & 0xFF for v in IQ4_VALUES[i:i + 4]), "little", signed=True)
                  for i in range(0, 16, 4))
TILE = 256  # columns a kernel step covers: one superblock, or 8 blocks of 32
#: byte offsets of each type's float16 fields in its block (d, dmin: the only values of a block that can be
#: NaN or inf, its quants being integers), and their values in random blocks: weights of about the size of
#: a N(0, 0.02) initialisation
HALF_FIELDS = {Q8_0: ([0], 3e-4), Q4_0: ([0], 5e-3), Q4_K: ([0, 2], 1e-4), Q5_K: ([0, 2], 5e-5), Q6_K: ([208], 2e-5),
               IQ4_XS: ([0], 2e-5), Q3_K: ([108], 6e-4), IQ3_XXS: ([0], 2e-4)}


def iq3_table() -> bytes:
    """IQ3_XXS's grid (256 entries of 4 values, a byte each) then its 128 sign patterns, as gguf decodes them."""
    IQ3_XXS_REFERENCE.init_grid()
    return IQ3_XXS_REFERENCE.grid.reshape(-1).astype("uint8").tobytes() + IQ2_XXS.ksigns


@functools.cache
def table(device: torch.device, qtype: int = IQ4_XS) -> torch.Tensor:
    """The float-tile kernels' tab_ptr for a type: IQ3_XXS's grid and signs (iq3_table), else IQ4_XS's levels
    (the types without a table ignore it)."""
    if qtype == IQ3_XXS:
        return torch.frombuffer(bytearray(iq3_table()), dtype=torch.uint8).to(device)
    return torch.tensor(IQ4_VALUES, dtype=torch.int8, device=device)


def check(data: torch.Tensor, qtype: int, cols: int) -> None:
    """The kernels read whole 256-column tiles of whole blocks: anything else would read past a row."""
    block, size = BLOCKS[qtype]
    assert cols % TILE == 0 and data.dtype == torch.uint8 and data.dim() == 2, (qtype, cols, data.shape)
    assert data.shape[1] == cols // block * size and data.stride(1) == 1, (qtype, cols, data.shape)
