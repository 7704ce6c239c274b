"""Q4_K, Q5_K, IQ4_XS and Q4_0 over int8 x: the lanes-along-K GEMV and the few-row GEMM on integer tensor
cores, and IQ4_XS's non-linear levels by byte permutes."""

from __future__ import annotations

import triton
import triton.language as tl

from .jit_common import (IQ4_XS, Q4_0, Q5_K, _byte_times, _bytes, _columns, _dp4a, _f, _funnel, _half2, _joined4,
                         _prmt, _words, settle)
from .jit_word import (_assignment, _finish, _gemm_rows, _k_range, _lane_rows, _lane_superblocks, _prefetch_rows,
                       _store_lane_rows, _unstacked, _x_block)
from .qtypes import IQ4_WORDS

#: IQ4_XS's 16 levels as int8, 4 to a little-endian int32 (the byte permutes' table), as constants
IQ4_W0, IQ4_W1, IQ4_W2, IQ4_W3 = (tl.constexpr(w) for w in IQ4_WORDS)


@triton.jit
def _iq4_table(q):
    """IQ4_WORDS, each word as a tensor shaped as q."""
    return (tl.full(q.shape, IQ4_W0, tl.int32), tl.full(q.shape, IQ4_W1, tl.int32),
            tl.full(q.shape, IQ4_W2, tl.int32), tl.full(q.shape, IQ4_W3, tl.int32))


@triton.jit
def _iq4_registers(K):
    """_iq4_table's words as values the compiler cannot fold (K >> 31 is 0: K > 0), made once before a K
    loop: as constants, ptxas copied one into a register before each of its prmts (0.44 instructions a
    weight of the GEMV, sm_90)."""
    zero = K >> 31
    return zero + IQ4_W0, zero + IQ4_W1, zero + IQ4_W2, zero + IQ4_W3


@triton.jit
def _iq4_pairs(q, ASM: tl.constexpr, LOOKUP: tl.constexpr = True, table=None):
    """IQ4_XS's levels (as int8) of words q of 8 nibbles, in two words: those of bytes 0 and 1's low,
    high, low, high nibbles, then bytes 2 and 3's. Each table half (levels 0-7, 8-15) is two words that a
    prmt indexes by the nibbles' low 3 bits; a third picks per byte by their fourth. The interpreter
    (not ASM) looks them up in fewer ops unless not LOOKUP (a test's check of the prmts)."""
    q = q.to(tl.int32, bitcast=True)
    if not ASM and LOOKUP:
        return _iq4_bytes(q, 0, 4), _iq4_bytes(q, 16, 4)
    t0, t1, t2, t3 = _iq4_table(q) if table is None else table
    low3 = q & 0x77777777  # a prmt reads its selector's low 16 bits: each half's selectors by one shift
    pick = ((q >> 1) & 0x44444444) | 0x32103210
    out = ()
    for half in tl.static_range(2):
        s = low3 >> (16 * half)
        out += (_prmt(_prmt(t0, t1, s, ASM), _prmt(t2, t3, s, ASM), pick >> (16 * half), ASM),)
    return out


@triton.jit
def _iq4_levels(q, ASM: tl.constexpr, LOOKUP: tl.constexpr = True, table=None):
    """_iq4_pairs in weight order: the levels of q's 4 low nibbles (bytes 0-3), then of its 4 high ones."""
    if not ASM and LOOKUP:
        q = q.to(tl.int32, bitcast=True)
        return _iq4_bytes(q, 0, 8), _iq4_bytes(q, 4, 8)
    a, b = _iq4_pairs(q, ASM, LOOKUP, table)
    return _prmt(a, b, a * 0 + 0x6420, ASM), _prmt(a, b, a * 0 + 0x7531, ASM)


