"""The switches of Strata's kernels as one frozen value: an engine takes it from its EngineConfig, an A/B run
builds a second one, a test passes its own. The defaults are the settings measured best (docs/
QUANTIZED-KERNELS.md, "Settings and their measurements")."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KernelOptions:
    #: the small kernels of a layer read before their PDL wait what no kernel of the layer writes (weights,
    #: cos/sin, a chunk's first K/V rows into L2)
    pre_wait_loads: bool = True
    #: rows up to which the norms run on rms_norm_kernel (0: never)
    norm_max_rows: int = 64
    #: columns of a row each rms_norm program writes and quantizes (a power of two; 0: the whole row)
    norm_chunk: int = 512
    #: rows up to which a norm whose output goes into an int8-x product quantizes it itself (0: never)
    quantize_rows: int = 16
    #: query rows up to which attention quantizes its output for an int8-x o projection (0: never)
    attention_quantize_rows: int = 16
    #: a row's experts summed by their down GEMVs, not by a launch of its own after them
    expert_down_sums: bool = True
    #: quantized experts on the word GEMVs (int8 x) where their type has one, else on the byte kernel
    expert_word_gemvs: bool = True
    #: 1-row word GEMV programs whose rows start within this many bytes of W ask them into L2 before their
    #: PDL wait (0: none)
    gemv_prefetch: int = 2 ** 21
    #: the gate/up word GEMMs at blocks of this many rows stack gate and up rows into one tile (0: none)
    glu_stack_rows: int = 32
    #: a product of at least this many rows over segments of several types runs the segments after the
    #: first on a second stream (0: none)
    segments_side_by_side: int = 1
