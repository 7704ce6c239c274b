"""Triton kernels over GGUF-quantized weights: the blocks stay as llama.cpp wrote them, in GPU memory,
and each kernel dequantizes the tiles it needs in registers.

Every kernel is built on one function, `_tile`: the float32 values of a [rows, 256] tile of a
quantized matrix, computed in the same float32 operations, in the same order, as gguf's reference
(`gguf.quants.dequantize`), so the dequantization kernel matches it bit for bit (the tests run it in
Triton's interpreter). Over it: a 1-row GEMV and a few-row GEMM (a verify window, a drafter block) on
tensor cores, both with the gate/up silu*up variant, an embedding gather, and a whole-matrix
dequantization. Block layouts are the GGML formats' (ggml-common.h); d and other float16 fields sit at
even offsets, so they are read through a float16 view of the same bytes."""

from __future__ import annotations

import functools

import torch

# GGML type ids and their (weights per block, bytes per block)
Q4_0, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_XS = 2, 8, 12, 13, 14, 23
BLOCKS = {Q4_0: (32, 18), Q8_0: (32, 34), Q4_K: (256, 144), Q5_K: (256, 176), Q6_K: (256, 210),
          IQ4_XS: (256, 136)}
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
TILE = 256  # columns a kernel step covers: one superblock, or 8 blocks of 32


