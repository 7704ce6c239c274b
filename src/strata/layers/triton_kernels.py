"""Triton kernels for the CUDA decode step, where cuBLAS and torch.compile leave time on the table.

A 1-token decode step of an 8B model is weight streaming plus ~15 small kernels per layer. On the H200
cuBLAS splits the smaller GEMVs over K (a second reduction kernel, and ~75% of copy bandwidth),
attention is two batched matmuls around a softmax, and inductor splits the q/k norm + RoPE + cache
write into three kernels. The kernels here do each of those in one launch:

- `gemv`: y = W x for a single row, no split-K; with `glu` the gate and up rows of a stacked
  gate/up matrix are read side by side and silu(gate) * up is written directly.
- `skinny`: the same for a few rows (a verify window, a drafter block) on tensor cores.
- `experts`: a mixture-of-experts MLP for a few rows as GEMVs per (row, expert) assignment, each
  reading only its expert's matrices (gate/up fused as in `gemv`), or for more rows each expert hit
  once, on tensor cores, for all the rows that chose it; `route_topk`: the routing after the router.
- `attention`: grouped-query attention of a few query rows over a cache in two launches (per K/V
  head and chunk of cells an online-softmax partial, then per query row their combination), any
  visibility mask.
- `rms_norm`: RMSNorm (after a residual add) of a few rows, each row held in registers, where
  inductor's group for the 8B and 30B rows is a looped reduction (`triton_red_*`, the row read twice);
  on the H200 decode steps were 0.9-2.5% faster.
- `norm_rotate_store`: per-head q/k RMSNorm and NeoX RoPE, q written out, k and v stored at their
  positions in the cache.

On Hopper they launch with programmatic dependent launch (pdl.py): each is launched while the one before
it drains, and waits for it before its first read. They follow the rounding of the reference ops (ops.py)
(which stay the reference and the CPU path) up to accumulation order. Triton is imported when a kernel
is first built, so with TRITON_INTERPRET=1 the tests run these very kernels on the CPU.
"""

from __future__ import annotations

import functools
import os

import torch

from . import pdl


