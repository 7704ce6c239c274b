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

import torch

from .common import pow2
from .tuning import CONV_CHANNELS_PER_WARP, DELTA_CONFIG


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
                BW=pow2(layer.kernel), NORM=bv >= dv, TILED=layer.tiled, num_warps=warps)
    from .jit_delta import delta_net_kernel

    return delta_net_kernel, args, meta, programs, -(-c // block), out


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