@functools.cache
def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def _tile(w_ptr, row_off, k0, tab_ptr, QTYPE: tl.constexpr):
        """float32 values of columns k0..k0+255 of the rows whose byte offsets are row_off [R, 1]."""
        k = tl.arange(0, 256)[None, :]
        u8 = w_ptr
        i8 = w_ptr.to(tl.pointer_type(tl.int8))
        f16 = w_ptr.to(tl.pointer_type(tl.float16))
        u16 = w_ptr.to(tl.pointer_type(tl.uint16))
        if QTYPE == 8:  # Q8_0: d, then 32 int8
            base = row_off + (k0 // 32 + k // 32) * 34
            d = tl.load(f16 + base // 2).to(tl.float32)
            q = tl.load(i8 + base + 2 + k % 32).to(tl.float32)
            out = q * d
        elif QTYPE == 2:  # Q4_0: d, then 16 bytes: low nibbles are weights 0..15, high ones 16..31
            base = row_off + (k0 // 32 + k // 32) * 18
            j = k % 32
            d = tl.load(f16 + base // 2).to(tl.float32)
            q = ((tl.load(u8 + base + 2 + j % 16).to(tl.int32) >> (4 * (j // 16))) & 15) - 8
            out = d * q.to(tl.float32)
        elif QTYPE == 12 or QTYPE == 13:  # Q4_K / Q5_K: d, dmin, 12 bytes of 6-bit scales and mins, ...
            base = row_off + (k0 // 256) * (144 if QTYPE == 12 else 176)
            g = k // 32
            i = g % 4
            a = tl.load(u8 + base + 4 + i).to(tl.int32)
            b = tl.load(u8 + base + 8 + i).to(tl.int32)
            c = tl.load(u8 + base + 12 + i).to(tl.int32)
            sc = tl.where(g < 4, a & 63, (c & 15) | ((a >> 2) & 48))
            m = tl.where(g < 4, b & 63, (c >> 4) | ((b >> 2) & 48))
            d = tl.load(f16 + base // 2).to(tl.float32)
            dmin = tl.load(f16 + base // 2 + 1).to(tl.float32)
            qs = 16 if QTYPE == 12 else 48  # Q5_K: 32 bytes of fifth bits first
            q = (tl.load(u8 + base + qs + (g // 2) * 32 + k % 32).to(tl.int32) >> (4 * (g % 2))) & 15
            if QTYPE == 13:
                q = q | (((tl.load(u8 + base + 16 + k % 32).to(tl.int32) >> g) & 1) << 4)
            out = (d * sc.to(tl.float32)) * q.to(tl.float32) - dmin * m.to(tl.float32)
        elif QTYPE == 14:  # Q6_K: 128 bytes low 4 bits, 64 bytes high 2 bits, 16 int8 scales, d
            base = row_off + (k0 // 256) * 210
            g = k // 32
            s = g % 4
            low = tl.load(u8 + base + (g // 4) * 64 + (s % 2) * 32 + k % 32).to(tl.int32)
            high = tl.load(u8 + base + 128 + (g // 4) * 32 + k % 32).to(tl.int32)
            q = (((low >> (4 * (s // 2))) & 15) | (((high >> (2 * s)) & 3) << 4)) - 32
            d = tl.load(f16 + (base + 208) // 2).to(tl.float32)
            sc = tl.load(i8 + base + 192 + k // 16).to(tl.float32)
            out = (d * sc) * q.to(tl.float32)
        else:  # IQ4_XS: d, 16 bits of scale highs, 4 bytes of scale lows, 128 bytes of 4-bit table indices
            base = row_off + (k0 // 256) * 136
            j = k // 32
            t = k % 32
            d = tl.load(f16 + base // 2).to(tl.float32)
            hi = (tl.load(u16 + base // 2 + 1).to(tl.int32) >> (2 * j)) & 3
            lo = (tl.load(u8 + base + 4 + j // 2).to(tl.int32) >> (4 * (j % 2))) & 15
            scale = (lo | (hi << 4)) - 32
            q = (tl.load(u8 + base + 8 + 16 * j + t % 16).to(tl.int32) >> (4 * (t // 16))) & 15
            out = (d * scale.to(tl.float32)) * tl.load(tab_ptr + q).to(tl.float32)
        return out

    globals()["_tile"] = _tile  # the kernels below call it by name: Triton resolves names in module globals

    @triton.jit
    def dequant_kernel(w_ptr, tab_ptr, out_ptr, N, K, row_bytes, QTYPE: tl.constexpr, BLOCK_N: tl.constexpr):
        rows = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        rmask = rows[:, None] < N
        row_off = tl.where(rmask, rows[:, None] * row_bytes, 0)
        k0 = tl.program_id(1) * 256
        cols = k0 + tl.arange(0, 256)[None, :]
        tl.store(out_ptr + rows[:, None] * K + cols, _tile(w_ptr, row_off, k0, tab_ptr, QTYPE), mask=rmask)

    @triton.jit
    def gather_kernel(tok_ptr, w_ptr, tab_ptr, out_ptr, K, row_bytes, QTYPE: tl.constexpr):
        """One token's embedding row, dequantized and written in out's dtype."""
        t = tl.program_id(0)
        row_off = tl.load(tok_ptr + t).to(tl.int64) * row_bytes + tl.zeros([1, 1], dtype=tl.int64)
        for k0 in range(0, K, 256):
            vals = _tile(w_ptr, row_off, k0, tab_ptr, QTYPE)
            cols = k0 + tl.arange(0, 256)[None, :]
            tl.store(out_ptr + t * K + cols, vals.to(out_ptr.dtype.element_ty))

    @triton.jit
    def gemv_kernel(x_ptr, w_ptr, tab_ptr, y_ptr, N, K, row_bytes, QTYPE: tl.constexpr, GLU: tl.constexpr,
                    BLOCK_N: tl.constexpr):
        rows = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        rmask = rows < N
        row_off = tl.where(rmask, rows * row_bytes, 0)[:, None]
        up_off = tl.where(rmask, (rows + N) * row_bytes, 0)[:, None]
        acc = tl.zeros([BLOCK_N, 256], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_N, 256], dtype=tl.float32)
        for k0 in range(0, K, 256):
            x = tl.load(x_ptr + k0 + tl.arange(0, 256)).to(tl.float32)[None, :]
            acc += _tile(w_ptr, row_off, k0, tab_ptr, QTYPE) * x
            if GLU:
                acc_up += _tile(w_ptr, up_off, k0, tab_ptr, QTYPE) * x
        out_ty = y_ptr.dtype.element_ty
        y = tl.sum(acc, axis=1)
        if GLU:
            gate = y.to(out_ty).to(tl.float32)
            y = (gate * tl.sigmoid(gate)).to(out_ty).to(tl.float32) * tl.sum(acc_up, axis=1).to(out_ty).to(tl.float32)
        tl.store(y_ptr + rows, y.to(out_ty), mask=rmask)

    @triton.jit
    def skinny_kernel(x_ptr, w_ptr, tab_ptr, y_ptr, M, N, K, row_bytes, stride_x, stride_y, QTYPE: tl.constexpr,
                      GLU: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
        """y [M, N] = x [M, K] @ W^T for a few rows: each weight tile dequantized once, then on tensor cores."""
        cols = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        nmask = cols < N
        row_off = tl.where(nmask, cols * row_bytes, 0)[:, None]
        up_off = tl.where(nmask, (cols + N) * row_bytes, 0)[:, None]
        m = tl.arange(0, BLOCK_M)
        mmask = m < M
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, 256):
            x = tl.load(x_ptr + m[:, None] * stride_x + k0 + tl.arange(0, 256)[None, :], mask=mmask[:, None],
                        other=0.0)
            w = _tile(w_ptr, row_off, k0, tab_ptr, QTYPE).to(x.dtype)
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
            if GLU:
                u = _tile(w_ptr, up_off, k0, tab_ptr, QTYPE).to(x.dtype)
                acc_up = tl.dot(x, tl.trans(u), acc_up, input_precision=PRECISION)
        out_ty = y_ptr.dtype.element_ty
        y = acc
        if GLU:
            gate = y.to(out_ty).to(tl.float32)
            y = (gate * tl.sigmoid(gate)).to(out_ty).to(tl.float32) * acc_up.to(out_ty).to(tl.float32)
        tl.store(y_ptr + m[:, None] * stride_y + cols[None, :], y.to(out_ty), mask=mmask[:, None] & nmask[None, :])

    return {"dequant": dequant_kernel, "gather": gather_kernel, "gemv": gemv_kernel, "skinny": skinny_kernel}


_TABLES: dict = {}


def _table(device) -> torch.Tensor:
    """IQ4_XS's 16 non-linear levels, on the device (kernels of other types ignore it)."""
    key = str(device)
    if key not in _TABLES:
        _TABLES[key] = torch.tensor(IQ4_VALUES, dtype=torch.int8, device=device)
    return _TABLES[key]


def _check(data: torch.Tensor, qtype: int, cols: int) -> None:
    """The kernels read whole 256-column tiles of whole blocks: anything else would read past a row."""
    block, size = BLOCKS[qtype]
    assert cols % TILE == 0 and data.dtype == torch.uint8 and data.dim() == 2, (qtype, cols, data.shape)
    assert data.shape[1] == cols // block * size and data.stride(1) == 1, (qtype, cols, data.shape)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def dequantize(data: torch.Tensor, qtype: int, cols: int) -> torch.Tensor:
    """A [rows, row_bytes] uint8 matrix of GGUF blocks -> float32 [rows, cols]."""
    rows = data.shape[0]
    _check(data, qtype, cols)
    out = torch.empty(rows, cols, dtype=torch.float32, device=data.device)
    block_n = 8
    _build()["dequant"][(_cdiv(rows, block_n), cols // TILE)](data, _table(data.device), out, rows, cols,
                                                              data.stride(0), QTYPE=qtype, BLOCK_N=block_n)
    return out


def gather(data: torch.Tensor, qtype: int, cols: int, tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `tokens` of a quantized embedding table, dequantized: [*tokens.shape, cols] in dtype."""
    _check(data, qtype, cols)
    flat = tokens.reshape(-1).contiguous()
    out = torch.empty(flat.numel(), cols, dtype=dtype, device=data.device)
    if flat.numel():
        _build()["gather"][(flat.numel(),)](flat, data, _table(data.device), out, cols, data.stride(0), QTYPE=qtype)
    return out.view(*tokens.shape, cols)


#: (rows of W per program, warps): the GEMV's (few rows: many programs stream the weight), the few-row GEMM's
GEMV_BLOCK_N, GEMV_WARPS = 2, 4
SKINNY_BLOCK_N, SKINNY_WARPS = 32, 4


def matmul(x: torch.Tensor, data: torch.Tensor, qtype: int, n: int, glu: bool = False,
           config: tuple[int, int] | None = None) -> torch.Tensor:
    """x [M, K] @ W^T for a quantized W of n rows ([n, row_bytes]; with glu 2n rows, gate then up, and
    the result silu(gate) * up [M, n]). config: (rows of W per program, warps), for sweeps."""
    rows, k = x.shape
    _check(data, qtype, k)
    x = x.contiguous()
    y = torch.empty(rows, n, device=x.device, dtype=x.dtype)
    kernels = _build()
    tab = _table(x.device)
    if rows == 1:
        block_n, warps = config or (GEMV_BLOCK_N, GEMV_WARPS)
        kernels["gemv"][(_cdiv(n, block_n),)](x, data, tab, y, n, k, data.stride(0), QTYPE=qtype, GLU=glu,
                                              BLOCK_N=block_n, num_warps=warps)
    else:
        block_n, warps = config or (SKINNY_BLOCK_N, SKINNY_WARPS)
        kernels["skinny"][(_cdiv(n, block_n),)](
            x, data, tab, y, rows, n, k, data.stride(0), x.stride(0), y.stride(0), QTYPE=qtype, GLU=glu,
            BLOCK_M=max(16, 1 << (rows - 1).bit_length()), BLOCK_N=block_n,
            PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=warps)
    return y