@triton.jit
def _iq4_bytes(q, first: tl.constexpr, step: tl.constexpr):
    """For the interpreter (fewer ops than the prmts spelled out): a word of the levels of q's nibbles at
    bits first + step i, i = 0..3, looked up in _iq4_table's words as the prmts do."""
    n = (tl.expand_dims(q, -1) >> (first + step * tl.arange(0, 4))) & 0xF
    t0, t1, t2, t3 = _iq4_table(n)
    word = tl.where(n < 8, tl.where(n < 4, t0, t1), tl.where(n < 12, t2, t3))
    return tl.sum(((word >> (8 * (n & 3))) & 0xFF) << (8 * tl.arange(0, 4)), axis=-1)


@triton.jit
def _q40_block(W, j: tl.constexpr):
    """Q4_0 block j of a step's 36 words W (columns [R]): its d (the low half of word 4 j + j // 2 for even
    j, the high half for odd j) and its 16 bytes of qs after it as [R, 4] words (for even j, 2 bytes into
    a word: each a funnel of two)."""
    at: tl.constexpr = 4 * j + j // 2
    q = ()
    for t in tl.static_range(4):
        q += (W[at + 1 + t] if j % 2 else (W[at + t] >> 16) | (W[at + 1 + t] << 16),)
    return _half2(W[at] >> (16 * (j % 2)), True)[0], _joined4(q[0], q[1], q[2], q[3])


@triton.jit
def _nibble_dot(lo, hi, xt, ASM: tl.constexpr):
    """The int8 dot of a sub-block's 32 values in rows of 4 words of its low nibbles' values (weights
    0-15), then 4 of its high ones' ([R, 4] each, one byte a value), with its x block xt [32, 16]."""
    nib = tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 1)), [lo.shape[0], 8])
    return tl.dot(_bytes(nib, ASM), xt, out_dtype=tl.int32)


