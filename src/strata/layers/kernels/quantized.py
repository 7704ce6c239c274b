"""Products over GGUF-quantized matrices kept in their blocks (a QuantWeight's segments, a QuantExperts'
stacks): which kernel runs a product, at which block shape, with which x.

The 1-row GEMVs of every kernel type and the few-row GEMMs of all but Q6_K at odd widths run on 32-bit words
of the blocks and x quantized to int8 per 32 values (x8.py), summing bytes times bytes with dp4a or on
integer tensor cores before applying the scales, as llama.cpp's GPU products do; their lanes read runs of
consecutive bytes along K. The rest run on float tiles that _halves decodes as gguf's reference does. On a
GPU each kernel's block shape is autotuned at first use (Triton's cache keeps the choice on disk); the
interpreter takes the first of each list (tuning.py)."""

from __future__ import annotations

import functools

import torch

from . import pdl
from .common import cdiv, disk_cache, interpreting, pow2, precision
from .options import KernelOptions
from .qtypes import BLOCKS, IQ4_XS, Q4_0, Q4_K, Q5_K, Q6_K, Q8_0, TILE, check, table
from .tuning import (GEMV_CONFIGS, LANE_K_CONFIGS, LANE_K_TUNE_KEY, LANES, SKINNY_CONFIGS, SPLIT_PROGRAMS,
                     WORD_SKINNY_CONFIGS, loop_stages, prune_split, split_fits)
from .x8 import quantize_x

#: the types with a 1-row GEMV of their own on 32-bit words and int8 x, all with lanes along K
INT8_GEMVS = {Q4_K: "gemv_q4k8c", Q5_K: "gemv_q4k8c", Q6_K: "gemv_q6k8c", Q8_0: "gemv_q8_0c", IQ4_XS: "gemv_q4k8c",
              Q4_0: "gemv_q4k8c"}
#: the types with a few-row GEMM of their own on 32-bit words and int8 x (X_ROWS rows), on integer tensor
#: cores, as their GEMVs compute (Q8_0's is skinny_q8_0w where 512 | K: word_kernel)
WORD_KERNELS = {Q4_K: "skinny_q4k8", Q5_K: "skinny_q4k8", Q6_K: "skinny_q6k8", Q8_0: "skinny_q8_0",
                IQ4_XS: "skinny_q4k8", Q4_0: "skinny_q4k8"}


@functools.cache
def kernels() -> dict:
    """The kernels by name and, on the device, their autotuned variants (NAME_tuned): the block shapes
    measured at first use, keyed by the constants that pick what a kernel computes too, so that no type (or
    stacking) takes shapes another chose, in a process or from the disk."""
    import triton

    from . import jit_float, jit_q4, jit_q6k, jit_q8_0

    out = {"dequant": jit_float.dequant_kernel, "gather": jit_float.gather_kernel, "gemv": jit_float.gemv_kernel,
           "skinny": jit_float.skinny_kernel, "gemv_q4k8c": jit_q4.gemv_q4k8c_kernel,
           "skinny_q4k8": jit_q4.skinny_q4k8_kernel, "gemv_q6k8c": jit_q6k.gemv_q6k8c_kernel,
           "skinny_q6k8": jit_q6k.skinny_q6k8_kernel, "gemv_q8_0c": jit_q8_0.gemv_q8_0c_kernel,
           "skinny_q8_0": jit_q8_0.skinny_q8_0_kernel, "skinny_q8_0w": jit_q8_0.skinny_q8_0w_kernel}
    if interpreting():
        return out
    autotune = functools.partial(triton.autotune, **disk_cache(triton))
    out["gemv_tuned"] = autotune(
        [triton.Config({"BLOCK_N": b, "UNROLL": u}, num_warps=w) for b, w, u in GEMV_CONFIGS],
        key=["N", "K", "QTYPE", "GLU", "EXPERTS"])(out["gemv"])
    for skinny in {*WORD_KERNELS.values(), "skinny_q8_0w"}:
        out[f"{skinny}_tuned"] = autotune(
            [triton.Config({"BLOCK_N": b, "SPLIT": k, **loop_stages(skinny, st)}, num_warps=w, num_stages=st)
             for b, w, st, k in WORD_SKINNY_CONFIGS],
            key=["M", "N", "K", "GLU", *(a for a in ("QTYPE", "STACK_ROWS") if a in out[skinny].arg_names)],
            prune_configs_by={"early_config_prune": functools.partial(prune_split, skinny)})(out[skinny])
    for name in set(INT8_GEMVS.values()):
        out[f"{name}_tuned"] = autotune(
            [triton.Config({"RT": rt, "WARPS": w, "KU": ku, "KS": ks}, num_warps=w)
             for rt, w, ku, ks in LANE_K_CONFIGS],
            key=list(LANE_K_TUNE_KEY))(out[name])
    out["skinny_tuned"] = autotune(
        [triton.Config({"BLOCK_N": b, "UNROLL": u}, num_warps=w) for b, w, u in SKINNY_CONFIGS],
        key=["M", "N", "K", "QTYPE", "GLU"])(out["skinny"])
    return out


