"""A GGUF file's metadata and tensor table, read in one pass over a memory map.

gguf-py's ``GGUFReader`` builds a numpy view for every part of every metadata value: for a
262k-token vocabulary that is over a million small arrays and ~15 s on this project's machine
(~3 s for SmolLM2's 49k), paid on every open. The loader needs a few scalars, the chat
template and the tensor table, so this module decodes the format directly: scalars and
strings as Python values, numeric arrays as one numpy array each, string arrays as lists,
and each tensor's data as a view of the memory map shaped the way ``gguf.quants`` expects
(gguf-py's layout: typed arrays for float and integer types, rows of bytes for quantized
ones). Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md (little-endian
files; a big-endian file is refused).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32

# Numeric metadata value types -> little-endian numpy dtypes (gguf-py's own table).
_NUMBERS = {int(kind): np.dtype(t).newbyteorder("<")
            for kind, t in gguf.GGUFReader.gguf_scalar_to_np.items()}
_STRING, _ARRAY = int(gguf.GGUFValueType.STRING), int(gguf.GGUFValueType.ARRAY)

# Tensor types stored as plain numbers, read as typed arrays (everything else: bytes).
_PLAIN_TYPES = {
    gguf.GGMLQuantizationType.F16: np.float16,
    gguf.GGMLQuantizationType.F32: np.float32,
    gguf.GGMLQuantizationType.F64: np.float64,
    gguf.GGMLQuantizationType.I8: np.int8,
    gguf.GGMLQuantizationType.I16: np.int16,
    gguf.GGMLQuantizationType.I32: np.int32,
    gguf.GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the file: ``shape`` in ggml order (innermost first), ``data`` a read-only
    view of the file (typed for plain types, [..., bytes per row] uint8 for quantized)."""

    name: str
    tensor_type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


@dataclass(frozen=True)
class GGUFFile:
    """The metadata (key -> value) and the tensors of a GGUF file, in file order."""

    fields: dict[str, Any]
    tensors: list[GGUFTensor]

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)


class _Cursor:
    """Reads little-endian values from a buffer, front to back."""

    def __init__(self, buf: memoryview, path: str) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, n: int) -> memoryview:
        if self.pos + n > len(self.buf):
            raise ValueError(f"{self.path}: truncated GGUF file (needs {self.pos + n} bytes, "
                             f"has {len(self.buf)})")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def scalar(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        return bytes(self.take(self.scalar("<Q"))).decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        if kind in _NUMBERS:
            dtype = _NUMBERS[kind]
            return np.frombuffer(self.take(dtype.itemsize), dtype=dtype)[0].item()
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            return self.array()
        raise ValueError(f"{self.path}: unknown GGUF metadata value type {kind}")

    def array(self) -> Any:
        kind, count = self.scalar("<I"), self.scalar("<Q")
        if kind in _NUMBERS:
            dtype = _NUMBERS[kind]
            return np.frombuffer(self.take(count * dtype.itemsize), dtype=dtype).copy()
        if kind == _STRING:
            return self._strings(count)
        return [self.value(kind) for _ in range(count)]

    def _strings(self, count: int) -> list[str]:
        # The hot loop of a 262k-token vocabulary: plain int/bytes operations, no struct.
        buf, pos, out = self.buf, self.pos, []
        for _ in range(count):
            n = int.from_bytes(buf[pos : pos + 8], "little")
            pos += 8
            out.append(str(buf[pos : pos + n], "utf-8", "replace"))
            pos += n
        if pos > len(buf):
            raise ValueError(f"{self.path}: truncated GGUF file in a string array")
        self.pos = pos
        return out


def read_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Parse a GGUF file's header, metadata and tensor table; tensor data stays on disk
    (memory-mapped) until read. Raises ValueError for a file that is not GGUF v2/v3."""
    path = os.fspath(path)
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(memoryview(mapped), path)
    if bytes(cur.take(4)) != _MAGIC:
        raise ValueError(f"{path}: not a GGUF file (no GGUF magic)")
    version = cur.scalar("<I")
    if version not in (2, 3):
        hint = " (a big-endian file?)" if version > 0xFFFF else ""
        raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3){hint}")
    n_tensors, n_fields = cur.scalar("<Q"), cur.scalar("<Q")
    fields = {}
    for _ in range(n_fields):
        key = cur.string()
        fields[key] = cur.value(cur.scalar("<I"))
    table = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = tuple(cur.scalar("<Q") for _ in range(cur.scalar("<I")))
        table.append((name, gguf.GGMLQuantizationType(cur.scalar("<I")), dims, cur.scalar("<Q")))
    alignment = int(fields.get("general.alignment", _DEFAULT_ALIGNMENT))
    data_start = -(-cur.pos // alignment) * alignment
    tensors = [_tensor(mapped, data_start, *entry) for entry in table]
    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        raise ValueError(f"{path}: duplicated tensor names")
    return GGUFFile(fields, tensors)


def _tensor(mapped: np.memmap, data_start: int, name: str, kind: gguf.GGMLQuantizationType,
            dims: tuple[int, ...], offset: int) -> GGUFTensor:
    n_elems = int(np.prod(dims, dtype=np.int64))
    np_dims = tuple(reversed(dims))
    start = data_start + offset
    if kind in _PLAIN_TYPES:
        dtype = np.dtype(_PLAIN_TYPES[kind])
        n_bytes = n_elems * dtype.itemsize
    else:
        block, type_size = gguf.GGML_QUANT_SIZES[kind]
        dtype, n_bytes = np.dtype(np.uint8), n_elems * type_size // block
        np_dims = gguf.quant_shape_to_byte_shape(np_dims, kind)
    if start + n_bytes > mapped.shape[0]:
        raise ValueError(f"tensor {name!r} runs past the end of the file")
    data = mapped[start : start + n_bytes].view(dtype).reshape(np_dims)
    return GGUFTensor(name, kind, dims, data)
