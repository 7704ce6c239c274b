"""Grouped-query attention of a few query rows over a cache in two launches: per K/V head and chunk of
cells an online-softmax partial, then per query row their combination (quantized for an int8-x o
projection where asked)."""

from __future__ import annotations

import triton
import triton.language as tl

from .jit_common import prefetch_l2, settle
from .jit_x8 import quantize_blocks


@triton.jit
def attention_partial_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, o_ptr, m_ptr, l_ptr, S, stride_cell,
                             stride_mask, chunk, scale, T: tl.constexpr, G: tl.constexpr, HK: tl.constexpr,
                             D: tl.constexpr, R: tl.constexpr, RT: tl.constexpr, BLOCK_S: tl.constexpr,
                             PRECISION: tl.constexpr, PDL: tl.constexpr = False, PREWAIT: tl.constexpr = False):
    """R of the RT query rows (window rows x heads of a group) of one K/V head over one chunk of cells.
    PREWAIT (with PDL): the K and V rows of its chunk's first BLOCK_S cells asked into L2 before the wait
    for the kernel ahead (pre_wait_loads; a cell that kernel writes is read only after it)."""
    kvh = tl.program_id(0)
    split = tl.program_id(1)
    if PREWAIT and PDL:
        LINES: tl.constexpr = (D * 2 + 127) // 128  # of a 16-bit row
        cell = split * chunk + tl.arange(0, BLOCK_S)[:, None]
        at = cell.to(tl.int64) * stride_cell + kvh * D + tl.arange(0, LINES)[None, :] * 64
        ok = (cell < S) & (cell < split * chunk + chunk)
        prefetch_l2(k_ptr + at, ok)
        prefetch_l2(v_ptr + at, ok)
    settle(PDL)
    splits = tl.num_programs(1)
    r = tl.program_id(2) * R + tl.arange(0, R)
    t = r // G
    rvalid = r < T * G
    d = tl.arange(0, D)
    head = kvh * G + r % G
    q = tl.load(q_ptr + (t * (HK * G) + head)[:, None] * D + d[None, :], mask=rvalid[:, None], other=0.0)
    m_i = tl.full([R], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([R], dtype=tl.float32)
    acc = tl.zeros([R, D], dtype=tl.float32)
    start = split * chunk
    for s0 in range(start, start + chunk, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        smask = s < S
        kv_off = s[:, None].to(tl.int64) * stride_cell + kvh * D + d[None, :]
        k = tl.load(k_ptr + kv_off, mask=smask[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale
        vis = tl.load(mask_ptr + t[:, None] * stride_mask + s[None, :], mask=rvalid[:, None] & smask[None, :],
                      other=0)
        scores = tl.where(vis != 0, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_ref)
        p = tl.exp(scores - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + kv_off, mask=smask[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION).to(tl.float32)
        m_i = m_new
    part = (kvh * splits + split) * RT + r
    tl.store(m_ptr + part, m_i)
    tl.store(l_ptr + part, l_i)
    tl.store(o_ptr + part[:, None] * D + d[None, :], acc)


@triton.jit
def attention_combine_kernel(o_ptr, m_ptr, l_ptr, out_ptr, q_ptr, d_ptr, s_ptr, splits, T, MP, G: tl.constexpr,
                             HK: tl.constexpr, D: tl.constexpr, RT: tl.constexpr, SPLITS: tl.constexpr,
                             QUANT: tl.constexpr = False, SUMS: tl.constexpr = 16, PDL: tl.constexpr = False):
    """One query row of one K/V head per program: its partials summed split by split. QUANT: its head's D
    values also quantized as quantize_x would for the T rows (quant_kernels.quantize_blocks, SUMS its
    layout), the programs of rows T .. MP writing the zero rows of its padding."""
    settle(PDL)
    kvh = tl.program_id(0)
    r = tl.program_id(1) + tl.zeros([1], dtype=tl.int32)  # [1]: the masks below stay tensors
    t = r // G
    d = tl.arange(0, D)
    m_max = tl.full([1], float("-inf"), dtype=tl.float32)
    m_s = ()
    for i in tl.static_range(SPLITS):
        m_i = tl.load(m_ptr + (kvh * splits + i) * RT + r, mask=(t < T) & (t * 0 + i < splits),
                      other=float("-inf"))
        m_s += (m_i,)
        m_max = tl.maximum(m_max, m_i)
    l_sum = tl.zeros([1], dtype=tl.float32)
    acc = tl.zeros([1, D], dtype=tl.float32)
    for i in tl.static_range(SPLITS):
        ok = (t < T) & (t * 0 + i < splits)
        scale = tl.where(ok, tl.exp(m_s[i] - m_max), 0.0)
        part = (kvh * splits + i) * RT + r
        l_sum += tl.load(l_ptr + part, mask=ok, other=0.0) * scale
        acc += tl.load(o_ptr + part[:, None] * D + d[None, :], mask=ok[:, None], other=0.0) * scale[:, None]
    head = kvh * G + r % G
    live = (t < T)[:, None] & (d >= 0)[None, :]
    out = tl.where(live, acc / l_sum[:, None], 0.0).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + ((t * (HK * G) + head) * D)[:, None] + d[None, :], out, mask=live)
    if QUANT:
        kb = head * (D // 32) + tl.arange(0, D // 32)
        quantize_blocks(tl.reshape(out.to(tl.float32), (D // 32, 32)), kb * 0 + t, kb, kb >= 0, HK * G * D // 32,
                        MP, q_ptr, d_ptr, s_ptr, SUMS)