def dequantize(data: torch.Tensor, qtype: int, cols: int) -> torch.Tensor:
    """A [rows, row_bytes] uint8 matrix of GGUF blocks -> float32 [rows, cols]."""
    rows = data.shape[0]
    check(data, qtype, cols)
    out = torch.empty(rows, cols, dtype=torch.float32, device=data.device)
    block_n = 128 if interpreting() else 8  # the interpreter's cost is per program, not per element
    kernels()["dequant"][(cdiv(rows, block_n), cols // TILE)](data, table(data.device, qtype), out, rows, cols,
                                                              data.stride(0), QTYPE=int(qtype), BLOCK_N=block_n)
    return out


def gather(data: torch.Tensor, qtype: int, cols: int, tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `tokens` of a quantized embedding table, dequantized: [*tokens.shape, cols] in dtype."""
    check(data, qtype, cols)
    flat = tokens.reshape(-1).contiguous()
    out = torch.empty(flat.numel(), cols, dtype=dtype, device=data.device)
    if flat.numel():
        kernels()["gather"][(flat.numel(),)](flat, data, table(data.device, qtype), out, cols, data.stride(0),
                                             QTYPE=int(qtype))
    return out.view(*tokens.shape, cols)


def counters(device: torch.device, lane: int = 0) -> torch.Tensor:
    """The split GEMMs' arrival counts, one per block of rows: zero between products (the last slice resets
    its own), so one buffer serves every product that runs after another; products run side by side take
    different lanes. Every lane is made at the first call, so that none is first made inside a graph's
    capture (whose zeros would be written only when that graph is replayed)."""
    return _count_lanes(device)[lane]


@functools.cache
def _count_lanes(device: torch.device) -> torch.Tensor:
    return torch.zeros(LANES, SPLIT_PROGRAMS, dtype=torch.int32, device=device)


def word_kernel(qtype: int, rows: int, cols: int, nbytes: int = 0) -> str | None:
    """The word kernel for this product over a matrix of nbytes (one expert's), if any. Q6_K's
    210-byte superblocks lie anywhere in 16-byte chunks: its GEMV reads the chunks around them from the
    matrix's start, its rows at any even byte, with int32 byte offsets (nbytes < 2 GiB); its GEMM takes
    superblocks in pairs from 4-byte boundaries (512 | cols). Q8_0's GEMM takes blocks in sixteens (512 | cols,
    skinny_q8_0w), else in fours (128 | cols); its lanes-along-K GEMV reads each block's d through int32
    offsets in float16 units (nbytes < 4 GiB)."""
    if qtype == Q6_K and ((rows > 1 and cols % 512) or (rows == 1 and nbytes >= 2 ** 31)):
        return None
    if qtype == Q8_0 and rows > 1 and cols % 128:
        return None
    if qtype == Q8_0 and rows > 1 and cols % 512 == 0:
        return "skinny_q8_0w"
    if qtype == Q8_0 and rows == 1 and nbytes >= 2 ** 32:
        return None
    return (INT8_GEMVS if rows == 1 else WORD_KERNELS).get(qtype)


def configs(qtype: int, rows: int, cols: int, n: int) -> list[tuple[int, ...]]:
    """The block shapes a product of `rows` rows over a `qtype` matrix of n rows is tried with (for sweeps)."""
    word = word_kernel(qtype, rows, cols, n * cols // BLOCKS[qtype][0] * BLOCKS[qtype][1])
    if word:
        if rows == 1:
            return LANE_K_CONFIGS
        return [c for c in WORD_SKINNY_CONFIGS if split_fits(word, c[0], c[3], n, cols)]
    return GEMV_CONFIGS if rows == 1 else SKINNY_CONFIGS


def int8_x(qtype: int, rows: int, cols: int, nbytes: int = 0) -> bool:
    """Whether this product (over a matrix of nbytes) computes with x quantized by quantize_x in place of x."""
    return word_kernel(qtype, rows, cols, nbytes) is not None


def matmul(x: torch.Tensor, data: torch.Tensor, qtype: int, n: int, glu: bool = False,
           config: tuple[int, ...] | None = None, x8: tuple | None = None, out: torch.Tensor | None = None,
           lane: int = 0, options: KernelOptions = KernelOptions()) -> torch.Tensor:
    """x [M, K] @ W^T for a quantized W of n rows ([n, row_bytes]; with glu 2n rows, gate then up, and
    the result silu(gate) * up [M, n]). config: one of configs()' block shapes, for sweeps. x8: x's
    quantize_x where it was made already (by the norm before, or for the segments that share x). out: where
    to write it, [M, n] with unit column stride (a fused q/k/v's columns of one segment). lane: which count
    buffer its K slices take (counters); two products running side by side on two streams take different
    ones. The 1-row GEMVs launch with PDL (pdl.py), the few-row GEMMs without (a Q4_K_M verify window ran 8%
    slower with it on the H200 while its decode step gained 12%)."""
    rows, k = x.shape
    check(data, qtype, k)
    x = x.contiguous()
    y = torch.empty(rows, n, device=x.device, dtype=x.dtype) if out is None else out
    assert y.shape == (rows, n) and y.dtype == x.dtype and y.stride(1) == 1, (y.shape, y.dtype, y.stride())
    found = kernels()
    word = word_kernel(qtype, rows, k, data.numel())
    tuned = config is None and f"{word}_tuned" in found
    if word and rows == 1:
        _word_gemv(word, x8 or quantize_x(x), data, y, qtype, n, k, data.stride(0), glu, config,
                   prefetch=options.gemv_prefetch)
        return y
    if word:
        shapes = [config] if config else WORD_SKINNY_CONFIGS[:None if tuned else 1]
        partials = max([2 * 16 * sp * cdiv(n, b) * b for b, _, _, sp in shapes
                        if sp > 1 and split_fits(word, b, sp, n, k)] or [1])  # the workspace the slices need
        common = (y, torch.empty(partials, dtype=torch.float32, device=x.device), counters(x.device, lane), rows,
                  n, k, data.stride(0) // 4)
        args = (*(x8 or quantize_x(x)), data, *common, y.stride(0))
        extra = {"GLU": glu, "ASM": not interpreting(), **({"QTYPE": int(qtype)} if word == "skinny_q4k8" else {}),
                 **({"STACK_ROWS": options.glu_stack_rows} if word in ("skinny_q4k8", "skinny_q8_0w") else {})}
        if tuned:
            found[f"{word}_tuned"][lambda meta: (cdiv(n, meta["BLOCK_N"]), meta["SPLIT"])](*args, **extra)
        else:
            block_n, warps, stages, split = shapes[0]
            assert split_fits(word, block_n, split, n, k), (word, shapes[0], n, k)
            found[word][(cdiv(n, block_n), split)](*args, BLOCK_N=block_n, SPLIT=split, num_warps=warps,
                                                   num_stages=stages, **loop_stages(word, stages), **extra)
        return y
    tab = table(x.device, qtype)
    name = "gemv" if rows == 1 else "skinny"
    args = (x, data, tab, y, n, k, data.stride(0), data, 0, 0, 0) if rows == 1 else \
        (x, data, tab, y, rows, n, k, data.stride(0), x.stride(0), y.stride(0))
    extra = pdl.options(x.device) if rows == 1 else {"BLOCK_M": max(16, pow2(rows)), "PRECISION": precision(x)}
    _byte_kernel(name, n, 1, args, config or (GEMV_CONFIGS if rows == 1 else SKINNY_CONFIGS)[0], config is None,
                 QTYPE=int(qtype), GLU=glu, **extra)
    return y


def _word_gemv(word: str, x8: tuple, data: torch.Tensor, y: torch.Tensor, qtype: int, n: int, k: int,
               row_bytes: int, glu: bool, config: tuple[int, ...] | None, programs: int = 1, prefetch: int = 0,
               **experts) -> None:
    """The 1-row word GEMV `word` (INT8_GEMVS) on x8 (quantize_x's): its tuned variant where the device has
    it and no config is given, else at config (or the first of its list). programs along axis 1 with
    experts (the kernels' EXPERTS arguments: jit_word._assignment). prefetch: KernelOptions.gemv_prefetch."""
    found = kernels()

    def covered(meta) -> int:  # rows of W a program takes (with GLU: gate rows, each with its up row)
        return meta["RT"] * meta["WARPS"] // meta["KS"]

    if word == "gemv_q8_0c":  # in place of the sums, x laid out as Q8_0 rows (quantize_x's q after its K values)
        q, d = x8[:2]
        x8 = (q, d, q[d.numel() * 32:])
    args = (*x8, data, y, n, k, row_bytes if word == "gemv_q6k8c" else row_bytes // 4)  # its rows: any even byte
    extra = {"GLU": glu, "ASM": not interpreting(), "QTYPE": int(qtype), "PREFETCH": prefetch, **experts,
             **pdl.options(y.device)}
    if config is None and f"{word}_tuned" in found:
        tuner = found[f"{word}_tuned"]
        grid = lambda meta: (cdiv(n, covered(meta)), programs)  # noqa: E731
        if extra["PREFETCH"]:  # products over experts never prefetch
            named = {"N": n, "K": k, "GLU": glu, "QTYPE": int(qtype), "EXPERTS": False}
            shape = (*(named[name] for name in LANE_K_TUNE_KEY), *(a.dtype for a in args if hasattr(a, "dtype")))
            plain = vars(tuner).setdefault("strata_chosen_plain", set())  # shapes it chose without prefetching
            if shape not in plain:
                # the tuner times a product alone, where a prefetch has no kernel ahead to overlap: it chooses
                # as without prefetching (the prefetch's figures were measured so)
                tuner[grid](*args, **{**extra, "PREFETCH": 0})
                plain.add(shape)
        tuner[grid](*args, **extra)
        return
    rt, warps, ku, ks = config or LANE_K_CONFIGS[0]
    meta = {"RT": rt, "WARPS": warps, "KU": ku, "KS": ks}
    found[word][(cdiv(n, covered(meta)), programs)](*args, **meta, num_warps=warps, **extra)


def _byte_kernel(name: str, n: int, programs: int, args: tuple, config: tuple[int, ...], tune: bool,
                 **extra) -> None:
    """The byte kernel `name` (gemv or skinny) over n rows of W, `programs` along axis 1: where tune and the
    device has it, its tuned variant; else at config (BLOCK_N, num_warps, UNROLL)."""
    found = kernels()
    if tune and f"{name}_tuned" in found:
        found[f"{name}_tuned"][lambda meta: (cdiv(n, meta["BLOCK_N"]), programs)](*args, **extra)
    else:
        block_n, warps, unroll = config
        found[name][(cdiv(n, block_n), programs)](*args, BLOCK_N=block_n, UNROLL=unroll, num_warps=warps, **extra)


def expert_matmul(x: torch.Tensor, data: torch.Tensor, qtype: int, n: int, ids: torch.Tensor, share: int = 1,
                  glu: bool = False, config: tuple[int, ...] | None = None, x8: tuple | None = None,
                  options: KernelOptions = KernelOptions()) -> torch.Tensor:
    """A window's (row, expert) assignments over stacked quantized experts, one GEMV each: data [E, rows,
    row_bytes] (each expert's n rows, with glu its n gate rows then its n up rows), ids [A] the experts,
    x [A / share, K] (assignment a reads row a // share). Returns [A, n] (with glu silu(gate) * up).
    Only the experts named are read; the ids stay on the device (CUDA-graph safe). Where the type has a
    1-row word GEMV for these experts (and options.expert_word_gemvs), that kernel runs it (EXPERTS) on x
    quantized row by row as one row (x8, where the norm before made it), as a dense product of one row
    would; else the byte kernel on float x. config: the chosen kernel's block shape (configs(qtype, 1, ...))."""
    rows, k = x.shape
    check(data[0], qtype, k)
    assert ids.numel() == rows * share and data.is_contiguous(), (ids.shape, rows, share)
    x = x.contiguous()
    y = torch.empty(ids.numel(), n, device=x.device, dtype=x.dtype)
    word = word_kernel(qtype, 1, k, data[0].numel()) if options.expert_word_gemvs else None
    if word:  # the rows laid end to end: each quantized as one row is (its blocks never straddle rows)
        _word_gemv(word, x8 or quantize_x(x.view(1, -1)), data, y, qtype, n, k, data.stride(1), glu, config,
                   ids.numel(), ids_ptr=ids.contiguous(), expert_bytes=data.stride(0), stride_y=y.stride(0),
                   EXPERTS=True, SHARE=share)
        return y
    args = (x, data, table(x.device, qtype), y, n, k, data.stride(1), ids.contiguous(), data.stride(0), x.stride(0),
            y.stride(0))
    _byte_kernel("gemv", n, ids.numel(), args, config or GEMV_CONFIGS[0], config is None, QTYPE=int(qtype), GLU=glu,
                 EXPERTS=True, SHARE=share, **pdl.options(x.device))
    return y
