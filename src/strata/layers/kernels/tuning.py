"""The kernels' block shapes and size limits: each the value chosen, with one line of why; the measurements
behind them are in docs/QUANTIZED-KERNELS.md ("Settings and their measurements"). The device autotunes over
a list at first use (the runner's warm-up); the interpreter takes its first entry."""

from __future__ import annotations

from .common import cdiv

# -- the quantized products (quantized.py)
#: the byte GEMV's (rows of W a program, warps, 256-column tiles in flight); no 2-warp shape: on an H200
#: (Triton 3.6) 2 warps over 2+ rows gave wrong Q4_K products
GEMV_CONFIGS = [(2, 4, 4), (1, 4, 4), (2, 4, 8), (4, 4, 4), (4, 4, 8), (8, 4, 4), (8, 8, 4), (16, 8, 1)]
#: the byte few-row GEMM's (rows of W a program, warps, tiles in flight)
SKINNY_CONFIGS = [(32, 4, 2), (16, 4, 2), (32, 4, 4), (16, 4, 4), (64, 4, 2), (32, 8, 4), (64, 4, 1), (32, 4, 1)]
#: the lanes-along-K word GEMVs' (rows a thread takes, warps, steps loaded at once, warps sharing a row's
#: steps); (1, 4, 1, 2), the only row-sharing shape kept, wins Q8_0's 12288-column down
LANE_K_CONFIGS = [(4, 2, 1, 1), (2, 4, 1, 1), (1, 4, 1, 1), (4, 4, 1, 1), (2, 2, 1, 1), (1, 4, 2, 1), (2, 4, 2, 1),
                  (1, 2, 2, 1), (2, 2, 2, 1), (1, 4, 4, 1), (1, 2, 4, 1), (4, 2, 2, 1), (8, 2, 1, 1), (1, 4, 1, 2)]
#: the word GEMVs' tuning key (with, as Triton adds, their tensors' dtypes)
LANE_K_TUNE_KEY = ("N", "K", "GLU", "QTYPE", "EXPERTS")
#: the word GEMMs' (rows of W a program, warps, stages, K slices): a few rows over a small matrix make few
#: programs, and K slices multiply them; (64, 4, 3, *) won q/k/v, o and down on an H100, the last two are
#: the stacked gate/up GEMMs'
WORD_SKINNY_CONFIGS = [(64, 4, 2, 1), (64, 4, 2, 2), (64, 4, 2, 4), (64, 4, 2, 8), (32, 4, 2, 4), (128, 4, 2, 1),
                       (128, 4, 2, 4), (64, 4, 1, 1), (64, 4, 1, 4), (64, 4, 1, 8), (64, 2, 2, 1), (64, 2, 2, 4),
                       (32, 2, 2, 8), (128, 4, 1, 2), (64, 4, 3, 4), (64, 4, 3, 8), (64, 2, 3, 1),
                       (64, 4, 3, 1), (32, 4, 3, 1), (32, 4, 2, 1)]
SPLIT_PROGRAMS = 1024  # K slices only while the programs stay within this many (the workspace with them)
#: the columns of W a word GEMM's K loop takes a step: a superblock (Q4_K), two (Q6_K), 16 or 4 blocks (Q8_0)
GEMM_STEP_COLUMNS = {"skinny_q4k8": 256, "skinny_q6k8": 512, "skinny_q8_0w": 512, "skinny_q8_0": 128}
LANES = 2  # products that may run at once on a device (a stream and a second: KernelOptions.segments_side_by_side)


def loop_stages(word: str, stages: int) -> dict:
    """The STAGES of the word GEMMs but skinny_q8_0: their K loops pipelined over that many stages, every load
    in them included (Triton's pipeliner leaves a loop's scale and header loads synchronous without the
    attribute); skinny_q6k8 wants 2 (a stage of 64 rows takes 75 KB of shared memory)."""
    return {} if word == "skinny_q8_0" else {"STAGES": stages}


