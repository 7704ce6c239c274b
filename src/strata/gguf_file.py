"""Reading GGUF files safely: the header walked and every count checked against the file's size before
gguf's reader allocates for it, then the metadata as Python values and the tensor table."""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .errors import ArtifactError


@dataclass
class TensorInfo:
    name: str
    type: object  # gguf.GGMLQuantizationType
    shape: list[int]  # GGML order (fastest dimension first)
    data: np.ndarray  # the raw bytes' view, as gguf's reader gives it


def _sizes():
    """Smallest encoded size of one metadata value of each type (strings: their u64 length; arrays:
    item type and count)."""
    import gguf

    sizes = {t: np.dtype(d).itemsize for t, d in gguf.GGUFReader.gguf_scalar_to_np.items()}
    sizes[gguf.GGUFValueType.STRING] = 8
    sizes[gguf.GGUFValueType.ARRAY] = 12
    return sizes


def check_counts(path: Path) -> None:
    """Walk the GGUF header and refuse any count or length that the rest of the file cannot hold,
    before gguf's reader builds per-element views (a corrupt array length would exhaust memory)."""
    import gguf

    T = gguf.GGUFValueType
    sizes = _sizes()
    where = str(path)
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        f.seek(0)

        def take(n: int, what: str) -> bytes:
            if n > size - f.tell():
                raise ArtifactError(f"{where}: {what} at byte {f.tell()} runs past the end of the file "
                                    f"({size} bytes)")
            return f.read(n)

        def u32(what):
            return struct.unpack("<I", take(4, what))[0]

        def u64(what):
            return struct.unpack("<Q", take(8, what))[0]

        def value_type(raw: int, what: str):
            try:
                return T(raw)
            except ValueError:
                raise ArtifactError(f"{where}: {what} has unknown value type {raw}") from None

        def value(vtype, what: str) -> None:
            if vtype == T.STRING:
                take(u64(what + " length"), what)
            elif vtype == T.ARRAY:
                item = value_type(u32(what + " item type"), what)
                if item == T.ARRAY:  # as llama.cpp, which refuses the file
                    raise ArtifactError(f"{where}: {what} is an array of arrays, which GGUF readers do not take")
                count = u64(what + " count")
                if count * sizes[item] > size - f.tell():
                    raise ArtifactError(f"{where}: {what} claims {count} items, more than the file holds")
                if item == T.STRING:
                    for _ in range(count):
                        take(u64(what + " length"), what)
                else:
                    take(count * sizes[item], what)
            else:
                take(sizes[vtype], what)

        if take(4, "magic") != b"GGUF":
            raise ArtifactError(f"{where}: not a GGUF file (bad magic)")
        u32("version")
        n_tensors, n_kv = u64("tensor count"), u64("metadata count")
        if n_kv * 16 > size or n_tensors * 24 > size:
            raise ArtifactError(f"{where}: header claims {n_tensors} tensors and {n_kv} metadata keys, "
                                f"more than {size} bytes can hold")
        alignment = 32
        for i in range(n_kv):
            key = take(u64(f"metadata key {i} length"), f"metadata key {i}").decode("utf-8", "replace")
            vtype = value_type(u32(f"metadata '{key}' type"), f"metadata '{key}'")
            if key == "general.alignment" and vtype == T.UINT32:
                alignment = u32("general.alignment") or 1
            else:
                value(vtype, f"metadata '{key}'")
        extents = []
        for i in range(n_tensors):
            name = take(u64(f"tensor {i} name length"), f"tensor {i} name").decode("utf-8", "replace")
            dims = u32(f"tensor '{name}' dimension count")
            if dims > 4:
                raise ArtifactError(f"{where}: tensor '{name}' has {dims} dimensions, at most 4 allowed")
            shape = struct.unpack(f"<{dims}Q", take(8 * dims, f"tensor '{name}' shape"))
            qtype, offset = struct.unpack("<IQ", take(12, f"tensor '{name}' type and offset"))
            extents.append((name, shape, qtype, offset))
        start = -(-f.tell() // alignment) * alignment
        for name, shape, qtype, offset in extents:
            try:
                block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
            except (ValueError, KeyError):
                raise ArtifactError(f"{where}: tensor '{name}' has unknown type {qtype}") from None
            nbytes = int(np.prod(shape, dtype=object)) // block * type_size
            if start + offset + nbytes > size:
                raise ArtifactError(f"{where}: truncated at tensor '{name}': its {nbytes} bytes at byte "
                                    f"{start + offset} run past the end of the file ({size} bytes)")


def field_value(field):
    """A metadata field as a Python value (arrays as lists)."""
    import gguf

    types = field.types
    if not types:
        return None
    if types[0] == gguf.GGUFValueType.ARRAY:
        if types[-1] == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", "replace") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    if types[0] == gguf.GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", "replace")
    return field.parts[field.data[0]].tolist()[0]


