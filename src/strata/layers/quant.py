"""GGUF-quantized matrices kept quantized on the device.

A QuantWeight is a [rows, cols] matrix as row segments of GGUF blocks, each segment of one GGML type:
a fused q/k/v can join Q4_K and Q6_K rows (Q4_K_M does that). Kernel sets hand it to the Triton
kernels (kernels/quantized.py), which dequantize in registers; the float tensor never exists, except
briefly for prefill-sized products (one matrix at a time)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .kernels import host_blocks
from .kernels import quantized as qk
from .kernels.options import KernelOptions
from .kernels.qtypes import (BLOCKS, HALF_FIELDS, IQ3_XXS, IQ4_XS, KERNEL_TYPES, Q3_K, Q4_0, Q4_K, Q5_K, Q6_K, Q8_0,
                             TILE)
from .kernels.x8 import quantize_x

#: rows up to which a product runs on the quantized kernels; larger ones (prefill) dequantize first
KERNEL_MAX_ROWS = 16

@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


@dataclass
class Segment:
    qtype: int
    data: torch.Tensor  # uint8 [rows, row_bytes]

    @property
    def rows(self) -> int:
        return self.data.shape[0]


class QuantWeight:
    def __init__(self, segments: list[Segment], cols: int, dtype: torch.dtype):
        """dtype: the activations' (outputs are written in it)."""
        self.segments, self.cols, self.dtype = segments, cols, dtype

    @classmethod
    def fits(cls, qtype: int, shape: tuple) -> bool:
        """Whether the device kernels take a matrix of this type and shape (their tiles are 256 wide)."""
        return qtype in KERNEL_TYPES and len(shape) == 2 and shape[1] % TILE == 0

    @property
    def shape(self) -> tuple[int, int]:
        return (sum(s.rows for s in self.segments), self.cols)

    @property
    def device(self) -> torch.device:
        return self.segments[0].data.device

    @property
    def nbytes(self) -> int:
        return sum(s.data.numel() for s in self.segments)

    def __getitem__(self, rows: slice) -> "QuantWeight":
        """A row slice (a view): whole rows are whole blocks."""
        start, stop, step = rows.indices(self.shape[0])
        assert step == 1
        out, at = [], 0
        for s in self.segments:
            lo, hi = max(start, at), min(stop, at + s.rows)
            if lo < hi:
                out.append(Segment(s.qtype, s.data[lo - at:hi - at]))
            at += s.rows
        return QuantWeight(out, self.cols, self.dtype)

    def dequantize(self) -> torch.Tensor:
        return torch.cat([qk.dequantize(s.data, s.qtype, self.cols) for s in self.segments]).to(self.dtype)

    def swiglu_pairs(self, down: QuantExperts, x: torch.Tensor, groups: list[tuple[int, list[int]]]) -> torch.Tensor:
        """This gate/up stack and `down`, both in host memory, as SwiGLU experts over rows of x on the CPU in
        their blocks (kernels/host_blocks.py): groups [(expert, its rows of x)] -> [pairs, H] float32."""
        return host_blocks.expert_pairs(x, groups, self, down)

    def takes_int8(self, rows: int, options: KernelOptions = KernelOptions()) -> bool:
        """Whether a product of `rows` rows computes with x quantized to int8 (kernels/x8.py)."""
        return rows <= KERNEL_MAX_ROWS and any(qk.int8_x(s.qtype, rows, self.cols, s.data.numel())
                                               for s in self.segments)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None, x8: tuple | None = None,
               options: KernelOptions = KernelOptions()) -> torch.Tensor:
        """x [..., cols] @ W^T (+ bias). x8: x's int8 copy where the kernel that wrote x made it."""
        flat = x.reshape(-1, self.cols)
        if flat.shape[0] > KERNEL_MAX_ROWS:
            y = torch.nn.functional.linear(flat, self.dequantize())
        else:
            if x8 is None and len(self.segments) > 1 and self.takes_int8(flat.shape[0]):
                x8 = quantize_x(flat)  # one quantized x for every segment that takes it (a fused q/k/v)
            if len(self.segments) == 1:
                s = self.segments[0]
                y = qk.matmul(flat, s.data, s.qtype, s.rows, x8=x8, options=options)
            else:  # each segment writes its own columns: no concatenation after
                y = torch.empty(flat.shape[0], self.shape[0], device=flat.device, dtype=flat.dtype)
                self._segments_into(flat, x8, y, options)
        if bias is not None:
            y = y + bias
        return y.view(*x.shape[:-1], y.shape[-1])

    def _segments_into(self, flat: torch.Tensor, x8, y: torch.Tensor, options: KernelOptions) -> None:
        """Each segment's product into its columns of y; past the first, side by side with it on a second
        stream where options.segments_side_by_side says so (a small segment's product is a short grid whose
        time is mostly its latency)."""
        starts = [0]
        for s in self.segments:
            starts.append(starts[-1] + s.rows)
        jobs = [(s, y[:, a:b]) for s, a, b in zip(self.segments, starts, starts[1:])]
        side_by_side = options.segments_side_by_side
        if not (side_by_side and flat.is_cuda and flat.shape[0] >= side_by_side):
            for s, out in jobs:
                qk.matmul(flat, s.data, s.qtype, s.rows, x8=x8, out=out, options=options)
            return
        main, side = torch.cuda.current_stream(flat.device), _side_stream(flat.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            for s, out in jobs[1:]:
                qk.matmul(flat, s.data, s.qtype, s.rows, x8=x8, out=out, lane=1, options=options)
        s, out = jobs[0]
        qk.matmul(flat, s.data, s.qtype, s.rows, x8=x8, out=out, options=options)
        main.wait_stream(side)

    def gate_up_silu(self, x: torch.Tensor, x8: tuple | None = None,
                     options: KernelOptions = KernelOptions()) -> torch.Tensor | None:
        """silu(gate) * up of a stacked gate/up matrix in one pass, or None when the two halves are not one
        segment (or x has more rows than the kernels take)."""
        flat = x.reshape(-1, self.cols)
        if len(self.segments) != 1 or flat.shape[0] > KERNEL_MAX_ROWS:
            return None
        s = self.segments[0]
        y = qk.matmul(flat, s.data, s.qtype, s.rows // 2, glu=True, x8=x8, options=options)
        return y.view(*x.shape[:-1], y.shape[-1])

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        assert len(self.segments) == 1
        s = self.segments[0]
        return qk.gather(s.data, s.qtype, self.cols, tokens, self.dtype)


class QuantExperts:
    """A sparse layer's stacked experts kept in GGUF blocks of one type: data [E, rows, row_bytes], each
    expert's [rows, cols] matrix (a gate/up stack: its gate rows, then its up rows). The window's
    (row, expert) assignments run as one quantized GEMV each (quant_kernels.expert_matmul); an eager
    product over an expert's rows dequantizes that expert alone."""

    def __init__(self, qtype: int, data: torch.Tensor, cols: int, dtype: torch.dtype):
        self.qtype, self.data, self.cols, self.dtype = qtype, data, cols, dtype

    @classmethod
    def fits(cls, qtype: int, cols: int) -> bool:
        return qtype in KERNEL_TYPES and cols % TILE == 0

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.data.shape[0], self.data.shape[1], self.cols)

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def to(self, device) -> "QuantExperts":
        return QuantExperts(self.qtype, self.data.to(device), self.cols, self.dtype)

    def values(self, e: int, device=None) -> torch.Tensor:
        """Expert e's matrix [rows, cols] in the activations' dtype, dequantized on `device` (default: where
        the blocks are)."""
        return qk.dequantize(self.data[e].to(device or self.device), self.qtype, self.cols).to(self.dtype)

    def dequantize(self) -> torch.Tensor:
        return torch.stack([self.values(e) for e in range(self.data.shape[0])])

    def swiglu_pairs(self, down: QuantExperts, x: torch.Tensor, groups: list[tuple[int, list[int]]]) -> torch.Tensor:
        """This gate/up stack and `down`, both in host memory, as SwiGLU experts over rows of x on the CPU in
        their blocks (kernels/host_blocks.py): groups [(expert, its rows of x)] -> [pairs, H] float32."""
        return host_blocks.expert_pairs(x, groups, self, down)

    def takes_int8(self, rows: int, options: KernelOptions = KernelOptions()) -> bool:
        """Whether the assignments of a window of `rows` rows take x as a 1-row norm leaves it quantized (one
        row: expert_matmul's word GEMVs quantize the rows as that)."""
        return rows == 1 and self.data.shape[0] > 0 and options.expert_word_gemvs and \
            qk.int8_x(self.qtype, 1, self.cols, self.data.shape[1] * self.data.shape[2])

    def assignments(self, x: torch.Tensor, ids: torch.Tensor, share: int = 1, glu: bool = False,
                    x8: tuple | None = None, options: KernelOptions = KernelOptions()) -> torch.Tensor:
        """Assignment a's product with x row a // share over expert ids[a]: [A, rows] (glu: [A, rows / 2],
        silu(gate) * up)."""
        return qk.expert_matmul(x, self.data, self.qtype, self.data.shape[1] // (2 if glu else 1), ids, share, glu,
                                x8=x8, options=options)


def non_finite_blocks(qtype: int, data: torch.Tensor) -> int:
    """Blocks of GGUF data whose float16 fields (the scales) are NaN or inf: the only values of a block of
    the kernels' types that can be, their quants being integers."""
    blocks = data.reshape(-1, BLOCKS[qtype][1])
    bad = torch.zeros(blocks.shape[0], dtype=torch.bool, device=data.device)
    for at in HALF_FIELDS[qtype][0]:
        bad |= ~torch.isfinite(blocks[:, at:at + 2].contiguous().view(torch.float16).squeeze(-1))
    return int(bad.sum())


def replace_parameter(model: torch.nn.Module, name: str, weight) -> None:
    """Put a QuantWeight or QuantExperts where a parameter was (it is no tensor, so it lives as a plain
    attribute)."""
    path, _, attr = name.rpartition(".")
    module = model.get_submodule(path)
    module._parameters.pop(attr, None)
    setattr(module, attr, weight)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every distinct weight: parameters and quantized matrices alike."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, (QuantWeight, QuantExperts)) and id(value) not in seen:
                seen.add(id(value))
                total += value.nbytes
    return total


def random_blocks(qtype: int, rows: int, cols: int, device, generator: torch.Generator) -> torch.Tensor:
    """Valid GGUF blocks of random content: [rows, row_bytes] uint8 on the device."""
    block, size = BLOCKS[qtype]
    raw = torch.randint(0, 256, (rows, cols // block, size), dtype=torch.uint8, device=device, generator=generator)
    offsets, value = HALF_FIELDS[qtype]
    half = torch.tensor([value], dtype=torch.float16).view(torch.uint8).to(device)
    for at in offsets:
        raw[..., at:at + 2] = half
    return raw.view(rows, -1)


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's Q4_K_M rule for the layers whose attn_v and ffn_down get Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


#: a file type: name -> (the type of most matrices, the type of the "more bits" ones and the LM head)
RECIPES = {"Q8_0": (Q8_0, Q8_0), "Q4_0": (Q4_0, Q4_0), "Q4_K_M": (Q4_K, Q6_K), "Q5_K_M": (Q5_K, Q6_K),
           "Q6_K": (Q6_K, Q6_K), "IQ4_XS": (IQ4_XS, IQ4_XS), "Q3_K_M": (Q3_K, Q5_K), "IQ3_XXS": (IQ3_XXS, IQ4_XS)}


def recipe_types(recipe: str, param: str, layers: int) -> list[tuple[int, str]]:
    """(type, rows' role) segments of a parameter of a dense decoder under a file type: q/k/v and gate/up
    can split where the recipe gives v or down more bits."""
    base, more = RECIPES[recipe]
    if param == "lm_head.weight":
        return [(more, "all")]
    if param.startswith("layers."):
        layer = int(param.split(".")[1])
        extra = more if use_more_bits(layer, layers) else base
        if param.endswith("qkv_proj.weight"):
            return [(base, "qk"), (extra, "v")]
        if param.endswith("down_proj.weight"):
            return [(extra, "all")]
    return [(base, "all")]