def split_fits(name: str, block_n: int, split: int, n: int, k: int) -> bool:
    steps = k // GEMM_STEP_COLUMNS[name]
    return split == 1 or (cdiv(n, block_n) * split <= SPLIT_PROGRAMS and split <= steps)


def prune_split(name: str, configs, named_args, **kwargs):
    return [c for c in configs if split_fits(name, c.kwargs["BLOCK_N"], c.kwargs["SPLIT"], named_args["N"],
                                             named_args["K"])]


# -- the dense kernels (dense.py)
#: (BLOCK_N, BLOCK_K, num_warps) of the GEMV, plain and gate/up: the least total time over the 8B shape's
#: projections on an H200
GEMV_CONFIG = (2, 1024, 1)
GEMV_GLU_CONFIG = (1, 1024, 4)
#: (rows, columns, glu) of a matrix -> its own configuration where a sweep's best beat the defaults (the
#: 30B-A3B shape's q/k/v, o and router)
GEMV_SHAPE_CONFIGS: dict[tuple[int, int, bool], tuple[int, int, int]] = {
    (5120, 2048, False): (2, 512, 2), (2048, 4096, False): (2, 1024, 4), (128, 2048, False): (2, 1024, 4)}
#: assignments (row, expert pairs) up to which experts run as per-assignment GEMVs (decode, verify windows)
EXPERT_GEMV_MAX = 256
#: (BLOCK_N, BLOCK_K, num_warps) of those GEMVs over an expert's gate/up and over its down matrix: the
#: best for a 30B-A3B layer's 8 experts at 1 row
EXPERT_GLU_CONFIG = (1, 512, 2)
EXPERT_DOWN_CONFIG = (4, 128, 1)
#: (BLOCK_N, BLOCK_K, num_warps) of expert_down_sum_kernel, a program holding all of a row's slots
EXPERT_DOWN_SUM_CONFIG = (1, 128, 1)
#: (BLOCK_N, BLOCK_K, num_warps) of the skinny kernel over a window's experts (the grouped expert path)
EXPERT_GROUP_CONFIG = (64, 128, 4)
#: rows past which each expert hit runs once for all its rows (grouped): faster from 9 rows on, 30B-A3B, H200
EXPERT_GROUP_MIN_ROWS = 8
#: (BLOCK_N, BLOCK_K, num_warps, num_stages) of the few-row GEMM: the least total time over the 8B shape's
#: projections at 8 rows on an H200
SKINNY_CONFIG = (64, 256, 4, 4)
#: past 16 rows cuBLAS, faster at 33 and 64 rows of the 8B shape than every configuration swept
SKINNY_MAX_ROWS = 16

# -- gated DeltaNet's step (delta.py)
#: (BV, num_warps) of the recurrence programs: BV value dims a program (None: a whole head, which then applies
#: the gated RMSNorm itself); 16 wins a Qwen3.5-9B layer at 1 and 16 rows
DELTA_CONFIG = (16, 1)
CONV_CHANNELS_PER_WARP = 64  # channels a convolution program covers, per warp

# -- attention and the norms (attention.py, norms.py)
ATTENTION_BLOCK = 64  # cells a program's loop step reads
ATTENTION_TARGET_SPLITS = 16
ATTENTION_MAX_ROWS = 64  # query rows (window rows x heads of a group) one program holds
#: the head dim the two sizes above are for; a larger one shrinks both in proportion (at 256, 64 x 64 tiles
#: over three stages need more shared memory than an H200 has)
ATTENTION_TILE_DIM = 128
NORM_MAX_DIM = 16384  # hidden sizes up to which a row is held in registers


def attention_tiles(d: int) -> tuple[int, int]:
    """(query rows a program holds, cells a loop step reads) at head dim d."""
    shrink = max(1, d // ATTENTION_TILE_DIM)
    return max(16, ATTENTION_MAX_ROWS // shrink), max(16, ATTENTION_BLOCK // shrink)
