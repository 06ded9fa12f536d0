"""Few-row int4 weight-only products that round like the many-rows path (csrc/int4_gemv.cpp).

`met.layers.linear.Int4Weight` multiplies many rows by its dequantized bfloat16 weights on
oneDNN's matrix units and few rows with a GEMV kernel. This kernel (CPUs with AVX512-BF16)
dequantizes each weight to exactly that bfloat16 value before multiplying, so a row gets the
same product, up to the order of float32 sums, whichever path its batch takes: int4 output is
batch-invariant. Where the kernel is unavailable torch's int4 kernel is used (it keeps the
dequantized weights in float32, so outputs then depend on the batch size by ~1 bf16 ulp).
"""

from __future__ import annotations

import torch

from met.kernels.capability import probe
from met.kernels.native import load_native_ops, native_op


def _ops():
    return load_native_ops("int4_gemv")


def available() -> bool:
    """True when this CPU has AVX512-BF16 and the kernel builds (compiles on first call)."""
    return probe().avx512_bf16 and _ops() is not None


def pack(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's layout of int4 weights q [N, K] (0..15) with bfloat16 scale and zero
    [N, K / 32] (weight = (q - 8) * scale + zero)."""
    return _ops().pack(q, scale, zero)


def linear(x: torch.Tensor, packed: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
           out_features: int) -> torch.Tensor:
    """x [M, K] (contiguous bfloat16) times the packed weights: bfloat16 [M, out_features]."""
    qpacked, scale, zero = packed
    return native_op("int4_gemv", "linear")(x, qpacked, scale, zero, out_features)