def available(device: torch.device) -> bool:
    """Triton kernels can run on this device's tensors (a CUDA GPU, or the interpreter)."""
    if torch.device(device).type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _build():
    import triton
    import triton.language as tl

    from . import quant_kernels

    globals()["settle"] = pdl.jit()  # the kernels call it by name: Triton resolves names in module globals
    globals()["prefetch_l2"] = pdl.jit_prefetch()
    globals()["quantize_blocks"] = quant_kernels._build()["quantize_blocks"]

    @triton.jit
    def gemv_kernel(x_ptr, w_ptr, e_ptr, b_ptr, y_ptr, N, K, stride_x, stride_e, stride_w, stride_y, up_offset,
                    HAS_BIAS: tl.constexpr, GLU: tl.constexpr, EXPERTS: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, SHARE: tl.constexpr = 1, PDL: tl.constexpr = False):
        """y = W x for output row a = program_id(1) (one row unless EXPERTS), from input row a // SHARE; with
        EXPERTS row a has its own matrix, expert e[a]'s at w + e[a] * stride_e. GLU: the up rows sit up_offset
        after the gate rows."""
        settle(PDL)
        a = tl.program_id(1).to(tl.int64)
        if EXPERTS:
            w_ptr += tl.load(e_ptr + a) * stride_e
        x_ptr += (a // SHARE) * stride_x
        y_ptr += a * stride_y
        rows = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        rmask = rows < N
        cols = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + cols
            kmask = kk < K
            x = tl.load(x_ptr + kk, mask=kmask, other=0.0).to(tl.float32)
            wmask = rmask[:, None] & kmask[None, :]
            w = tl.load(w_ptr + rows[:, None] * stride_w + kk[None, :], mask=wmask, other=0.0,
                        eviction_policy="evict_first")
            acc += w.to(tl.float32) * x[None, :]
            if GLU:
                u = tl.load(w_ptr + up_offset + rows[:, None] * stride_w + kk[None, :], mask=wmask, other=0.0,
                            eviction_policy="evict_first")
                acc_up += u.to(tl.float32) * x[None, :]
        out_ty = y_ptr.dtype.element_ty
        y = tl.sum(acc, axis=1)
        if HAS_BIAS:
            y += tl.load(b_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
        if GLU:
            gate = y.to(out_ty).to(tl.float32)
            up = tl.sum(acc_up, axis=1).to(out_ty).to(tl.float32)
            y = (gate * tl.sigmoid(gate)).to(out_ty).to(tl.float32) * up
        tl.store(y_ptr + rows, y.to(out_ty), mask=rmask)

    @triton.jit
    def expert_down_sum_kernel(a_ptr, w_ptr, e_ptr, sw_ptr, out_ptr, N, K, stride_a, stride_e, stride_w, stride_out,
                               SLOTS: tl.constexpr, SLOTS_P2: tl.constexpr, BLOCK_N: tl.constexpr,
                               BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
        """Row r = program_id(1) of the experts' weighted sum, for a block of output columns: the down GEMVs
        of its SLOTS assignments a = r * SLOTS + j (expert e[a]'s matrix over activation row a) side by side
        in one tile, each rounded as the GEMV stores it, then weighted by sw[a] and summed slot by slot in
        order, rounding as ops.sum_slots does: the sum needs no launch or pass over memory of its own."""
        settle(PDL)
        r = tl.program_id(1).to(tl.int64)
        j = tl.arange(0, SLOTS_P2)
        jmask = j < SLOTS
        a = r * SLOTS + j
        e = tl.load(e_ptr + a, mask=jmask, other=0)
        rows = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        rmask = rows < N
        cols = tl.arange(0, BLOCK_K)
        w_rows = w_ptr + e[:, None, None] * stride_e + rows[None, :, None] * stride_w
        wmask = jmask[:, None, None] & rmask[None, :, None]
        acc = tl.zeros([SLOTS_P2, BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + cols
            kmask = kk < K
            x = tl.load(a_ptr + a[:, None] * stride_a + kk[None, :], mask=jmask[:, None] & kmask[None, :],
                        other=0.0).to(tl.float32)
            w = tl.load(w_rows + kk[None, None, :], mask=wmask & kmask[None, None, :], other=0.0,
                        eviction_policy="evict_first")
            acc += w.to(tl.float32) * x[:, None, :]
        out_ty = out_ptr.dtype.element_ty
        y = tl.sum(acc, axis=2).to(out_ty).to(tl.float32)
        p = (y * tl.load(sw_ptr + a, mask=jmask, other=0.0).to(tl.float32)[:, None]).to(out_ty).to(tl.float32)
        out = tl.zeros([BLOCK_N], dtype=tl.float32)
        for s in tl.static_range(SLOTS):
            out = (out + tl.sum(tl.where(j[:, None] == s, p, 0.0), axis=0)).to(out_ty).to(tl.float32)
        tl.store(out_ptr + r * stride_out + rows, out.to(out_ty), mask=rmask)

    @triton.jit
    def skinny_kernel(x_ptr, w_ptr, b_ptr, y_ptr, se_ptr, perm_ptr, M, N, K, stride_x, stride_w, stride_y, stride_e,
                      up_offset, HAS_BIAS: tl.constexpr, GLU: tl.constexpr, EXPERTS: tl.constexpr, KROW: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                      PDL: tl.constexpr = False):
        """y [M, N] = x [M, K] @ W^T for a few rows: each weight tile is streamed once, on tensor cores. GLU:
        the up rows sit up_offset after the gate rows. EXPERTS: the M rows are a window's (row, expert)
        assignments sorted by expert (se, perm); program (n, i) works only when assignment i is its expert's
        first, for all (up to BLOCK_M) of that expert's assignments, over expert se[i]'s matrix at
        w + se[i] * stride_e, so each expert hit is read once. Assignment a reads x row a // KROW and writes
        y row a."""
        cols = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        nmask = cols < N
        settle(PDL)
        m = tl.arange(0, BLOCK_M)
        mmask = m < M
        rows = m.to(tl.int64)
        if EXPERTS:
            i = tl.program_id(1)
            e = tl.load(se_ptr + i)
            leader = ((i == 0) | (tl.load(se_ptr + tl.maximum(i - 1, 0)) != e)).to(tl.int32)
            j = i + m
            mmask = (j < M) & (j * 0 + leader > 0)
            mmask = mmask & (tl.load(se_ptr + j, mask=mmask, other=-1) == e)
            rows = tl.load(perm_ptr + j, mask=mmask, other=0).to(tl.int64)
            nmask = nmask & (cols * 0 + leader > 0)
            w_ptr += e.to(tl.int64) * stride_e
        kr = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + kr
            kmask = kk < K
            x = tl.load(x_ptr + (rows // KROW)[:, None] * stride_x + kk[None, :], mask=mmask[:, None] & kmask[None, :],
                        other=0.0)
            wmask = kmask[:, None] & nmask[None, :]
            w = tl.load(w_ptr + cols[None, :] * stride_w + kk[:, None], mask=wmask, other=0.0,
                        eviction_policy="evict_first")
            acc = tl.dot(x, w, acc, input_precision=PRECISION)
            if GLU:
                u = tl.load(w_ptr + up_offset + cols[None, :] * stride_w + kk[:, None], mask=wmask, other=0.0,
                            eviction_policy="evict_first")
                acc_up = tl.dot(x, u, acc_up, input_precision=PRECISION)
        out_ty = y_ptr.dtype.element_ty
        y = acc
        if HAS_BIAS:
            y += tl.load(b_ptr + cols, mask=nmask, other=0.0).to(tl.float32)[None, :]
        if GLU:
            gate = y.to(out_ty).to(tl.float32)
            y = (gate * tl.sigmoid(gate)).to(out_ty).to(tl.float32) * acc_up.to(out_ty).to(tl.float32)
        tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], y.to(out_ty), mask=mmask[:, None] & nmask[None, :])

    @triton.jit
    def route_kernel(logits_ptr, w_ptr, e_ptr, E, stride_l, K: tl.constexpr, KP: tl.constexpr,
                     BLOCK_E: tl.constexpr, RENORM: tl.constexpr, PDL: tl.constexpr = False):
        """One row's routing: softmax over the experts in float32, the top K by repeated maximum (the lower
        expert id first among equals), renormalised when asked, written in ascending expert order."""
        settle(PDL)
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK_E)
        valid = cols < E
        x = tl.load(logits_ptr + row * stride_l + cols, mask=valid, other=float("-inf")).to(tl.float32)
        p = tl.exp(x - tl.max(x, axis=0))
        p = tl.where(valid, p / tl.sum(p, axis=0), -1.0)
        slots = tl.arange(0, KP)
        vals = tl.zeros([KP], dtype=tl.float32)
        idx = tl.full([KP], 1 << 30, dtype=tl.int32)
        for i in tl.static_range(K):
            best = tl.max(p, axis=0)
            j = tl.min(tl.where(p == best, cols, BLOCK_E), axis=0)
            vals = tl.where(slots == i, best, vals)
            idx = tl.where(slots == i, j, idx)
            p = tl.where(cols == j, -1.0, p)
        if RENORM:
            vals = vals / tl.sum(vals, axis=0)
        rank = tl.sum((idx[None, :] < idx[:, None]).to(tl.int32), axis=1)  # experts below each one
        live = slots < K
        tl.store(w_ptr + row * K + rank, vals.to(w_ptr.dtype.element_ty), mask=live)
        tl.store(e_ptr + row * K + rank, idx.to(tl.int64), mask=live)

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

    @triton.jit
    def _norm_columns(x_ptr, r_ptr, row, M, H, stride_x, stride_r, start, WIDTH: tl.constexpr, ADD: tl.constexpr):
        """Columns start .. start + WIDTH of a norm's row (ADD: of x + r, rounded to x's type): their indices,
        mask (past H, or the row past M) and values."""
        c = start + tl.arange(0, WIDTH)
        m = (c < H) & (c * 0 + row < M)
        x = tl.load(x_ptr + row * stride_x + c, mask=m, other=0.0)
        if ADD:
            x = (x.to(tl.float32) + tl.load(r_ptr + row * stride_r + c, mask=m, other=0.0).to(tl.float32)).to(x.dtype)
        return c, m, x

    @triton.jit
    def rms_norm_kernel(x_ptr, r_ptr, w_ptr, sum_ptr, h_ptr, q_ptr, d_ptr, s_ptr, M, H, KB, MP, eps, stride_x,
                        stride_r, stride_s, stride_h, ADD: tl.constexpr, QUANT: tl.constexpr, SUMS: tl.constexpr,
                        BLOCK: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr = False,
                        PREWAIT: tl.constexpr = False):
        """One row's RMSNorm (ADD: of x + r, the sum written out too) in registers, rounding as ops.rms_norm:
        normalised in float32, cast to x's type, then scaled by the weight. QUANT: the normed row also
        quantized as quantize_x would (quant_kernels.quantize_blocks), the programs past the M rows writing
        the zero rows of its padding (MP rows). A row's CHUNK columns a program
        (program_id(1)): each reads the whole row for its sum of squares, then its own columns again (from
        cache) to write and quantize, so that a row's work is spread over several multiprocessors. PREWAIT: its
        weights read before the wait for the kernel ahead (pre_wait_loads)."""
        mine = (tl.program_id(1) * CHUNK if CHUNK < BLOCK else 0) + tl.arange(0, CHUNK if CHUNK < BLOCK else BLOCK)
        if PREWAIT:
            w = tl.load(w_ptr + mine, mask=mine < H, other=0.0).to(tl.float32)
        settle(PDL)
        row = tl.program_id(0).to(tl.int64)
        c, m, x = _norm_columns(x_ptr, r_ptr, row, M, H, stride_x, stride_r, 0, BLOCK, ADD)
        x32 = x.to(tl.float32)
        inv = tl.rsqrt(tl.sum(x32 * x32, axis=0) / H + eps)
        if CHUNK < BLOCK:
            c, m, x = _norm_columns(x_ptr, r_ptr, row, M, H, stride_x, stride_r, tl.program_id(1) * CHUNK, CHUNK, ADD)
            x32 = x.to(tl.float32)
        if ADD:
            tl.store(sum_ptr + row * stride_s + c, x, mask=m)
        n = (x32 * inv).to(x.dtype).to(tl.float32)
        if not PREWAIT:
            w = tl.load(w_ptr + c, mask=c < H, other=0.0).to(tl.float32)
        h = (n * w).to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + row * stride_h + c, h, mask=m)
        if QUANT:
            kb = tl.program_id(1) * (CHUNK // 32) + tl.arange(0, CHUNK // 32)
            quantize_blocks(tl.reshape(h.to(tl.float32), (CHUNK // 32, 32)), kb * 0 + row, kb, kb < KB, KB, MP,
                            q_ptr, d_ptr, s_ptr, SUMS)

    @triton.jit
    def _rotate_inputs(qw_ptr, kw_ptr, cos_ptr, sin_ptr, t, head, H: tl.constexpr, HALF: tl.constexpr):
        """norm_rotate_store's inputs no kernel of the layer writes: its head's norm weights (q's or k's),
        halves apart, and its row's cos and sin halves, as float32."""
        D: tl.constexpr = 2 * HALF
        i = tl.arange(0, HALF)
        if head < H:
            w1 = tl.load(qw_ptr + i).to(tl.float32)
            w2 = tl.load(qw_ptr + HALF + i).to(tl.float32)
        else:
            w1 = tl.load(kw_ptr + i).to(tl.float32)
            w2 = tl.load(kw_ptr + HALF + i).to(tl.float32)
        return (w1, w2, tl.load(cos_ptr + t * D + i).to(tl.float32), tl.load(cos_ptr + t * D + HALF + i).to(tl.float32),
                tl.load(sin_ptr + t * D + i).to(tl.float32), tl.load(sin_ptr + t * D + HALF + i).to(tl.float32))

    @triton.jit
    def norm_rotate_store_kernel(qk_ptr, v_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, pos_ptr, q_out_ptr, k_cache_ptr,
                                 v_cache_ptr, eps, stride_qk, stride_v, stride_cell, H: tl.constexpr, HK: tl.constexpr,
                                 HALF: tl.constexpr, PDL: tl.constexpr = False, PREWAIT: tl.constexpr = False):
        t = tl.program_id(0)
        head = tl.program_id(1)
        if PREWAIT:
            w1, w2, cos1, cos2, sin1, sin2 = _rotate_inputs(qw_ptr, kw_ptr, cos_ptr, sin_ptr, t, head, H, HALF)
        settle(PDL)
        D: tl.constexpr = 2 * HALF
        i = tl.arange(0, HALF)
        src = qk_ptr + t * stride_qk + head * D
        x1 = tl.load(src + i).to(tl.float32)
        x2 = tl.load(src + HALF + i).to(tl.float32)
        ty = qk_ptr.dtype.element_ty
        inv = tl.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / D + eps)
        if not PREWAIT:
            w1, w2, cos1, cos2, sin1, sin2 = _rotate_inputs(qw_ptr, kw_ptr, cos_ptr, sin_ptr, t, head, H, HALF)
        n1 = (x1 * inv).to(ty).to(tl.float32) * w1
        n2 = (x2 * inv).to(ty).to(tl.float32) * w2
        n1 = n1.to(ty).to(tl.float32)
        n2 = n2.to(ty).to(tl.float32)
        r1 = (n1 * cos1 - n2 * sin1).to(ty)
        r2 = (n2 * cos2 + n1 * sin2).to(ty)
        if head < H:
            dst = q_out_ptr + (t * H + head) * D
            tl.store(dst + i, r1)
            tl.store(dst + HALF + i, r2)
        else:
            cell = tl.load(pos_ptr + t).to(tl.int64) * stride_cell + (head - H) * D
            tl.store(k_cache_ptr + cell + i, r1)
            tl.store(k_cache_ptr + cell + HALF + i, r2)
            vsrc = v_ptr + t * stride_v + (head - H) * D
            tl.store(v_cache_ptr + cell + i, tl.load(vsrc + i))
            tl.store(v_cache_ptr + cell + HALF + i, tl.load(vsrc + HALF + i))

    globals()["_norm_columns"] = _norm_columns  # called by name, as settle is
    globals()["_rotate_inputs"] = _rotate_inputs
    return {"gemv": gemv_kernel, "expert_down_sum": expert_down_sum_kernel, "skinny": skinny_kernel,
            "attention_partial": attention_partial_kernel, "attention_combine": attention_combine_kernel,
            "route": route_kernel, "norm_rotate_store": norm_rotate_store_kernel, "rms_norm": rms_norm_kernel}


def projection_kernel(x: torch.Tensor, w: torch.Tensor) -> str | None:
    """The name of the kernel for x @ w^T ("gemv" for one row, "skinny" for up to SKINNY_MAX_ROWS), or
    None for other shapes and layouts."""
    if x.dim() != 2 or x.stride(1) != 1 or w.stride(1) != 1:
        return None
    if x.shape[0] == 1:
        return "gemv"
    return "skinny" if x.shape[0] <= SKINNY_MAX_ROWS else None


#: (BLOCK_N, BLOCK_K, num_warps) of the GEMV, plain and gate/up. Swept on the H200 over 1..8 rows, 128..1024
#: columns a program and 1..4 warps, on the 8B and 30B-A3B shapes' projections (tools/gemv_sweep.py,
#: bench/results/gemv-sweep-h200.json): the least total time of the plain ones (8B q/k/v + o + down 50.6 us
#: against 52.1 for the former (2, 512, 2)) and of the 8B gate/up (48.2 us against 51.3 for (2, 512, 4)).
GEMV_CONFIG = (2, 1024, 1)
GEMV_GLU_CONFIG = (1, 1024, 4)
#: (rows, columns, glu) of a matrix -> its own configuration, where the sweep's best for that shape beat the
#: defaults above: the 30B-A3B shape's q/k/v, o and router GEMVs (7.03 / 6.25 / 2.45 us against 7.31 / 6.74 /
#: 2.76 in the sweep); its step 2.523 -> 2.472 ms on the H200 (tools/pdl_ab.py --knob, one process)
GEMV_SHAPE_CONFIGS: dict[tuple[int, int, bool], tuple[int, int, int]] = {
    (5120, 2048, False): (2, 512, 2), (2048, 4096, False): (2, 1024, 4), (128, 2048, False): (2, 1024, 4)}


def gemv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, glu: bool = False,
         config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """x [1, K] @ w[N, K]^T (+ b) -> [1, N]; with glu, w stacks gate and up rows ([2I, K]) and the result
    is silu(gate) * up [1, I]."""
    n_total, k = w.shape
    n = n_total // 2 if glu else n_total
    y = torch.empty(*x.shape[:-1], n, device=x.device, dtype=x.dtype)
    block_n, block_k, warps = config or GEMV_SHAPE_CONFIGS.get((n_total, k, glu)) or \
        (GEMV_GLU_CONFIG if glu else GEMV_CONFIG)
    _build()["gemv"][(cdiv(n, block_n), 1)](
        x, w, w, b if b is not None else w, y, n, k, 0, 0, w.stride(0), 0, n * w.stride(0), HAS_BIAS=b is not None,
        GLU=glu, EXPERTS=False, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
        **pdl.options(x.device))
    return y


#: assignments (row, expert pairs) up to which experts run as per-assignment GEMVs (decode, verify windows)
EXPERT_GEMV_MAX = 256
#: (BLOCK_N, BLOCK_K, num_warps) of those GEMVs over an expert's gate/up and over its down matrix: the sweep's
#: best for a 30B-A3B layer's 8 experts at 1 row (50.0 and 50.8 us a layer, each with the other at its
#: former (2, 512, 4) / (2, 512, 2), against 51.7 and 51.8 with both at those)
EXPERT_GLU_CONFIG = (1, 512, 2)
EXPERT_DOWN_CONFIG = (4, 128, 1)


def experts(h: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
            experts: torch.Tensor, reduce=None, grouped: bool | None = None, sum_slots=None) -> torch.Tensor:
    """ops.experts_routed's contract, for a few rows: every (row, expert) assignment a GEMV over its expert's
    gate/up (silu(gate) * up written directly), then over its down matrix, reading only the experts hit; each
    row's outputs summed in ascending expert order as ops.sum_slots sums them, by the down GEMVs themselves
    (EXPERT_DOWN_SUMS: two launches in all), or after them by `reduce` (its contract: the host's outputs
    merged first). grouped (the default past EXPERT_GROUP_MIN_ROWS rows): each expert hit once for all its
    rows (_experts_grouped), then summed by reduce or sum_slots (default ops.sum_slots; the compiled set
    passes its fused one)."""
    from . import ops

    n, k = experts.shape
    flat = experts.reshape(-1).contiguous()
    summed = reduce or sum_slots or ops.sum_slots
    if grouped if grouped is not None else n > EXPERT_GROUP_MIN_ROWS:
        return summed(_experts_grouped(h, gate_up, down, flat, k), weights, h.dtype)
    _, _, inter, hidden = gate_up.shape
    kernels = _build()
    h = h.contiguous()  # each row read in place by its k assignments
    act = torch.empty(n * k, inter, device=h.device, dtype=h.dtype)
    block_n, block_k, warps = EXPERT_GLU_CONFIG
    kernels["gemv"][(cdiv(inter, block_n), n * k)](
        h, gate_up, flat, gate_up, act, inter, hidden, h.stride(0), gate_up.stride(1), gate_up.stride(2),
        act.stride(0), gate_up.stride(0), HAS_BIAS=False, GLU=True, EXPERTS=True, BLOCK_N=block_n, BLOCK_K=block_k,
        SHARE=k, num_warps=warps, **pdl.options(h.device))
    if reduce is None and EXPERT_DOWN_SUMS:
        out = torch.empty(n, hidden, device=h.device, dtype=h.dtype)
        block_n, block_k, warps = EXPERT_DOWN_SUM_CONFIG
        kernels["expert_down_sum"][(cdiv(hidden, block_n), n)](
            act, down, flat, weights.contiguous(), out, hidden, inter, act.stride(0), down.stride(0),
            down.stride(1), out.stride(0), SLOTS=k, SLOTS_P2=pow2(k), BLOCK_N=block_n, BLOCK_K=block_k,
            num_warps=warps, **pdl.options(h.device))
        return out
    y = torch.empty(n * k, hidden, device=h.device, dtype=h.dtype)
    block_n, block_k, warps = EXPERT_DOWN_CONFIG
    kernels["gemv"][(cdiv(hidden, block_n), n * k)](
        act, down, flat, down, y, hidden, inter, act.stride(0), down.stride(0), down.stride(1), y.stride(0), 0,
        HAS_BIAS=False, GLU=False, EXPERTS=True, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
        **pdl.options(h.device))
    return summed(y.view(n, k, hidden), weights, h.dtype)


#: whether a row's experts are summed by their down GEMVs (expert_down_sum_kernel) rather than by a launch
#: of its own after them: a 30B-A3B step on the H200 2.507 / 2.508 -> 2.473 ms, W=8 8.621 / 8.630 -> 8.545
#: (tools/pdl_ab.py --knob, one process)
EXPERT_DOWN_SUMS = True
#: (BLOCK_N, BLOCK_K, num_warps) of expert_down_sum_kernel, a program holding all of a row's slots: the
#: sweep's best for a 30B-A3B layer's experts at one row, 21.9 us with the gate/up GEMV against 22.4 for the
#: GEMVs and a compiled sum (bench/results/expert-down-sum-sweep-h200.json)
EXPERT_DOWN_SUM_CONFIG = (1, 128, 1)


def _experts_grouped(h: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, flat: torch.Tensor,
                     k: int) -> torch.Tensor:
    """The outputs [N, k, H] of a window's (row, expert) assignments `flat` (row-major), each expert hit
    read once: the union of the rows' experts, not one copy per assignment."""
    n = h.shape[0]
    _, _, inter, hidden = gate_up.shape
    se, perm = torch.sort(flat, stable=True)
    dup = max(16, pow2(n))  # an expert serves each row at most once
    kernels = _build()
    act = torch.empty(n * k, inter, device=h.device, dtype=h.dtype)
    y = torch.empty(n * k, hidden, device=h.device, dtype=h.dtype)
    block_n, block_k, warps = EXPERT_GROUP_CONFIG
    for x, w, out, rows, cols, krow, glu in ((h, gate_up, act, inter, hidden, k, True),
                                              (act, down, y, hidden, inter, 1, False)):
        kernels["skinny"][(cdiv(rows, block_n), n * k)](
            x, w, w, out, se, perm, n * k, rows, cols, x.stride(0), w.stride(-2), out.stride(0), w.stride(-3),
            w.stride(0) if glu else 0, HAS_BIAS=False, GLU=glu, EXPERTS=True, KROW=krow, BLOCK_M=dup,
            BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=precision(h), num_warps=warps, **pdl.options(h.device))
    return y.view(n, k, hidden)


#: (BLOCK_N, BLOCK_K, num_warps) of the skinny kernel over a window's experts (the grouped expert path)
EXPERT_GROUP_CONFIG = (64, 128, 4)
#: per layer of the 30B-A3B shape on the H200 (random routing), per assignment vs grouped: 2 rows 68 vs 72 us,
#: 4 rows 106 vs 114, 8 rows 180 vs 176, 16 rows 318 vs 233: grouped from 9 rows on
EXPERT_GROUP_MIN_ROWS = 8


def route_topk(logits: torch.Tensor, top_k: int, renormalize: bool):
    """ops.route after the router's logits [N, E], in one launch: (weights [N, k] in the logits' dtype,
    experts [N, k] int64), each row's pairs in ascending expert order."""
    n, e = logits.shape
    weights = torch.empty(n, top_k, device=logits.device, dtype=logits.dtype)
    experts = torch.empty(n, top_k, device=logits.device, dtype=torch.long)
    _build()["route"][(n,)](logits, weights, experts, e, logits.stride(0), K=top_k,
                            KP=max(2, pow2(top_k)), BLOCK_E=max(16, pow2(e)),
                            RENORM=renormalize, num_warps=1, **pdl.options(logits.device))
    return weights, experts


def experts_fit(gate_up: torch.Tensor, down: torch.Tensor, experts: torch.Tensor) -> bool:
    """experts' layout: contiguous stacked matrices, few enough assignments."""
    return experts.numel() <= EXPERT_GEMV_MAX and gate_up.is_contiguous() and down.is_contiguous()


#: (BLOCK_N, BLOCK_K, num_warps, num_stages) of the few-row GEMM (a verify window, a drafter block): the
#: least total time over the 8B shape's projections at 8 rows on the H200 (bench/results/triton-skinny-h200.json).
SKINNY_CONFIG = (64, 256, 4, 4)
#: past 16 rows cuBLAS: at 33 and 64 rows of the 8B shape it was faster than every configuration swept
#: over all the projections (bench/results/skinny-sweep-h200.json); the sweep's best for the gate/up and
#: the LM head alone (a 10-13% win in isolation) made a 33-row tree verify no faster
SKINNY_MAX_ROWS = 16


def skinny(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, glu: bool = False,
           config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """x [M, K] @ w[N, K]^T (+ b) -> [M, N] for a few rows (glu as in gemv), where cuBLAS would split K
    and reduce in a second kernel."""
    rows, k = x.shape
    n_total = w.shape[0]
    n = n_total // 2 if glu else n_total
    y = torch.empty(rows, n, device=x.device, dtype=x.dtype)
    block_n, block_k, warps, stages = config or SKINNY_CONFIG
    block_m = max(16, pow2(rows))
    if x.element_size() == 4:
        stages = fitting_stages(stages, (block_n * (2 if glu else 1) + block_m) * block_k * 4)
    _build()["skinny"][(cdiv(n, block_n), 1)](
        x, w, b if b is not None else w, y, w, w, rows, n, k, x.stride(0), w.stride(0), y.stride(0), 0,
        n * w.stride(0), HAS_BIAS=b is not None, GLU=glu, EXPERTS=False, KROW=1,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=precision(x),
        num_warps=warps, num_stages=stages, **pdl.options(x.device))
    return y


#: shared memory a program's pipelined tiles may take (an H200 block can have 227 KiB)
SHARED_BYTES = 200 << 10


def fitting_stages(stages: int, stage_bytes: int) -> int:
    """Pipeline stages whose tiles fit SHARED_BYTES, Triton buffering stages - 1 of them: float32 dots (full
    precision) stage both operands, stage_bytes a step (compiled for sm_90, the default skinny tiles
    took 245760 bytes at 4 stages, 442368 with gate/up: past the limit, so a float32 model's few-row
    products left for cuBLAS; 163840 at 3 and 147456 at 2); 16-bit ones far less, so they keep theirs."""
    return max(2, min(stages, 1 + SHARED_BYTES // stage_bytes))


def precision(x: torch.Tensor) -> str:
    """float32 models keep full-precision dots (Triton's default would round their inputs to TF32)."""
    return "ieee" if x.dtype == torch.float32 else "tf32"


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def pow2(n: int) -> int:
    """The smallest power of two >= n (>= 1): Triton's block shapes."""
    return 1 << max(n - 1, 0).bit_length()


#: the small kernels of a layer read before their PDL wait what no kernel of the layer writes: rms_norm its
#: weights, norm_rotate_store its norm weights and its row's cos and sin, attention_partial the K and V rows of
#: its chunk's first cells (asked into L2; a cell the kernel ahead writes is read again after the wait). Data
#: written two or more kernels back is complete by then: the kernel ahead let this one launch only after its
#: own wait. Q4_K_M 8B shape, one H100, off / on alternated twice in one process (tools/pdl_ab.py,
#: bench/results/pre-wait-loads-ab-h100.json): a 1-row step 2.463 / 2.465 ms -> 2.430 / 2.429, a 16-row verify
#: 4.487 / 4.484 -> 4.463 / 4.467; outputs identical
PRE_WAIT_LOADS = True
ATTENTION_BLOCK = 64  # cells a program's loop step reads
ATTENTION_TARGET_SPLITS = 16
ATTENTION_MAX_ROWS = 64  # query rows (window rows x heads of a group) one program holds
#: the head dim the two sizes above are for; a larger one shrinks both in proportion (at 256, 64 x 64 tiles
#: pipelined over three stages need 232 KiB of shared memory, more than an H200 has)
ATTENTION_TILE_DIM = 128


def attention_tiles(d: int) -> tuple[int, int]:
    """(query rows a program holds, cells a loop step reads) at head dim d."""
    shrink = max(1, d // ATTENTION_TILE_DIM)
    return max(16, ATTENTION_MAX_ROWS // shrink), max(16, ATTENTION_BLOCK // shrink)


def attention_fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> bool:
    """attention's layout: a power-of-two head dim, plain cache rows shared by k and v, contiguous mask
    rows, and a query group within ATTENTION_MAX_ROWS."""
    _, h, d = q.shape
    return (d >= 16 and d & (d - 1) == 0 and k.stride(-1) == 1 and k.stride(-2) == d and v.stride() == k.stride()
            and h // k.shape[-2] <= attention_tiles(d)[0] and mask.stride(-1) == 1)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
              quantize: bool = False) -> torch.Tensor:
    """ops.attend_grouped's contract: q [T, H, D]; k, v [S, Hkv, D] (rows of a cache layer); mask [T, S]
    bool (True = visible). Returns [T, H*D]. Every query must see at least one cell. More query rows than
    a program holds (a tree's verify) are split over programs too, in the same launch. quantize (up to
    ATTENTION_QUANTIZE_ROWS rows, 32 | D): the output also quantized for the int8-x product that reads it
    next (as rms_norm's)."""
    from . import quant_kernels as qk

    t, h, d = q.shape
    s, hk, _ = k.shape
    g = h // hk
    max_rows, block = attention_tiles(d)
    rows = min(max_rows, max(16, pow2(t * g)))
    row_blocks = cdiv(t * g, rows)
    blocks = cdiv(s, block)
    # the programs' count, and their float32 partials, stay near a decode's when row blocks multiply them
    chunk = block * cdiv(blocks, max(1, ATTENTION_TARGET_SPLITS // row_blocks))
    splits = cdiv(s, chunk)
    kernels = _build()
    o = torch.empty(hk, splits, row_blocks * rows, d, device=q.device, dtype=torch.float32)
    m = torch.empty(hk, splits, row_blocks * rows, device=q.device, dtype=torch.float32)
    l = torch.empty_like(m)
    q = q.contiguous()
    kernels["attention_partial"][(hk, splits, row_blocks)](
        q, k, v, mask, o, m, l, s, k.stride(0), mask.stride(0), chunk, d ** -0.5, T=t, G=g, HK=hk, D=d, R=rows,
        RT=row_blocks * rows, BLOCK_S=block, PRECISION=precision(q), PREWAIT=PRE_WAIT_LOADS, num_warps=4,
        **pdl.options(q.device))
    out = torch.empty(t, h * d, device=q.device, dtype=q.dtype)
    quantize = quantize and t <= ATTENTION_QUANTIZE_ROWS and d % 32 == 0
    buffers, mp, sums = qk.x8_buffers(t, h * d, q.device) if quantize else ((out, out, out), t, 16)
    kernels["attention_combine"][(hk, mp * g)](o, m, l, out, *buffers, splits, t, mp, G=g, HK=hk, D=d,
                                               RT=row_blocks * rows, SPLITS=max(2, pow2(splits)), QUANT=quantize,
                                               SUMS=sums, num_warps=2, **pdl.options(q.device))
    if quantize:
        qk.remember_x8(out, buffers)
    return out


#: rows up to which the norms run on rms_norm_kernel (a decode step, a verify window, a drafter block; 0:
#: never); hidden sizes up to NORM_MAX_DIM
NORM_MAX_ROWS = 64
NORM_MAX_DIM = 16384
#: rows up to which a norm (or attention, at one row) whose output goes into an int8-x product quantizes it
#: in its own launch (quant_kernels.quantize_x; 0: never). H200, Q4_K_M 8B shape, ms a step with and without
#: the norms doing it, a program a row: 1 row 2.419 against 2.458; 16 rows 5.192 against 5.143 (16 programs
#: each quantizing a whole row lost to quantize_x's 64); the norms and attention at 1 row, 2.321 against 2.401.
#: With a row's columns spread over programs (NORM_CHUNK) 16 rows gain too (below)
QUANTIZE_ROWS = 16
#: query rows up to which attention (its combining programs) quantizes its output for an int8-x o projection
#: (one row: in the 2.321 ms step above; 16, the padded x of the few-row GEMMs: an H100 verify 5.091 / 5.087
#: ms against 5.133 / 5.138, bench/results/verify-quantize-ab-h100.json)
ATTENTION_QUANTIZE_ROWS = 16
#: columns of a row each rms_norm program writes and quantizes (a power of two; 0: the whole row), every
#: program reading the whole row for its sum of squares. H100, Q4_K_M 8B shape, one process, two alternations
#: (bench/results/norm-chunk-ab-h100.log): a row a program 2.620 / 2.619 ms a 1-row step, 5.229 / 5.232 a
#: 16-row verify; 512 columns a program and 16-row norms quantizing 2.594 / 2.593 and 5.200 / 5.213; outputs
#: identical
NORM_CHUNK = 512


def norm_fits(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor) -> bool:
    """rms_norm's shapes: as many rows as NORM_MAX_ROWS of at most NORM_MAX_DIM, a residual of x's shape and type."""
    h = x.shape[-1]
    return (0 < x.numel() // max(h, 1) <= NORM_MAX_ROWS and h <= NORM_MAX_DIM and weight.shape == (h,)
            and (residual is None or (residual.shape == x.shape and residual.dtype == x.dtype)))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             quantize: bool = False):
    """ops.rms_norm (residual None) or ops.add_rms_norm (returning (x + residual, normed)) in one launch,
    NORM_CHUNK columns of a row a program. quantize: the normed rows also quantized for the int8-x product
    that reads them next (quant_kernels.quantize_x's result, remembered for it: one launch fewer)."""
    from . import quant_kernels as qk

    h = x.shape[-1]
    flat, r = (t.reshape(-1, h) if t.stride(-1) == 1 else t.reshape(-1, h).contiguous()
               for t in (x, x if residual is None else residual))
    rows = flat.shape[0]
    out = torch.empty(x.shape, device=x.device, dtype=torch.promote_types(x.dtype, weight.dtype))
    total = torch.empty(x.shape, device=x.device, dtype=x.dtype) if residual is not None else out
    buffers, programs, sums = qk.x8_buffers(rows, h, x.device) if quantize else ((out, out, out), rows, 16)
    block = pow2(h)
    chunk = min(block, max(32, NORM_CHUNK)) if NORM_CHUNK else block
    _build()["rms_norm"][(programs, block // chunk)](
        flat, r, weight, total.view(-1, h), out.view(-1, h), *buffers, rows, h, h // 32, programs, eps,
        flat.stride(0), r.stride(0), h, h, ADD=residual is not None, QUANT=quantize, SUMS=sums, BLOCK=block,
        CHUNK=chunk, PREWAIT=PRE_WAIT_LOADS, num_warps=max(1, min(8, block // 512)), **pdl.options(x.device))
    if quantize:
        qk.remember_x8(out, buffers)
    return out if residual is None else (total, out)


def norm_rotate_store_fits(qk: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """norm_rotate_store's layout: heads contiguous within a row, a power-of-two head dim, caches alike."""
    d = qk.shape[-1]
    return (qk.stride(-1) == 1 and qk.stride(-2) == d and v.stride(-1) == 1 and v.stride(-2) == d
            and d & (d - 1) == 0 and k_cache.stride() == v_cache.stride())


def norm_rotate_store(qk: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                      cos: torch.Tensor, sin: torch.Tensor, eps: float, heads: int, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, cells: torch.Tensor) -> torch.Tensor:
    """ops.norm_rotate_store in one launch: qk [T, H + Hkv, D], v [T, Hkv, D], q_weight/k_weight [D],
    cos/sin [T, 1, D]; k_cache/v_cache [cells, Hkv, D]. qk and v may be row slices of one projection
    output (heads contiguous within a row). Returns q [T, H, D]."""
    t, heads_total, d = qk.shape
    assert norm_rotate_store_fits(qk, v, k_cache, v_cache)
    q = torch.empty(t, heads, d, device=qk.device, dtype=qk.dtype)
    _build()["norm_rotate_store"][(t, heads_total)](
        qk, v, q_weight.contiguous(), k_weight.contiguous(), cos.contiguous(), sin.contiguous(), cells, q, k_cache,
        v_cache, eps,
        qk.stride(0), v.stride(0), k_cache.stride(0), H=heads, HK=heads_total - heads, HALF=d // 2,
        PREWAIT=PRE_WAIT_LOADS, num_warps=1, **pdl.options(qk.device))
    return q