@triton.jit
def gemv_q4k8c_kernel(q_ptr, xd_ptr, xs_ptr, w_ptr, y_ptr, N, K, row_words, GLU: tl.constexpr,
                      RT: tl.constexpr, WARPS: tl.constexpr, KU: tl.constexpr, ASM: tl.constexpr,
                      QTYPE: tl.constexpr, PDL: tl.constexpr = False, ids_ptr=None, expert_bytes=0,
                      stride_y=0, EXPERTS: tl.constexpr = False, SHARE: tl.constexpr = 1,
                      KS: tl.constexpr = 1, PREFETCH: tl.constexpr = 0):
    """Q4_K (QTYPE 12), Q5_K (13), IQ4_XS (23) or Q4_0 (2) times an int8 x (quantize_x_kernel) with lanes
    along K (IQ4_XS: lane l's 16 bytes are sub-block l % 8's 32 weights, their levels by _iq4_pairs; Q4_0:
    a superblock is 8 blocks, 144 bytes, lane l taking block l % 8's 18: d (nibble - 8) xd isum); a warp reads
    4 superblocks of a row at once, lane l the 16 qs bytes 16 (l % 8) of superblock l // 8 (its 32
    weights: 16 of sub-block 2g in the low nibbles, 16 of 2g + 1 in the high, g = l % 8 // 2) and, with
    the 7 other lanes of that superblock, its 16-byte header (Q5_K: and the half of qh with their fifth
    bits). So each instruction reads 512 consecutive bytes of qs, where a thread per (row, superblock)
    touched 32 lines (its L1 and L2 requests were the GEMV's bound); each warp's x serves RT rows, KU
    steps of 4 superblocks are loaded before any is used, and the lanes' partial sums add up at the
    end. A program takes RT * WARPS rows (with GLU: as many gate rows and their up rows). EXPERTS: see
    _assignment."""
    if EXPERTS:
        w_ptr, q_ptr, xd_ptr, xs_ptr, y_ptr = _assignment(w_ptr, q_ptr, xd_ptr, xs_ptr, y_ptr, ids_ptr,
                                                           expert_bytes, K, stride_y, SHARE, PDL)
    FIVE: tl.constexpr = QTYPE == Q5_K
    IQ4: tl.constexpr = QTYPE == IQ4_XS
    Q40: tl.constexpr = QTYPE == Q4_0
    # words a superblock: d and dmin, 12 scale bytes, (qh,) qs; IQ4_XS: d and the scales' high bits, their
    # low bits, qs (8-byte aligned only); Q4_0: 8 blocks of 18 bytes, d then 16 of qs
    SB: tl.constexpr = 34 if IQ4 else 44 if FIVE else 36
    QS: tl.constexpr = 2 if IQ4 else 12 if FIVE else 4
    HI: tl.constexpr = 1.0 if FIVE else 0.0625  # the high sub-block's values: at bit 4, or in place
    w32 = w_ptr.to(tl.pointer_type(tl.uint32))
    q32 = q_ptr.to(tl.pointer_type(tl.int32))
    c = tl.arange(0, 32)[None, :] % 8  # which 16 bytes of its superblock a lane takes
    g = c // 2
    h = c % 2
    i = tl.arange(0, 4)[None, None, :]
    at = 16 * (g % 2)
    NR: tl.constexpr = 2 * RT if GLU else RT
    blocks = K // 256
    first, acc, bases, kpart = _lane_rows(N, row_words, GLU, RT, WARPS, KS)
    tab = _iq4_registers(K) if IQ4 else None
    _prefetch_rows(w_ptr, first, N, 4 * row_words, GLU, RT, WARPS, KS, PREFETCH, ASM)
    settle(PDL)
    for it in range(0, blocks, 4 * KU * KS):
        xs = ()
        for u in tl.static_range(KU):
            live, sbc = _lane_superblocks(it + 4 * (u * KS + kpart), blocks, WARPS)
            if Q40 or IQ4:  # lane c takes block (sub-block) c: x block c, its first 16 values then 16
                xw = (sbc * 64 + 8 * c)[:, :, None]
                xlo = _words(tl.load(q32 + xw + i))
                xhi = _words(tl.load(q32 + xw + 4 + i))
                xd = tl.load(xd_ptr + sbc * 8 + c)
                if IQ4:  # in _iq4_pairs' order
                    xa = ()
                    xb = ()
                    for w in tl.static_range(4):
                        xa += (_prmt(xlo[w], xhi[w], xlo[w] * 0 + 0x5140, ASM),)
                        xb += (_prmt(xlo[w], xhi[w], xlo[w] * 0 + 0x7362, ASM),)
                    xs += ((live, sbc * SB, xa, xb, xd),)
                else:  # and the block's sum
                    xs += ((live, sbc * SB, xlo, xhi, xd,
                            tl.load(xs_ptr + sbc * 16 + 2 * c) + tl.load(xs_ptr + sbc * 16 + 2 * c + 1)),)
            else:
                xw = (sbc * 64 + 16 * g + 4 * h)[:, :, None]
                xs += ((live, sbc * SB, _words(tl.load(q32 + xw + i)), _words(tl.load(q32 + xw + 8 + i)),
                        tl.load(xd_ptr + sbc * 8 + 2 * g), tl.load(xd_ptr + sbc * 8 + 2 * g + 1),
                        tl.load(xs_ptr + sbc * 16 + 4 * g + h), tl.load(xs_ptr + sbc * 16 + 4 * g + 2 + h)),)
        nxt = ()
        for r in tl.static_range(NR):
            a = acc[r]
            for u in tl.static_range(KU):
                if Q40:  # block c's 18 bytes from the word holding its start: d, then qs 2 or 4 bytes in
                    live, off, xlo, xhi, xd, xsum = xs[u]
                    at0 = bases[r] + off + 9 * c // 2
                    w = _words(tl.load(w32 + at0[:, :, None] + i)) + (tl.load(w32 + at0 + 4),)
                    d = tl.where(live, _half2(tl.where(h == 1, w[0] >> 16, w[0]), True)[0], 0.0)
                    isum = tl.zeros([WARPS, 32], dtype=tl.int32)
                    for k in tl.static_range(4):
                        q = tl.where(h == 1, w[k + 1], (w[k] >> 16) | (w[k + 1] << 16))
                        isum = _dp4a((q >> 4) & 0x0F0F0F0F, xhi[k], _dp4a(q & 0x0F0F0F0F, xlo[k], isum, ASM), ASM)
                    a += d * (xd * isum.to(tl.float32) - 8.0 * xsum)
                elif IQ4:
                    live, off, xa, xb, xd = xs[u]
                    base = tl.multiple_of(bases[r] + off, (2, 2))[:, :, None]
                    h0, h1 = tl.split(tl.load(w32 + base + tl.arange(0, 2)[None, None, :]))
                    qs = _words(tl.load(w32 + base + QS + 4 * c[:, :, None] + i))
                    d = tl.where(live, _half2(h0, True)[0], 0.0)
                    scale = _f(((h1 >> (4 * c)) & 0xF) | (((h0 >> (16 + 2 * c)) & 3) << 4)) - 32.0
                    isum = tl.zeros([WARPS, 32], dtype=tl.int32)
                    for w in tl.static_range(4):
                        pa, pb = _iq4_pairs(qs[w], ASM, True, tab)
                        isum = _dp4a(pb, xb[w], _dp4a(pa, xa[w], isum, ASM, True), ASM, True)
                    a += d * (scale * (xd * isum.to(tl.float32)))
                else:
                    live, off, xlo, xhi, xdl, xdh, xsl, xsh = xs[u]
                    base = tl.multiple_of(bases[r] + off, (4, 4))[:, :, None]
                    h0, h1, h2, h3 = _words(tl.load(w32 + base + i))
                    qs = _words(tl.load(w32 + base + QS + 4 * c[:, :, None] + i))
                    if FIVE:
                        qh = _words(tl.load(w32 + base + 4 + 4 * h[:, :, None] + i))
                    d, dmin = _half2(h0, True)
                    d = tl.where(live, d, 0.0)
                    dmin = tl.where(live, dmin, 0.0)
                    scw = tl.where(g < 2, h1 & 0x3F3F3F3F, (h3 & 0x0F0F0F0F) | ((h1 >> 2) & 0x30303030)) >> at
                    mnw = tl.where(g < 2, h2 & 0x3F3F3F3F,
                                   ((h3 >> 4) & 0x0F0F0F0F) | ((h2 >> 2) & 0x30303030)) >> at
                    ilo = tl.zeros([WARPS, 32], dtype=tl.int32)
                    ihi = tl.zeros([WARPS, 32], dtype=tl.int32)
                    for w in tl.static_range(4):
                        if FIVE:  # qh's bits 2g and 2g + 1 of each byte rotated to its bits 4 and 5
                            fifth = _funnel(qh[w], qh[w], (2 * g - 4) & 31, ASM)
                            lo = (qs[w] & 0x0F0F0F0F) | (fifth & 0x10101010)
                            hi = ((qs[w] >> 4) & 0x0F0F0F0F) | ((fifth >> 1) & 0x10101010)
                        else:
                            lo = qs[w] & 0x0F0F0F0F
                            hi = qs[w] & 0xF0F0F0F0
                        ilo = _dp4a(lo, xlo[w], ilo, ASM)
                        ihi = _dp4a(hi, xhi[w], ihi, ASM)
                    dot = _f(scw & 0xFF) * (xdl * ilo.to(tl.float32)) \
                        + _f((scw >> 8) & 0xFF) * (xdh * (ihi.to(tl.float32) * HI))
                    mins = _f(mnw & 0xFF) * xsl + _f((mnw >> 8) & 0xFF) * xsh
                    a += d * dot - dmin * mins
            nxt += (a,)
        acc = nxt
    _store_lane_rows(y_ptr, acc, first, N, GLU, RT, WARPS, KS)


