"""The Triton helpers every kernel module shares: the PDL wait (settle), the L2 prefetch, silu * up
as the unfused model rounds it, and bit helpers over 32-bit words (each one instruction on the device,
spelled out for the interpreter); the GGML type ids as the constants kernels compare QTYPE with."""

from __future__ import annotations

import triton
import triton.language as tl
from gguf import GGMLQuantizationType as T

#: the GGML type ids of the kernels' types, as the constants Triton takes from a module's globals
Q4_0 = tl.constexpr(int(T.Q4_0))
Q8_0 = tl.constexpr(int(T.Q8_0))
Q4_K = tl.constexpr(int(T.Q4_K))
Q5_K = tl.constexpr(int(T.Q5_K))
Q6_K = tl.constexpr(int(T.Q6_K))
IQ4_XS = tl.constexpr(int(T.IQ4_XS))
Q3_K = tl.constexpr(int(T.Q3_K))
IQ3_XXS = tl.constexpr(int(T.IQ3_XXS))


@triton.jit
def settle(PDL: tl.constexpr):
    """Wait for the kernels before this one and see their writes (programmatic dependent launch, pdl.py);
    then let the next one launch. A no-op unless PDL."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs, ok):
    """Ask L2 for the lines at ptrs where ok: one prefetch.global.L2 each (device code only: the interpreter
    has no inline assembly)."""
    tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
                              "=r,l,r", [ptrs, ok.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _silu_mul(gate, up, out_ty: tl.constexpr):
    """silu(gate) * up of float32 sums, each step rounded to out_ty as the unfused model rounds it."""
    g = gate.to(out_ty).to(tl.float32)
    return (g * tl.sigmoid(g)).to(out_ty).to(tl.float32) * up.to(out_ty).to(tl.float32)


@triton.jit
def _f(v):
    """float32 of a small non-negative int32 v (< 2**23): 2**23 + v through the mantissa, less 2**23;
    an integer op and an add in place of a conversion, a quarter-rate instruction on recent GPUs."""
    return (v | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _words(v):
    """[..., 4] (the last dim held by one thread) -> its four [...] slices, in order."""
    a, b = tl.split(tl.reshape(v, v.shape[:-1] + (2, 2)))
    a0, a1 = tl.split(a)
    b0, b1 = tl.split(b)
    return a0, b0, a1, b1


@triton.jit
def _columns(v):
    """[R, 32] -> its 32 columns [R], in order: register moves where a thread holds whole rows."""
    R: tl.constexpr = v.shape[0]
    cols = (v,)
    for level in tl.static_range(5):
        nxt = ()
        for i in tl.static_range(1 << level):
            a, b = tl.split(tl.permute(tl.reshape(cols[i], [R, 2, 16 >> level]), (0, 2, 1)))
            nxt += (a, b)
        cols = nxt
    out = ()
    for i in tl.static_range(32):
        out += (tl.reshape(cols[i], [R]),)
    return out


@triton.jit
def _joined4(a, b, c, d):
    """Four [R] -> [R, 4] (a, b, c, d as its columns, in order), by selects on each register's column, which
    the compiler resolves; joins cost layout conversions through shared memory (sm_90: 6.70 instructions a
    weight in 7be201f's Q4_0 GEMM against 6.05)."""
    t = tl.arange(0, 4)[None, :]
    return tl.where(t == 0, a[:, None], tl.where(t == 1, b[:, None], tl.where(t == 2, c[:, None], d[:, None])))


@triton.jit
def _bf16x2(u):
    return (u << 16).to(tl.float32, bitcast=True), (u & 0xFFFF0000).to(tl.float32, bitcast=True)


@triton.jit
def _half2(u, F16: tl.constexpr):
    """The two float16 (F16) or bfloat16 values of an int32, low half first, as float32."""
    if F16:
        return ((u & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32),
                (u >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32))
    return _bf16x2(u)


@triton.jit
def _dp4a(a, b, c, ASM: tl.constexpr, SIGNED: tl.constexpr = False):
    """c + the dot product of a's four unsigned (SIGNED: signed) bytes with b's four signed ones: one
    instruction on the device (dp4a), its integer arithmetic spelled out for the interpreter."""
    if ASM:
        if SIGNED:
            return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                             dtype=tl.int32, is_pure=True, pack=1)
        return tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                         dtype=tl.int32, is_pure=True, pack=1)
    up = 24 - 8 * tl.arange(0, 4)  # the bytes as a last axis: few interpreted ops
    a4 = tl.expand_dims(a.to(tl.int32, bitcast=True), -1) << up
    a4 = (a4 >> 24) if SIGNED else ((a4 >> 24) & 0xFF)
    return c + tl.sum(a4 * ((tl.expand_dims(b, -1) << up) >> 24), axis=-1)


