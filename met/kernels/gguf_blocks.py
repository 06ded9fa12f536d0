"""GGUF weights kept quantized in memory: the file's blocks, as the file stores them.

A `Blocks` is one matrix (or a run of rows of one) in one ggml format: uint8 [rows, row_bytes].
The native kernel (csrc/gguf_blocks.cpp, AVX2 / AVX-512 clones) multiplies float32 or
bfloat16 rows by it, decoding four output channels at a time into a buffer that stays in
cache and summing in float32: the weights are exactly the values gguf-py's dequantize gives,
so the product is the float32 model's up to the order of the sums, and a row's result does
not depend on its batch. Without the kernel, `linear` dequantizes with gguf-py (the reference,
slow). A fused projection (q/k/v) is a list of `Blocks`, one per run of rows of one format,
each writing its own columns of the output.
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np
import torch

from met.kernels.capability import probe
from met.kernels.native import load_native_ops, native_op

_Q = gguf.GGMLQuantizationType

# The formats kept as blocks (others are dequantized at load): those of llama.cpp's common
# quantizations (Q4_0 ... Q8_0; Q4_K_M and Q5_K_M files mix Q4_K/Q5_K with Q6_K and Q8_0).
KEPT_FORMATS = frozenset({_Q.Q4_0, _Q.Q4_1, _Q.Q5_0, _Q.Q5_1, _Q.Q8_0, _Q.Q4_K, _Q.Q5_K,
                          _Q.Q6_K})
# What the kernel also reads, for rows fused beside blocks (a float bias-free part).
_FLOAT_FORMATS = frozenset({_Q.F32, _Q.F16, _Q.BF16})


@dataclass(frozen=True)
class Blocks:
    """rows x cols weights in ggml format ``kind``: ``data`` uint8 [rows, row_bytes]."""

    kind: int
    data: torch.Tensor
    cols: int

    @property
    def rows(self) -> int:
        return int(self.data.shape[0])

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    @property
    def kind_name(self) -> str:
        return _Q(self.kind).name

    def take_rows(self, index: torch.Tensor) -> Blocks:
        """These rows, in ``index``'s order (a row permutation, a gather)."""
        return Blocks(self.kind, self.data.index_select(0, index), self.cols)

    def dequantize(self) -> torch.Tensor:
        """float32 [rows, cols]: gguf-py's values (the kernel's decoder, or gguf-py)."""
        op = _op("dequantize")
        if op is not None and self.data.device.type == "cpu":
            return op(self.data, self.kind, self.cols)
        return reference_dequantize(self)


def keeps(kind: int, shape: tuple[int, ...]) -> bool:
    """Whether a tensor of ggml type ``kind`` and torch shape ``shape`` stays as blocks."""
    return kind in KEPT_FORMATS and len(shape) == 2 and shape[1] % 32 == 0


def kind_of(name: str) -> int:
    """The ggml type id of a type name ("Q4_K")."""
    return int(_Q[name])


def from_float(weight: torch.Tensor, kind: int = _Q.Q8_0) -> Blocks:
    """A float matrix quantized with gguf-py (what llama.cpp's quantizer stores), for
    ``--quantization gguf`` on a float checkpoint; float32 rows are kept as F32 blocks."""
    w = weight.detach().float().contiguous().numpy()
    if kind == _Q.F32:
        data = w.view(np.uint8)
    else:
        data = gguf.quants.quantize(w, _Q(kind))
    return Blocks(int(kind), torch.from_numpy(np.ascontiguousarray(data)), w.shape[1])


def concat(parts: list[list[Blocks]]) -> list[Blocks]:
    """The blocks of matrices stacked by rows: adjacent runs of one format merged."""
    out: list[Blocks] = []
    for segment in (s for part in parts for s in part):
        if out and out[-1].kind == segment.kind and out[-1].cols == segment.cols:
            prev = out.pop()
            segment = Blocks(prev.kind, torch.cat([prev.data, segment.data]), prev.cols)
        out.append(segment)
    return out


def available() -> bool:
    """Whether the native kernel runs here (AVX2 and the extension built)."""
    return probe().avx2 and load_native_ops("gguf_blocks") is not None


def _op(name: str):
    return native_op("gguf_blocks", name) if probe().avx2 else None


def linear(x: torch.Tensor, segments: list[Blocks], out_dtype: torch.dtype,
           native: bool = True) -> torch.Tensor:
    """x [M, K] (float32 or bfloat16, contiguous) times the stacked segments' transpose:
    [M, sum of rows] in ``out_dtype`` (float32 or bfloat16)."""
    rows = sum(s.rows for s in segments)
    out = torch.empty(x.shape[0], rows, dtype=out_dtype)
    op = _op("linear") if native else None
    col = 0
    for s in segments:
        if op is not None:
            op(x, s.data, s.kind, s.cols, out, col)
        else:
            w = reference_dequantize(s)
            out[:, col:col + s.rows] = (x.float() @ w.T).to(out_dtype)
        col += s.rows
    return out


def reference_dequantize(blocks: Blocks) -> torch.Tensor:
    """gguf-py's dequantize of the blocks: float32 [rows, cols]."""
    data = blocks.data.cpu().numpy()
    if blocks.kind in _FLOAT_FORMATS:
        dtype = {_Q.F32: np.float32, _Q.F16: np.float16, _Q.BF16: None}[_Q(blocks.kind)]
        if dtype is None:  # bfloat16: the high half of a float32
            bits = data.view(np.uint16).astype(np.uint32) << 16
            return torch.from_numpy(bits.view(np.float32).reshape(blocks.rows, blocks.cols))
        return torch.from_numpy(data.view(dtype).astype(np.float32).reshape(blocks.rows, -1))
    values = gguf.quants.dequantize(data, _Q(blocks.kind))
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)
                            .reshape(blocks.rows, blocks.cols))