@triton.jit
def skinny_q4k8_kernel(q_ptr, ds_ptr, w_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K, row_words, stride_y,
                       GLU: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, ASM: tl.constexpr,
                       STAGES: tl.constexpr,
                       QTYPE: tl.constexpr = 12, STACK_ROWS: tl.constexpr = 0):
    """Q4_K (QTYPE 12), Q5_K (13), IQ4_XS (23) or Q4_0 (2: 8 blocks a step) times a few rows of int8 x
    (quantize_x) on integer tensor cores: per sub-block, the int8 dot of its 32 nibbles in BLOCK_N rows
    (the first operand, so that a thread's scales serve 4 x rows; Q5_K: each with its fifth bit from qh,
    byte l's bit j for weight l of sub-block j; IQ4_XS: their levels, by _iq4_levels) with the x block,
    then scaled as the 1-row GEMV scales its dp4a sums: d sc xd isum - dmin m xs (IQ4_XS: d (sc - 32) xd
    isum; Q4_0: d xd isum - 8 d xs). IQ4_XS's and Q4_0's tiles hold a sub-block's low nibbles (its
    weights 0-15; IQ4_XS: their levels), then its high ones, x's own order, so that each of the four lanes
    that share a row in the product builds one qs word. With a word's low nibbles beside its high ones and
    x read in that order, each took two (sm_90: 7.42 and 6.05 instructions a weight, 0.51 and 1.07 of them
    shared-memory loads, stores and barriers, against 7.09 and 5.35, 0.31 and 0.31). Q4_0's
    144-byte step is read as a Q4_K superblock is (4 words, then 32 in one 128-byte load a row) and split
    into its 36 words in the threads that hold the row, each block's d and qs taken from them (_q40_block):
    loads of each 18-byte block where it lies, in pieces of 4 bytes, made its GEMMs 1.2-2.3x slower (H100).
    A gate/up product of BLOCK_N == STACK_ROWS rows a program takes its gate rows and their up
    rows as one tile of 2 BLOCK_N rows (_gemm_rows), the same sums in one product a step."""
    FIVE: tl.constexpr = QTYPE == Q5_K
    IQ4: tl.constexpr = QTYPE == IQ4_XS
    Q40: tl.constexpr = QTYPE == Q4_0
    SB: tl.constexpr = 34 if IQ4 else 44 if FIVE else 36  # words a superblock (gemv_q4k8c_kernel's)
    STACK: tl.constexpr = GLU and BLOCK_N == STACK_ROWS
    PARTS: tl.constexpr = 2 if GLU and not STACK else 1  # tiles a step: gate and up, or one
    R: tl.constexpr = 2 * BLOCK_N if STACK else BLOCK_N  # rows of a tile
    rows, offs, w32 = _gemm_rows(w_ptr, N, row_words, BLOCK_N, STACK)
    i4 = tl.arange(0, 4)[None, :]
    acc = (tl.zeros([R, 16], dtype=tl.float32), tl.zeros([R, 16], dtype=tl.float32))
    lo, hi = _k_range(K // 256, SPLIT)
    tab = _iq4_registers(K) if IQ4 else None
    for sb in tl.range(lo, hi, num_stages=STAGES):
        heads = ()
        for s in tl.static_range(PARTS):
            if Q40:  # 8 blocks in 36 words: the first 4 here, the other 32 below, each a column [R]
                base = tl.multiple_of(offs[s] + sb * SB, 4)[:, None]
                heads += ((base, _words(tl.load(w32 + base + i4))),)
            elif IQ4:  # d, the scales' high bits, their low bits
                base = tl.multiple_of(offs[s] + sb * SB, 2)[:, None]
                w0, w1 = tl.split(tl.load(w32 + base + tl.arange(0, 2)[None, :]))
                heads += ((base, _half2(w0, True)[0], w0 >> 16, w1),)
            else:
                base = tl.multiple_of(offs[s] + sb * SB, 4)[:, None]
                w0, w1, w2, w3 = _words(tl.load(w32 + base + i4))
                d, dmin = _half2(w0, True)
                heads += ((base, d, dmin, d * -8388608.0, dmin * -8388608.0,
                           (w1 & 0x3F3F3F3F, (w3 & 0x0F0F0F0F) | ((w1 >> 2) & 0x30303030)),
                           (w2 & 0x3F3F3F3F, ((w3 >> 4) & 0x0F0F0F0F) | ((w2 >> 2) & 0x30303030))),)
        quarters = ()
        fifths = ()
        for s in tl.static_range(0 if IQ4 else PARTS):  # the last 128 bytes (Q4_K, Q5_K: qs), in one load a row
            q4 = tl.load(w32 + heads[s][0] + SB - 32 + tl.arange(0, 32)[None, :])
            if Q40:  # the step's 36 words
                quarters += (heads[s][1] + _columns(q4),)
            else:
                lo2, hi2 = tl.split(tl.permute(tl.reshape(q4, [R, 2, 2, 8]), (0, 3, 1, 2)))
                a0, a1 = tl.split(lo2)
                b0, b1 = tl.split(hi2)
                quarters += ((a0, b0, a1, b1),)
                if FIVE:  # qh word c: the fifth bits of the weights of each quarter's word c
                    fifths += (tl.load(w32 + heads[s][0] + 4 + tl.arange(0, 8)[None, :]),)
        for p in tl.static_range(4):
            for h in tl.static_range(2):
                xt, xd, xs = _x_block(q_ptr, ds_ptr, K, 8 * sb + 2 * p + h)
                nxt = ()
                for s in tl.static_range(PARTS):
                    if Q40:
                        d, q4 = _q40_block(quarters[s], 2 * p + h)
                        isum = _nibble_dot(q4 & 0x0F0F0F0F, (q4 >> 4) & 0x0F0F0F0F, xt, ASM)
                        a = tl.fma(isum.to(tl.float32), d[:, None] * xd[None, :], acc[s])
                        nxt += (tl.fma(8.0 * d[:, None], -xs[None, :], a),)
                    elif IQ4:
                        _, d, sh, sl = heads[s]
                        j = 2 * p + h
                        ds = d * (_f(((sl >> (4 * j)) & 0xF) | (((sh >> (2 * j)) & 3) << 4)) - 32.0)
                        qs = tl.load(w32 + heads[s][0] + 2 + 4 * j + i4)  # its 16 bytes
                        lo4, hi4 = _iq4_levels(qs, ASM, True, tab)
                        isum = _nibble_dot(lo4, hi4, xt, ASM)
                        nxt += (tl.fma(isum.to(tl.float32), ds[:, None] * xd[None, :], acc[s]),)
                    else:
                        _, d, dmin, d_off, dmin_off, scs, mns = heads[s]
                        ds = _byte_times(scs[p // 2], 2 * (p % 2) + h, d, d_off)
                        dm = _byte_times(mns[p // 2], 2 * (p % 2) + h, dmin, dmin_off)
                        nib = (quarters[s][p] >> (4 * h)) & 0x0F0F0F0F
                        if FIVE:
                            nib = nib | (((fifths[s] >> (2 * p + h)) & 0x01010101) << 4)
                        isum = tl.dot(_bytes(nib, ASM), xt, out_dtype=tl.int32)
                        a = tl.fma(isum.to(tl.float32), ds[:, None] * xd[None, :], acc[s])
                        nxt += (tl.fma(dm[:, None], -xs[None, :], a),)
                acc = nxt if PARTS == 2 else (nxt[0], acc[1])
    acc = _unstacked(acc, STACK)
    _finish(y_ptr, ws_ptr, cnt_ptr, (tl.trans(acc[0]), tl.trans(acc[1])), rows, M, N, stride_y, GLU, SPLIT)
