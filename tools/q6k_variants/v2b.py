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
    xcols = q_ptr + tl.arange(0, 16)[None, :] * K + pos
    xrest = q_ptr + tl.arange(0, 16) * K + 30
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
                rest = ()
                for s in tl.static_range(2 if GLU else 1):  # low 4 bits in ql bytes 64 h2 + 32 (mq % 2) + l,
                    base = heads[s][0]  # high 2 in bits 2 mq of qh byte 32 h2 + l
                    bits += ((_words_from(w32, base, 16 * h2, 8, False), _words_from(w32, base, 16 * h2 + 8, 8, False),
                              _words_from(w32, base, 32 + 8 * h2, 8, False)),)
                    if False:
                        rest += ((tl.load(w32 + base + 16 * h2 + 8), tl.load(w32 + base + 16 * h2 + 16),
                                  tl.load(w32 + base + 40 + 8 * h2)),)
                for mq in tl.static_range(4):
                    j = 8 * sb + 4 * h2 + mq
                    x1 = tl.load(xcols + 32 * j - 2 * odd)
                    first = (pos >= 2 * odd) & (pos < 16 + 2 * odd)
                    x2 = tl.reshape(tl.permute(tl.join(tl.where(first, x1, 0), tl.where(pos < 16 + 2 * odd, 0, x1)),
                                               (0, 2, 1)), [32, 32])
                    if odd:
                        xw = tl.load((xrest + 32 * j).to(tl.pointer_type(tl.int16))).to(tl.int32) & 0xFFFF
                    xd, _ = _x_scales(ds_ptr, j)
                    nxt = ()
                    for s in tl.static_range(2 if GLU else 1):
                        qb = _bytes(_minus32(_q6_bits(bits[s][mq % 2], bits[s][2], mq)), ASM)
                        sw = heads[s][1][2 * h2 + mq // 2]  # scales 8 h2 + 2 mq, + 1: its bytes 2 (mq % 2), + 1
                        sc_lo = (sw << (24 - 16 * (mq % 2))) >> 24
                        sc_hi = (sw << (16 - 16 * (mq % 2))) >> 24
                        ilo, ihi = tl.split(tl.permute(tl.reshape(tl.dot(qb, x2, out_dtype=tl.int32),
                                                                  [BLOCK_N, 2, 16]), (0, 2, 1)))
                        if False:
                            lv = _minus32(_q6_bits(rest[s][mq % 2], rest[s][2], mq))
                            ihi = _dp4a(lv[:, None], xw[None, :], ihi, ASM, True)
                        isum = ilo * sc_lo[:, None] + ihi * sc_hi[:, None]
                        nxt += (tl.fma(isum.to(tl.float32), xd[None, :], part[s]),)
                    part = nxt if GLU else (nxt[0], part[1])
            nxt = ()
            for s in tl.static_range(2 if GLU else 1):
                nxt += (tl.fma(part[s], heads[s][2][:, None], acc[s]),)
            acc = nxt if GLU else (nxt[0], acc[1])
    _finish(y_ptr, ws_ptr, cnt_ptr, (tl.trans(acc[0]), tl.trans(acc[1])), rows, M, N, stride_y, GLU, SPLIT)

