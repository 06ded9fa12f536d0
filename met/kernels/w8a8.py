"""int8 weights × int8 activations (``--quantization w8a8``): csrc/w8a8.cpp and its fallback.

Weights: int8 per output channel (scale = max|w| / 127). Activations: each row quantized to
int8 when the layer runs, with its own scale (max|x| / 127). The product of two int8 rows is
summed exactly in int32, then scaled: y = float(Σ q_x q_w) · (s_x · s_w) (+ bias). Exact
integer sums make the result independent of the kernel: few rows go through a VNNI GEMV
kernel (reads one byte per weight, a quarter of float32's, and skips bfloat16 GEMV's
conversions), many rows through oneDNN's int8 matrix multiply over its pre-packed copy of the
weights (unit scales, so it returns float(Σ q_x q_w), one rounding as in the GEMV kernel;
torch._int_mm where that op is missing); both quantize and scale with the same C++ code, so
a row's output is bitwise the same in any batch.
Without AVX512-VNNI (or a compiler) every row goes through the same plain-PyTorch path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from met.kernels.capability import probe
from met.kernels.int_activations import IntActivationLinear
from met.kernels.native import load_native_ops, native_op

_KEY = "w8a8"
_GROUP = 64  # output channels per group of the GEMV layout
# Rows up to which the GEMV kernel is at least as fast as quantize + oneDNN + scale_out on the
# embedded model's shapes (benchmarks/w4a8_linear.py measures both): the GEMV rereads the
# activations per output group, which a very wide layer (the LM head) pays for sooner.
# Layers wider than LARGE_WEIGHT weights use the smaller bound.
GEMV_MAX_ROWS = 16
GEMV_MAX_ROWS_LARGE = 6
LARGE_WEIGHT = 1 << 22


def available() -> bool:
    """True when this CPU has AVX512-VNNI and the kernels build (compiles on first call)."""
    return probe().avx512_vnni and load_native_ops(_KEY) is not None


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float weights [N, K] → (int8 [N, K], float32 scales [N]), symmetric per channel."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def pack(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The GEMV kernel's layout of int8 weights [N, K]: (packed [N/64, K/4, 4, 16, 4] with
    N and K padded by zeros, wsum128 int32 [N padded] = 128 · Σ_k q)."""
    n, k = q.shape
    n_pad, k_pad = -n % _GROUP, -k % 4
    qp = F.pad(q, (0, k_pad, 0, n_pad))
    groups, quads = qp.shape[0] // _GROUP, qp.shape[1] // 4
    packed = qp.reshape(groups, 4, 16, quads, 4).permute(0, 3, 1, 2, 4).contiguous()
    wsum = (qp.to(torch.int32).sum(dim=1) * 128).to(torch.int32).contiguous()
    return packed, wsum


def _onednn_pack(q: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's pre-packed copy of int8 weights [N, K] for its int8 matmul, or None where
    this torch has no oneDNN quantized linear (torch._int_mm is used then)."""
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.onednn.qlinear_prepack.default(q, None)
    except (AttributeError, RuntimeError):
        return None


def _pad(v: torch.Tensor | None, n: int) -> torch.Tensor | None:
    return None if v is None else F.pad(v.float(), (0, -v.shape[0] % n)).contiguous()


class Int8Dynamic(IntActivationLinear):
    """int8 [N, K] weights with per-channel scales, int8 activations with per-row scales."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 kernel: str | None = "auto"):
        """``kernel``: "w8a8" (the native GEMV), None (PyTorch ops) or "auto"."""
        super().__init__()
        q, scale = quantize_weight(weight)
        self.out_features, self.in_features = q.shape
        self.register_buffer("qweight", q)  # [N, K]; torch._int_mm takes its transpose
        native = available() if kernel == "auto" else kernel is not None
        self.native = weight.device.type == "cpu" and native
        self.gemv_max_rows = (GEMV_MAX_ROWS if q.numel() <= LARGE_WEIGHT
                              else GEMV_MAX_ROWS_LARGE)
        self.register_buffer("scale", _pad(scale, _GROUP) if self.native else scale)
        self.register_buffer("bias", None if bias is None else
                             (_pad(bias, _GROUP) if self.native else bias.detach().float()))
        if self.native:
            packed, wsum = pack(q)
            self.register_buffer("packed", packed)
            self.register_buffer("wsum128", wsum)
        self.onednn = _onednn_pack(q) if self.native else None
        if self.onednn is not None:
            self.register_buffer("ones", torch.ones(self.out_features))
            self.register_buffer("zero_points", torch.zeros(self.out_features,
                                                            dtype=torch.int64))

    def _product(self, x: torch.Tensor, out_float: bool) -> torch.Tensor:
        if not self.native:
            return self._torch_product(x, out_float)
        if x.shape[0] <= self.gemv_max_rows:
            return native_op(_KEY, "gemv")(x, self.packed, self.wsum128, self.scale,
                                                     self.bias, self.out_features, out_float)
        q, sx = native_op(_KEY, "quantize")(x)
        if self.onednn is not None:
            acc = torch.ops.onednn.qlinear_pointwise.default(
                q, 1.0, 0, self.onednn, self.ones, self.zero_points, None, 1.0, 0,
                torch.float32, "none", [None], "")
        else:
            acc = torch._int_mm(q, self.qweight.t())
        return native_op(_KEY, "scale_out")(acc, sx, self.scale, self.bias, out_float)

    def _torch_product(self, x: torch.Tensor, out_float: bool) -> torch.Tensor:
        """The same arithmetic in plain PyTorch, one path for every row count."""
        xf = x.float()
        absmax = xf.abs().amax(dim=1)
        # Tensor-by-tensor divisions: torch divides by a Python scalar through its
        # reciprocal, one rounding more than the kernel's (and IEEE) division.
        c127 = torch.full_like(absmax, 127.0)
        inv = torch.where(absmax > 0, c127 / absmax, torch.zeros_like(absmax))
        q = torch.round(xf * inv[:, None]).clamp(-127, 127).to(torch.int8)
        acc = torch._int_mm(q, self.qweight.t())
        n = self.out_features
        y = acc.float() * ((absmax / c127)[:, None] * self.scale[None, :n])
        if self.bias is not None:
            y = y + self.bias[:n]
        return y if out_float else y.to(torch.bfloat16)

    def dequantized(self) -> torch.Tensor:
        """The weights these integers stand for, float32 [N, K]."""
        return self.qweight.float() * self.scale[: self.out_features, None]