def read(path: Path) -> tuple[dict, list[TensorInfo]]:
    """(metadata key -> value, tensor table) of a GGUF file, or ArtifactError naming what is wrong. The
    tensors' data are views of the memory-mapped file; a file read again unchanged is not parsed again
    (loading a target reads its configuration, vocabulary and tensors)."""
    path = Path(path)
    if not path.is_file():
        if path.exists():
            from .files import kind_of

            raise ArtifactError(f"{path}: is {kind_of(path.stat().st_mode)} (expected a GGUF file)")
        raise ArtifactError(f"{path}: no such file")
    try:
        stat = path.stat()
        return _read(path, stat.st_size, stat.st_mtime_ns)
    except OSError as e:
        raise ArtifactError(f"{path}: cannot read the file ({e.strerror or e})") from None


@functools.lru_cache(maxsize=2)
def _read(path: Path, size: int, mtime: int) -> tuple[dict, list[TensorInfo]]:
    import gguf

    where = str(path)
    check_counts(path)
    try:
        reader = gguf.GGUFReader(str(path))
        kv = {name: field_value(f) for name, f in reader.fields.items()}
        infos = [TensorInfo(t.name, t.tensor_type, [int(x) for x in t.shape], t.data) for t in reader.tensors]
    except ArtifactError:
        raise
    except OSError:
        raise
    except Exception as e:  # noqa: BLE001 - any parse failure of a corrupt file is the file's fault
        raise ArtifactError(f"{where}: not a readable GGUF file ({type(e).__name__}: {e})") from None
    names = [i.name for i in infos]
    if len(set(names)) != len(names):
        raise ArtifactError(f"{where}: duplicate tensor names")
    check_layout(reader, where)
    return kv, infos


def check_layout(reader, where: str) -> None:
    """Tensor data as llama.cpp requires it: each tensor where the ones before it end, padded to the file's
    alignment, so that no two overlap and every one is aligned (gguf's reader takes any offset)."""
    end = 0
    for t in reader.tensors:
        offset = int(t.data_offset) - int(reader.data_offset)
        if offset != end:
            raise ArtifactError(f"{where}: tensor '{t.name}' data is at offset {offset}, expected {end} (tensors "
                                f"follow each other, each padded to {reader.alignment} bytes)")
        end += -(-int(t.n_bytes) // reader.alignment) * reader.alignment


def dequantizable() -> set:
    import gguf
    from gguf import quants

    T = gguf.GGMLQuantizationType
    return {t for t in T if t in quants._type_traits} | {T.F32, T.F16, T.BF16}


def values(info: TensorInfo, shape: tuple, where: str) -> torch.Tensor:
    """A tensor's values: F32/F16/BF16 as stored, quantized types (matrices only) dequantized to float32 by
    gguf's reference (gguf.quants.dequantize)."""
    import gguf

    T = gguf.GGMLQuantizationType
    if tuple(reversed(info.shape)) != shape:
        raise ArtifactError(f"{where}: tensor '{info.name}' has shape {list(reversed(info.shape))} (GGML "
                            f"{info.shape}), expected {list(shape)}")
    allowed = {T.F32, T.F16, T.BF16} if len(shape) == 1 else dequantizable()
    if info.type not in allowed:
        names = sorted(t.name for t in allowed)
        raise ArtifactError(f"{where}: tensor '{info.name}' has type {getattr(info.type, 'name', info.type)}, "
                            f"expected one of {', '.join(names)}")
    data = np.ascontiguousarray(info.data)
    if info.type == T.BF16:
        raw = data.view(np.uint16)
        if raw.size != int(np.prod(shape)):
            raise ArtifactError(f"{where}: tensor '{info.name}' data is truncated")
        return torch.from_numpy(raw.reshape(shape).copy()).view(torch.bfloat16)
    if info.type in (T.F32, T.F16):
        if data.size != int(np.prod(shape)):
            raise ArtifactError(f"{where}: tensor '{info.name}' data is truncated")
        return torch.from_numpy(data.reshape(shape).copy())
    block, type_size = gguf.GGML_QUANT_SIZES[info.type]
    if shape[-1] % block or data.nbytes != int(np.prod(shape)) // block * type_size:
        raise ArtifactError(f"{where}: tensor '{info.name}' data is truncated or its rows are not whole "
                            f"{info.type.name} blocks of {block}")
    return reference_values(data, info.type).reshape(shape)


def reference_values(blocks: np.ndarray, qtype) -> torch.Tensor:
    """Quantized blocks (bytes, the last axis whole blocks) as float32 values, by gguf's reference
    (gguf.quants.dequantize): what the CPU keeps of a quantized matrix."""
    import gguf
    from gguf import quants

    with np.errstate(all="ignore"):  # blocks whose scales overflow give inf/nan values, as in llama.cpp, silently
        values = quants.dequantize(blocks, gguf.GGMLQuantizationType(qtype))
    return torch.from_numpy(values.astype(np.float32, copy=False))


def rows_of_blocks(info: TensorInfo, shape: tuple) -> torch.Tensor:
    """A quantized matrix's bytes as stored: uint8 [rows, row_bytes] (each row whole blocks)."""
    return torch.from_numpy(np.ascontiguousarray(info.data).reshape(shape[0], -1).copy())
