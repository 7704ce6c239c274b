"""Gated DeltaNet's step kernel (delta.py launches it twice a forward: phase 0, then phase 1)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["phase", "T", "first_ptr"])
def delta_net_kernel(phase, T, first_ptr, proj_ptr, conv_w_ptr, a_log_ptr, dt_bias_ptr, norm_w_ptr, mixed_ptr,
                     out_ptr, conv_ptr, rec_ptr, kept_qk_ptr, kept_v_ptr, kept_gb_ptr, begin_ptr, end_ptr, slots,
                     stride_proj, eps, HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                     KERNEL: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BC: tl.constexpr,
                     BW: tl.constexpr, NORM: tl.constexpr, TILED: tl.constexpr):
    """Phase 0 (the programs past HV * NV convolve) or phase 1 of a forward of T rows from *first_ptr."""
    KD: tl.constexpr = HK * DK
    VD: tl.constexpr = HV * DV
    C: tl.constexpr = 2 * KD + VD
    NV: tl.constexpr = (DV + BV - 1) // BV
    HS: tl.constexpr = HV * DK * DV
    pid = tl.program_id(0)
    first = tl.load(first_ptr)
    ty = mixed_ptr.dtype.element_ty
    replaying = phase == 0
    if pid >= HV * NV:
        c = (pid - HV * NV) * BC + tl.arange(0, BC)
        cmask = c < C
        taps = tl.arange(0, BW)
        j = tl.minimum(tl.maximum(first - tl.load(end_ptr) + slots, 0), slots)
        old = tl.load(conv_ptr + j * (KERNEL - 1) * C + taps[:, None] * C + c[None, :],
                      mask=tl.where(first != 0, (taps < KERNEL - 1)[:, None] & cmask[None, :], False), other=0.0)
        old = old.to(tl.float32)
        w = tl.load(conv_w_ptr + c[None, :] * KERNEL + taps[:, None],
                    mask=(taps < KERNEL)[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        tl.debug_barrier()  # window j is read whole before any window (j among them) is written
        for p in range(0, T + slots + 1):  # the rows' convolutions, then the windows kept
            s = tl.where(p < T, p, tl.minimum(tl.maximum(p - slots, 0), T))  # x_full's first row read
            r = s + taps
            shifted = tl.sum(tl.where(taps[None, :, None] == r[:, None, None], old[None, :, :], 0.0), axis=1)
            new = tl.load(proj_ptr + (r - (KERNEL - 1))[:, None] * stride_proj + c[None, :],
                          mask=((r >= KERNEL - 1) & (r < KERNEL - 1 + T))[:, None] & cmask[None, :], other=0.0)
            x = tl.where((r < KERNEL - 1)[:, None], shifted, new.to(tl.float32))
            if p < T:
                y = tl.sum(w * x, axis=0).to(ty).to(tl.float32)
                tl.store(mixed_ptr + p * C + c, (y * tl.sigmoid(y)).to(ty), mask=cmask)
            else:
                tl.store(conv_ptr + ((p - T) * (KERNEL - 1) + taps[:, None]) * C + c[None, :], x.to(ty),
                         mask=(taps < KERNEL - 1)[:, None] & cmask[None, :])
    else:
        h = pid // NV
        vb = pid % NV
        if TILED:  # llama.cpp's qwen35 order: value head h reads key head h % HK
            kh = h % HK
            leads = h < HK  # the key head's first value head
        else:
            kh = h // (HV // HK)
            leads = h % (HV // HK) == 0
        dk = tl.arange(0, BK)
        dv = vb * BV + tl.arange(0, BV)
        kmask = dk < DK
        vmask = dv < DV
        smask = kmask[:, None] & vmask[None, :]
        at = h * DK * DV + dk[:, None] * DV + dv[None, :]
        fresh = replaying & (first == 0)
        at_end = replaying & (first != 0) & (first == tl.load(end_ptr, mask=replaying, other=-1))
        kept_rows = tl.minimum(tl.maximum(first - tl.load(begin_ptr, mask=replaying, other=0), 0), slots)
        n = tl.where(replaying, tl.where(fresh | at_end, 0, kept_rows), T).to(tl.int32)
        moves = (phase != 0) | at_end | (n > 0)
        state = tl.load(rec_ptr + tl.where(at_end, HS, 0) + at, mask=tl.where(moves, smask, False), other=0.0)
        k_ptr = tl.where(replaying, kept_qk_ptr + slots * KD, mixed_ptr + KD) + kh * DK + dk
        v_ptr = tl.where(replaying, kept_v_ptr, mixed_ptr + 2 * KD) + h * DV + dv
        k_stride = tl.where(replaying, KD, C)
        v_stride = tl.where(replaying, VD, C)
        for i in range(0, n):
            row = proj_ptr + i * stride_proj
            if replaying:
                g = tl.load(kept_gb_ptr + i * HV + h)
                beta = tl.load(kept_gb_ptr + (slots + i) * HV + h)
            else:
                a = tl.load(row + C + VD + HV + h).to(tl.float32) + tl.load(dt_bias_ptr + h).to(tl.float32)
                softplus = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(a)))
                g = -tl.exp(tl.load(a_log_ptr + h).to(tl.float32)) * softplus
                beta = tl.sigmoid(tl.load(row + C + VD + h).to(tl.float32)).to(ty).to(tl.float32)
            k_in = tl.load(k_ptr + i * k_stride, mask=kmask, other=0.0)
            v_in = tl.load(v_ptr + i * v_stride, mask=vmask, other=0.0)
            k = k_in.to(tl.float32)
            k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
            state = state * tl.exp(g)
            delta = (v_in.to(tl.float32) - tl.sum(state * k[:, None], axis=0)) * beta
            state = state + k[:, None] * delta[None, :]
            if phase != 0:
                q_in = tl.load(mixed_ptr + i * C + kh * DK + dk, mask=kmask, other=0.0)
                q = q_in.to(tl.float32)
                q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) / (DK ** 0.5)
                o = tl.sum(state * q[:, None], axis=0).to(ty)
                if NORM:
                    o32 = o.to(tl.float32)
                    var = tl.sum(tl.where(vmask, o32 * o32, 0.0), axis=0) / DV
                    normed = (o32 * tl.rsqrt(var + eps)).to(ty).to(tl.float32)
                    w = tl.load(norm_w_ptr + dv, mask=vmask, other=0.0).to(tl.float32)
                    z = tl.load(row + C + h * DV + dv, mask=vmask, other=0.0).to(tl.float32)
                    o = ((w * normed).to(ty).to(tl.float32) * (z * tl.sigmoid(z))).to(ty)
                tl.store(out_ptr + i * VD + h * DV + dv, o, mask=vmask)
                keep = i < slots
                owner = keep & (vb == 0)  # of the head's decay and beta
                qk_mask = tl.where(owner & leads, kmask, False)
                tl.store(kept_qk_ptr + i * KD + kh * DK + dk, q_in, mask=qk_mask)
                tl.store(kept_qk_ptr + (slots + i) * KD + kh * DK + dk, k_in, mask=qk_mask)
                tl.store(kept_v_ptr + i * VD + h * DV + dv, v_in, mask=tl.where(keep, vmask, False))
                tl.store(kept_gb_ptr + i * HV + h, g, mask=owner)
                tl.store(kept_gb_ptr + (slots + i) * HV + h, beta, mask=owner)
        tl.store(rec_ptr + tl.where(replaying, 0, HS) + at, state, mask=tl.where(moves | fresh, smask, False))
        if phase != 0:
            tl.store(begin_ptr, first, mask=pid == 0)
            tl.store(end_ptr, first + T, mask=pid == 0)
