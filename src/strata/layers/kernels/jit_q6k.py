"""Q6_K over int8 x: the lanes-along-K GEMV (its 210-byte superblocks read through 16-byte windows) and
the few-row GEMM (superblocks in pairs)."""

from __future__ import annotations

import triton
import triton.language as tl

from .jit_common import _bytes, _dp4a, _funnel, _half2, _minus32, _words, settle
from .jit_word import (_assignment, _finish, _gemm_rows, _k_range, _lane_rows, _lane_superblocks, _prefetch_rows,
                       _store_lane_rows, _x_scales)


@triton.jit
def _q6_bits(ql, qh, m):
    """The 6-bit values of quarter m of a Q6_K half-superblock, a byte each: low 4 bits from ql (the low
    nibbles for m < 2, else the high), high 2 from bits 2m of qh."""
    if m == 0:
        hs = qh << 4
    elif m == 1:
        hs = qh << 2
    elif m == 2:
        hs = qh
    else:
        hs = qh >> 2
    return ((ql >> (4 * (m // 2))) & 0x0F0F0F0F) | (hs & 0x30303030)


@triton.jit
def _window16(w32, at, total, i, ASM: tl.constexpr):
    """The 4 words of the 16 bytes from byte `at` (even) of w32, for lanes whose `at` differ: the two
    aligned 16-byte chunks around them loaded whole (none past byte total), their words rotated by at's
    word within the first and shifted by its half word."""
    chunk = tl.multiple_of((at >> 4) * 4, (4, 4))[:, :, None]
    W = _words(tl.load(w32 + chunk + i)) + \
        _words(tl.load(w32 + chunk + 4 + i, mask=(chunk + 8) * 4 <= total, other=0))  # rows end on 16 bytes
    dw = (at >> 2) & 3
    V = ()
    for k in tl.static_range(7):
        V += (tl.where((dw & 1) != 0, W[k + 1], W[k]),)
    U = ()
    for k in tl.static_range(5):
        U += (tl.where((dw & 2) != 0, V[k + 2], V[k]),)
    shift = (at & 2) * 8
    return (_funnel(U[0], U[1], shift, ASM), _funnel(U[1], U[2], shift, ASM),
            _funnel(U[2], U[3], shift, ASM), _funnel(U[3], U[4], shift, ASM))


@triton.jit
def _words_from(w32, base, k0: tl.constexpr, n: tl.constexpr, odd):
    """[R, n] 32-bit words of bytes 4 k0 .. of superblocks that start at word base [R] (odd: 2 bytes later)."""
    at = w32 + base[:, None] + k0 + tl.arange(0, n)[None, :]
    a = tl.load(at)
    if odd:
        a = (a >> 16) | (tl.load(at + 1) << 16)
    return a


@triton.jit
def gemv_q6k8c_kernel(q_ptr, xd_ptr, xs_ptr, w_ptr, y_ptr, N, K, row_bytes, GLU: tl.constexpr,
                      RT: tl.constexpr, WARPS: tl.constexpr, KU: tl.constexpr, ASM: tl.constexpr,
                      QTYPE: tl.constexpr, PDL: tl.constexpr = False, ids_ptr=None, expert_bytes=0,
                      stride_y=0, EXPERTS: tl.constexpr = False, SHARE: tl.constexpr = 1,
                      KS: tl.constexpr = 1, PREFETCH: tl.constexpr = 0):
    """Q6_K times an int8 x (quantize_x_kernel) with lanes along K, as gemv_q4k8c_kernel: a warp reads 4
    superblocks of a row at once, lane l the 16 ql bytes 16 c (c = l % 8) of superblock l // 8 (the low
    4 bits of 16 weights of the quarters mq = part and part + 2 of half h2, c = 4 h2 + 2 part + lh) and
    the 16 qh bytes with their high 2 bits. Superblocks are 210 bytes, so those 16 bytes start at any
    even byte: each lane loads the two aligned 16-byte chunks around them (the warp's loads are runs of
    consecutive chunks) and picks its words (_window16); rows (row_bytes apart) may start at any even
    byte too. Then per 16 weights an integer dot product with
    x (4 dp4a) and d * sc * (xd * dot - 32 * sum of x). EXPERTS: see _assignment."""
    if EXPERTS:
        w_ptr, q_ptr, xd_ptr, xs_ptr, y_ptr = _assignment(w_ptr, q_ptr, xd_ptr, xs_ptr, y_ptr, ids_ptr,
                                                           expert_bytes, K, stride_y, SHARE, PDL)
    w32 = w_ptr.to(tl.pointer_type(tl.uint32))
    i8 = w_ptr.to(tl.pointer_type(tl.int8))
    f16 = w_ptr.to(tl.pointer_type(tl.float16))
    q32 = q_ptr.to(tl.pointer_type(tl.int32))
    c = tl.arange(0, 32)[None, :] % 8  # which 16 bytes of its superblock a lane takes
    h2 = c // 4
    part = (c // 2) % 2
    lh = c % 2
    i = tl.arange(0, 4)[None, None, :]
    NR: tl.constexpr = 2 * RT if GLU else RT
    blocks = K // 256
    total = (2 * N if GLU else N) * row_bytes
    first, acc, bases, kpart = _lane_rows(N, row_bytes, GLU, RT, WARPS, KS)
    _prefetch_rows(w_ptr, first, N, row_bytes, GLU, RT, WARPS, KS, PREFETCH, ASM)
    settle(PDL)
    for it in range(0, blocks, 4 * KU * KS):
        xs = ()
        for u in tl.static_range(KU):
            live, sbc = _lane_superblocks(it + 4 * (u * KS + kpart), blocks, WARPS)
            xw = tl.multiple_of(sbc * 64 + 32 * h2 + 8 * part + 4 * lh, (4, 4))[:, :, None]
            blk = sbc * 8 + 4 * h2 + part  # the x block of quarter part; part + 2's is blk + 2
            xs += ((live, sbc * 210, _words(tl.load(q32 + xw + i)), _words(tl.load(q32 + xw + 16 + i)),
                    tl.load(xd_ptr + blk), tl.load(xd_ptr + blk + 2),
                    tl.load(xs_ptr + 2 * blk + lh), tl.load(xs_ptr + 2 * blk + 4 + lh)),)
        nxt = ()
        for r in tl.static_range(NR):
            a = acc[r]
            for u in tl.static_range(KU):
                live, off, xlo, xhi, xdl, xdh, xsl, xsh = xs[u]
                at = bases[r] + off
                ql = _window16(w32, at + 16 * c, total, i, ASM)
                qh = _window16(w32, at + 128 + 32 * h2 + 16 * lh, total, i, ASM)
                scl = tl.load(i8 + at + 192 + 8 * h2 + 2 * part + lh).to(tl.float32)
                sch = tl.load(i8 + at + 196 + 8 * h2 + 2 * part + lh).to(tl.float32)
                d = tl.where(live, tl.load(f16 + (at + 208) // 2).to(tl.float32), 0.0)
                ilo = tl.zeros([WARPS, 32], dtype=tl.int32)
                ihi = tl.zeros([WARPS, 32], dtype=tl.int32)
                for w in tl.static_range(4):
                    t = qh[w] >> (2 * part)  # bits 4, 5 of quarter part's weights at 0, 1; of part + 2's at 4, 5
                    lo = (ql[w] & 0x0F0F0F0F) | ((t << 4) & 0x30303030)
                    hi = ((ql[w] >> 4) & 0x0F0F0F0F) | (t & 0x30303030)
                    ilo = _dp4a(lo, xlo[w], ilo, ASM)
                    ihi = _dp4a(hi, xhi[w], ihi, ASM)
                a += d * (scl * (xdl * ilo.to(tl.float32) - 32.0 * xsl)
                          + sch * (xdh * ihi.to(tl.float32) - 32.0 * xsh))
            nxt += (a,)
        acc = nxt
    _store_lane_rows(y_ptr, acc, first, N, GLU, RT, WARPS, KS)


@triton.jit
def skinny_q6k8_kernel(q_ptr, ds_ptr, w_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K, row_words, stride_y,
                       GLU: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, ASM: tl.constexpr,
                       STAGES: tl.constexpr):
    """Q6_K times a few rows of int8 x (quantize_x) on integer tensor cores, as its GEMV computes: a quarter
    of a half superblock (weights 128 h2 + 32 mq + l) is one x block; its values q - 32 in BLOCK_N rows, as
    int8, are dotted with the block's two halves (the other half zeroed) for its two sub-blocks of 16,
    whose int32 sums are weighted by their int8 scales in integers, then scaled by xd; d once a
    superblock. Superblocks in pairs from 4-byte boundaries (512 | K), odd ones' words assembled from two."""
    rows, offs, w32 = _gemm_rows(w_ptr, N, row_words, BLOCK_N)
    pos = tl.arange(0, 32)[:, None]
    c = tl.arange(0, 32)[None, :]  # x's block as [32, 32]: its rows' first halves, then their second halves
    xcols = q_ptr + (c % 16) * K + pos
    xhalf = (pos < 16) == (c < 16)
    acc = (tl.zeros([BLOCK_N, 16], dtype=tl.float32), tl.zeros([BLOCK_N, 16], dtype=tl.float32))
    lo, hi = _k_range(K // 512, SPLIT)
    for sb2 in tl.range(lo, hi, num_stages=STAGES):
        for odd in tl.static_range(2):
            sb = 2 * sb2 + odd
            heads = ()
            for s in tl.static_range(2 if GLU else 1):
                base = offs[s] + sb2 * 105 + 52 * odd
                scw = _words(_words_from(w32, base, 48, 4, odd).to(tl.int32, bitcast=True))  # 16 int8 scales
                dword = tl.load(w32 + base + 52)  # d: bytes 208, 209 (of an odd one: the word's high half)
                d, _ = _half2(dword >> 16 if odd else dword, True)
                heads += ((base, scw, d),)
            part = (tl.zeros([BLOCK_N, 16], dtype=tl.float32), tl.zeros([BLOCK_N, 16], dtype=tl.float32))
            for h2 in tl.static_range(2):
                bits = ()
                for s in tl.static_range(2 if GLU else 1):  # low 4 bits in ql bytes 64 h2 + 32 (mq % 2) + l,
                    base = heads[s][0]  # high 2 in bits 2 mq of qh byte 32 h2 + l
                    bits += ((_words_from(w32, base, 16 * h2, 8, odd), _words_from(w32, base, 16 * h2 + 8, 8, odd),
                              _words_from(w32, base, 32 + 8 * h2, 8, odd)),)
                for mq in tl.static_range(4):
                    j = 8 * sb + 4 * h2 + mq
                    x2 = tl.load(xcols + 32 * j, mask=xhalf, other=0)
                    xd, _ = _x_scales(ds_ptr, j)
                    nxt = ()
                    for s in tl.static_range(2 if GLU else 1):
                        qb = _bytes(_minus32(_q6_bits(bits[s][mq % 2], bits[s][2], mq)), ASM)
                        sw = heads[s][1][2 * h2 + mq // 2]  # scales 8 h2 + 2 mq, + 1: its bytes 2 (mq % 2), + 1
                        sc_lo = (sw << (24 - 16 * (mq % 2))) >> 24
                        sc_hi = (sw << (16 - 16 * (mq % 2))) >> 24
                        ilo, ihi = tl.split(tl.permute(tl.reshape(tl.dot(qb, x2, out_dtype=tl.int32),
                                                                  [BLOCK_N, 2, 16]), (0, 2, 1)))
                        isum = ilo * sc_lo[:, None] + ihi * sc_hi[:, None]
                        nxt += (tl.fma(isum.to(tl.float32), xd[None, :], part[s]),)
                    part = nxt if GLU else (nxt[0], part[1])
            nxt = ()
            for s in tl.static_range(2 if GLU else 1):
                nxt += (tl.fma(part[s], heads[s][2][:, None], acc[s]),)
            acc = nxt if GLU else (nxt[0], acc[1])
    _finish(y_ptr, ws_ptr, cnt_ptr, (tl.trans(acc[0]), tl.trans(acc[1])), rows, M, N, stride_y, GLU, SPLIT)
