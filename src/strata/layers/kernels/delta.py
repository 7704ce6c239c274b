"""Gated DeltaNet's static decode/verify step (GatedDeltaNet.mix's contract) in two Triton launches and
the gated norm, where the torch composition is ~40 small kernels a layer and two full-state copies.

- Launch 1, per (value head, Dv block): the start state chosen on the device (zero at position 0, the end
  state at the end, else the begin state with a rollback's kept rows replayed), written into rec[0] in
  place; per block of channels: the causal convolution and SiLU of the rows (q, k, v into a scratch
  buffer) and the conv windows of the last slots + 1 positions.
- Launch 2, per (value head, Dv block): the rows from rec[0] (l2norm of q and k, decay and beta from the
  projection, the delta rule, the output, and the gated RMSNorm when a program holds a whole head), the
  end state into rec[1], the rows' inputs into the kept slots, begin and end.

The replay reads the previous forward's kept inputs, so it runs in launch 1, before launch 2 overwrites
them. Both launches, and every forward of a layer's shape, run one compiled kernel (the phase, the row
count and the position are never specialised), so a replay executes the very instructions of the
forward that kept its rows: a rollback is lossless, the state after n replayed rows is the bits a
forward of those n rows ended with. Rounding follows ops.py (the reference) up to accumulation order."""

from __future__ import annotations

import functools

import torch

from .common import pow2

#: (BV, num_warps) of the recurrence programs. BV None: a whole value head a program (Dv rounded up to a power
#: of two), which then applies the gated RMSNorm itself (two launches a layer); a smaller BV gives Dv / BV
#: times the programs and a third launch for the norm (the kernel set's gated_rms_norm). H200, Qwen3.5-9B
#: layer (tools/delta_sweep.py, bench/results/delta-sweep-h200.json): (16, 1) 11.7 us at 1 row, 39.9 at 16;
#: a whole head with 8 warps 17.8 and 121; fla-core's composition 55.8 and 88.3
DELTA_CONFIG = (16, 1)
#: channels a convolution program covers, per warp
CONV_CHANNELS_PER_WARP = 64


@functools.cache
def _build():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["phase", "T", "first_ptr"])
    def delta_net_kernel(phase, T, first_ptr, proj_ptr, conv_w_ptr, a_log_ptr, dt_bias_ptr, norm_w_ptr, mixed_ptr,
                         out_ptr, conv_ptr, rec_ptr, kept_qk_ptr, kept_v_ptr, kept_gb_ptr, begin_ptr, end_ptr, slots,
                         stride_proj, eps, HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                         KERNEL: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BC: tl.constexpr,
                         BW: tl.constexpr, NORM: tl.constexpr):
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
            kh = h // (HV // HK)
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
                    qk_mask = tl.where(owner & (h % (HV // HK) == 0), kmask, False)  # the key head's first
                    tl.store(kept_qk_ptr + i * KD + kh * DK + dk, q_in, mask=qk_mask)
                    tl.store(kept_qk_ptr + (slots + i) * KD + kh * DK + dk, k_in, mask=qk_mask)
                    tl.store(kept_v_ptr + i * VD + h * DV + dv, v_in, mask=tl.where(keep, vmask, False))
                    tl.store(kept_gb_ptr + i * HV + h, g, mask=owner)
                    tl.store(kept_gb_ptr + (slots + i) * HV + h, beta, mask=owner)
            tl.store(rec_ptr + tl.where(replaying, 0, HS) + at, state, mask=tl.where(moves | fresh, smask, False))
            if phase != 0:
                tl.store(begin_ptr, first, mask=pid == 0)
                tl.store(end_ptr, first + T, mask=pid == 0)

    return delta_net_kernel


def fits(layer, proj: torch.Tensor, state) -> bool:
    """The kernel's layout: projection rows with contiguous features, the model's type throughout (the
    convolution and norm weights, the conv windows), contiguous state buffers."""
    dt = proj.dtype
    return (proj.dim() == 2 and proj.stride(1) == 1 and layer.conv_weight.is_contiguous()
            and layer.conv_weight.dtype == dt and layer.norm.weight.dtype == dt and state.conv.dtype == dt
            and state.qk.dtype == dt and layer.kernel >= 2
            and all(b.is_contiguous() for b in (state.conv, state.rec, state.qk, state.v, state.gb)))


def _launch(layer, proj: torch.Tensor, first: torch.Tensor, state, config: tuple | None):
    """(kernel, its arguments for a forward of proj's rows, their meta-parameters, the recurrence programs,
    the convolution programs, the raw outputs)."""
    t = proj.shape[0]
    hk, hv, dk, dv, c = layer.k_heads, layer.v_heads, layer.k_dim, layer.v_dim, layer.channels
    bv, warps = config or DELTA_CONFIG
    bv = pow2(dv) if bv is None or bv >= dv else bv
    programs = hv * -(-dv // bv)
    block = min(CONV_CHANNELS_PER_WARP * warps, pow2(c))
    mixed = torch.empty(t, c, device=proj.device, dtype=proj.dtype)
    out = torch.empty(t, hv * dv, device=proj.device, dtype=proj.dtype)
    args = (t, first, proj, layer.conv_weight, layer.A_log, layer.dt_bias, layer.norm.weight, mixed, out, state.conv,
            state.rec, state.qk, state.v, state.gb, state.begin, state.end, state.slots, proj.stride(0), layer.eps)
    meta = dict(HK=hk, HV=hv, DK=dk, DV=dv, KERNEL=layer.kernel, BK=pow2(dk), BV=bv, BC=block,
                BW=pow2(layer.kernel), NORM=bv >= dv, num_warps=warps)
    return _build(), args, meta, programs, -(-c // block), out


def gated_delta_net(layer, proj: torch.Tensor, first: torch.Tensor, state, norm=None,
                    config: tuple | None = None) -> torch.Tensor:
    """GatedDeltaNet.mix's contract: the input projection proj [T, C + Hv*Dv + 2Hv] of rows from position
    `first` (a 0-dim device tensor) -> the normalised, gated outputs [T, Hv*Dv], `state` advanced. norm:
    ops.gated_rms_norm's contract, when a program holds less than a head (the kernel set's compiled one)."""
    from ..ops import gated_rms_norm

    kernel, args, meta, programs, conv_programs, out = _launch(layer, proj, first, state, config)
    kernel[(programs + conv_programs,)](0, *args, **meta)
    kernel[(programs,)](1, *args, **meta)
    if meta["NORM"]:
        return out
    t, hv, dv, c = proj.shape[0], layer.v_heads, layer.v_dim, layer.channels
    z = proj[:, c:c + hv * dv].unflatten(-1, (hv, dv))
    return (norm or gated_rms_norm)(out.view(t, hv, dv), z, layer.norm.weight, layer.eps).flatten(-2)


def start_state(layer, first: torch.Tensor, state, config: tuple | None = None) -> None:
    """Launch 1's recurrence programs alone: the start state at `first` into rec[0], the rows kept by the last
    forward replayed when `first` falls inside it. What a rollback adds to a verify is this launch's time at
    a rollback less its time at the end state (the bench's measure); it leaves rec[0] changed."""
    width = layer.channels + (layer.v_dim + 2) * layer.v_heads
    proj = torch.empty(0, width, device=state.rec.device, dtype=state.conv.dtype)
    kernel, args, meta, programs, _, _ = _launch(layer, proj, first, state, config)
    kernel[(programs,)](0, *args, **meta)