@triton.jit
def _prmt(a, b, sel, ASM: tl.constexpr):
    """PTX's byte permute (prmt.b32, default mode) of int32 words: byte i of the result is byte s & 7 of
    b:a (a's bytes 0-3, b's 4-7), s the nibble i of sel, or that byte's sign bit spread over 8 bits where
    s & 8; one instruction on the device, spelled out for the interpreter."""
    if ASM:
        return tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, sel], dtype=tl.int32,
                                         is_pure=True, pack=1)
    i = tl.arange(0, 4)
    s = (tl.expand_dims(sel, -1) >> (4 * i)) & 0xF
    at = 8 * (s & 3)
    byte = tl.where((s & 7) < 4, tl.expand_dims(a, -1) >> at, tl.expand_dims(b, -1) >> at) & 0xFF
    byte = tl.where(s >= 8, tl.where(byte >= 128, 0xFF, 0), byte)
    return tl.sum(byte << (8 * i), axis=-1)


@triton.jit
def _funnel(lo, hi, shift, ASM: tl.constexpr):
    """The 32 bits of hi:lo from bit `shift` (0-31) up (with hi = lo: lo rotated right by shift): one
    instruction on the device."""
    if ASM:
        return tl.inline_asm_elementwise("shf.r.wrap.b32 $0, $1, $2, $3;", "=r,r,r,r", [lo, hi, shift],
                                         dtype=tl.uint32, is_pure=True, pack=1)
    lo = lo.to(tl.uint32, bitcast=True)
    hi = hi.to(tl.uint32, bitcast=True)
    return tl.where(shift == 0, lo, (lo >> shift) | (hi << ((32 - shift) & 31)))


@triton.jit
def _bytes(w, ASM: tl.constexpr):
    """The bytes of 32-bit words w [R, C] as int8 [R, 4 C] (byte b of word c at 4 c + b): on the device each
    word, repeated over its 4 bytes, is packed back into the one register it came from."""
    R: tl.constexpr = w.shape[0]
    C: tl.constexpr = w.shape[1]
    w4 = tl.reshape(tl.broadcast_to(w[:, :, None], [R, C, 4]), [R, 4 * C])
    if ASM:
        return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r,r,r,r", [w4], dtype=tl.int8, is_pure=True,
                                         pack=4)
    return ((w4 << (24 - 8 * (tl.arange(0, 4 * C) % 4))[None, :]) >> 24).to(tl.int8)


@triton.jit
def _byte_times(w, k: tl.constexpr, d, d_off):
    """Byte k of w times d (d_off = -2**23 d), rounded once as float32 d * byte is: the byte made the
    mantissa of 2**23 + byte, and one fma subtracts 2**23 d (exact) from its exact product with d."""
    if k == 3:
        v = (w >> 24) | 0x4B000000
    else:
        v = ((w >> (8 * k)) & 0xFF) | 0x4B000000
    return tl.fma(v.to(tl.float32, bitcast=True), d, d_off)


@triton.jit
def _minus32(P):
    """Each byte b (< 64) of the words P as the int8 b - 32: every byte lifted by 0x80 first, so that no
    subtraction borrows from the byte above."""
    return ((P | 0x80808080) - 0x20202020) ^ 0x80808080
