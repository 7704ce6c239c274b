@triton.jit
def _patch(T, P):
    """T's window words with the last one's high half taken from the word before the window (P's last)."""
    return tl.where(tl.arange(0, 8)[None, :] == 7, (T & 0xFFFF) | (P & 0xFFFF0000), T)


@triton.jit
def skinny_q6k8_kernel(q_ptr, ds_ptr, w_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K, row_words, stride_y,
                       GLU: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, ASM: tl.constexpr,
                       STAGES: tl.constexpr):
    rows, offs, w32 = _gemm_rows(w_ptr, N, row_words, BLOCK_N)
    pos = tl.arange(0, 32)[:, None]
    xcols = q_ptr + tl.arange(0, 16)[None, :] * K + pos
    acc = (tl.zeros([BLOCK_N, 16], dtype=tl.float32), tl.zeros([BLOCK_N, 16], dtype=tl.float32))
    lo, hi = _k_range(K // 512, SPLIT)
    w8 = tl.arange(0, 8)[None, :]
    for sb2 in tl.range(lo, hi, num_stages=STAGES):
        for odd in tl.static_range(2):
            sb = 2 * sb2 + odd
            heads = ()
            tiles = ()
            for s in tl.static_range(2 if GLU else 1):
                base = offs[s] + sb2 * 105 + 52 * odd
                scw = _words(_words_from(w32, base, 48, 4, odd).to(tl.int32, bitcast=True))  # 16 int8 scales
                dword = tl.load(w32 + base + 52)  # d: bytes 208, 209 (of an odd one: the word's high half)
                d, _ = _half2(dword >> 16 if odd else dword, True)
                heads += ((base, scw, d),)
                tiles += (w32 + base[:, None] + w8 + odd,)  # an odd one's windows: the 8 words after each run's first
            part = (tl.zeros([BLOCK_N, 16], dtype=tl.float32), tl.zeros([BLOCK_N, 16], dtype=tl.float32))
            for h2 in tl.static_range(2):
                bits = ()
                for s in tl.static_range(2 if GLU else 1):
                    at = tiles[s]
                    A = tl.load(at + 16 * h2)
                    B = tl.load(at + 16 * h2 + 8)
                    Q = tl.load(at + 32 + 8 * h2)
                    if odd:  # each window's last 2 bytes (the next run's) replaced by its run's first 2
                        bits += ((_patch(A, tl.load(at + 16 * h2 - 8)), _patch(B, A),
                                  _patch(Q, tl.load(at + 32 + 8 * h2 - 8))),)
                    else:
                        bits += ((A, B, Q),)
                for mq in tl.static_range(4):
                    j = 8 * sb + 4 * h2 + mq
                    if odd:  # window byte p holds weight (p + 2) % 32 of the run
                        x1 = tl.load(xcols + 32 * j + 2)
                        xe = tl.load(xcols + 32 * j - 30, mask=pos >= 30, other=0)
                        xlo = tl.where(pos < 14, x1, xe)
                        xhi = tl.where((pos >= 14) & (pos < 30), x1, 0)
                    else:
                        x1 = tl.load(xcols + 32 * j)
                        xlo = tl.where(pos < 16, x1, 0)
                        xhi = tl.where(pos < 16, 0, x1)
                    x2 = tl.reshape(tl.permute(tl.join(xlo, xhi), (0, 2, 1)), [32, 32])
                    xd, _ = _x_scales(ds_ptr, j)
                    nxt = ()
                    for s in tl.static_range(2 if GLU else 1):
                        t = bits[s]
                        qb = _bytes(_minus32(_q6_bits(t[mq % 2], t[2], mq)), ASM)
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
