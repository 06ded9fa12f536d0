"""4-bit weights × 8-bit activations (``--quantization w4a8``): csrc/w4a8.cpp.

The arithmetic llama.cpp runs a Q4_1 GGUF with: weights in blocks of 32 along the input,
each w = d · q + m with q in 0..15 (a Q4_0 / Q4_1 file's own integers and scales, exactly;
float weights are fitted to that form), and each activation row quantized to int8 in blocks
of 32 with its own scale when the layer runs. VPDPBUSD sums the products of the 4-bit and
8-bit integers exactly per block; the block sums are scaled and added in float32 in a fixed
order. One kernel runs every number of rows, so a row's output is bitwise the same in any
batch (from `AMX_MIN_ROWS` rows on, AMX-INT8 tiles compute the same exact integer sums and
the same float steps follow). It reads half a byte per weight (plus float16 d and m per 32):
decode at few rows is memory-bound, and this is the smallest read of met's paths. On CPUs
with AVX2 but no AVX512-VNNI, csrc/w4a8_avx2.cpp computes the same integer sums with
VPMADDUBSW and the same float steps: the same bits. Both take bfloat16 or float32 rows
(float32 on CPUs without native bfloat16, where the model runs in float32). Without either
ISA (or a compiler) a plain-PyTorch path computes the same formula (not bitwise the
kernel's).

The LM head is `Int8Blocks`: 8-bit weights in 32-value blocks (GGUF Q8_0's form, the head
llama.cpp runs a Q4 file with) times the same block-quantized activations. Against float32
on the embedded model the whole path is ~0.055 nats of logprob on average (docs/
benchmarks.md); per-row int8 activations (w8a8) cost ~0.2.
"""

from __future__ import annotations

import functools
from abc import abstractmethod
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from met.kernels.capability import probe
from met.kernels.int_activations import IntActivationLinear
from met.kernels.native import load_native_ops, native_op

# (ISA, extension key, runs here): the AVX512-VNNI kernel (with AMX tiles where present)
# and, for CPUs with AVX2 only, the same ops, layout and bits from VPMADDUBSW.
_KERNELS = (("avx512-vnni", "w4a8", lambda cap: cap.avx512_vnni),
            ("avx2", "w4a8_avx2", lambda cap: cap.avx2))
_GROUP = 64  # output channels per group of the kernel's layout
BLOCK = 32  # weights / activations per scale
# From this many rows on, AMX-INT8 tiles (where the CPU has them) compute the block sums:
# the same bits as the VNNI path (csrc/w4a8.cpp). Measured on the embedded model's shapes
# (2-core Sapphire Rapids, a layer's four projections, cache-hot, after the AMX float steps
# moved into registers): AMX / VNNI 1.14x at 32 rows and 1.15x at 48, 1.03x at 16 but
# 0.75-0.95x at 20-28 (the 16-row tiles' padding). The float steps after the integer sums,
# the same in both paths, take most of the time at many rows.
AMX_MIN_ROWS = 32


@functools.cache
def _kernel() -> tuple[str, str] | None:
    """(ISA, extension key) of the `_KERNELS` entry for this CPU: w4a8 where it has
    AVX512-VNNI, else w4a8_avx2 where it has AVX2 (+ FMA, F16C); None without either or
    without a compiler."""
    cap = probe()
    for isa, key, runs in _KERNELS:
        if runs(cap) and load_native_ops(key) is not None:
            return isa, key
    return None


def available() -> bool:
    """True when this CPU has AVX512-VNNI or AVX2 and the kernel builds (compiles on first
    call)."""
    return _kernel() is not None


def kernel_isa() -> str | None:
    """"avx512-vnni" or "avx2": which kernel runs here (None: the plain-PyTorch path)."""
    kernel = _kernel()
    return None if kernel is None else kernel[0]


def prompt_rows_available() -> bool:
    """True when the kernel can run prompt rows through bfloat16 weights (AMX-BF16 tiles):
    `Int4Dynamic.prompt_rows_kernel`."""
    kernel = _kernel()
    return kernel is not None and kernel[0] == "avx512-vnni" and probe().amx_bf16


def fit_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float weights [N, K] → (q uint8 0..15, d, m float16 [N, K / 32]) with w ≈ d q + m:
    16 levels between each block's min and max (GGUF Q4_1's form)."""
    n, k = weight.shape
    w = weight.detach().float().reshape(n, k // BLOCK, BLOCK)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    d = ((hi - lo) / 15.0).to(torch.float16)
    m = lo.to(torch.float16)
    df = d.float().clamp(min=1e-12)[..., None]
    q = torch.round((w - m.float()[..., None]) / df).clamp(0, 15)
    return q.to(torch.uint8).reshape(n, k), d, m


def pack(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's layout (csrc/w4a8.cpp) of q [N, K] (0..15) and d, m [N, K / 32]."""
    n, k = q.shape
    pad = -n % _GROUP
    q = F.pad(q.to(torch.uint8), (0, 0, 0, pad))
    d = F.pad(d.to(torch.float16), (0, 0, 0, pad))
    m = F.pad(m.to(torch.float16), (0, 0, 0, pad))
    groups, nb = q.shape[0] // _GROUP, k // BLOCK
    # k = 32 b + 8 p + 4 h + i; lane byte i of pair p: q(h = 0) | q(h = 1) << 4
    q7 = q.reshape(groups, 4, 16, nb, 4, 2, 4)
    nibbles = q7[:, :, :, :, :, 0, :] | (q7[:, :, :, :, :, 1, :] << 4)
    packed = nibbles.permute(0, 3, 4, 1, 2, 5).contiguous()  # [g, b, p, j, lane, i]
    return packed, _scale_layout(d), _scale_layout(m)


def _scale_layout(v: torch.Tensor) -> torch.Tensor:
    """Per-block float16 values [N (a multiple of 64), K / 32] → the kernels' [g, b, j, lane]."""
    n, nb = v.shape
    return v.reshape(n // _GROUP, 4, 16, nb).permute(0, 3, 1, 2).contiguous()


def _row_layout(v: torch.Tensor) -> torch.Tensor:
    """`_scale_layout` undone, as float32 [N, K / 32, 1]."""
    g, nb = v.shape[0], v.shape[1]
    return v.permute(0, 2, 3, 1).reshape(g * _GROUP, nb, 1).float()


def block_quantized_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                            out_float: bool) -> torch.Tensor:
    """The kernels' formula in plain PyTorch: x's rows quantized to int8 per 32-value block,
    times the float32 weights [N, K] the integers stand for (rounding differs from the
    kernels' integer sums)."""
    rows, k = x.shape
    xb = x.float().reshape(rows, k // BLOCK, BLOCK)
    absmax = xb.abs().amax(dim=-1, keepdim=True)
    c127 = torch.full_like(absmax, 127.0)
    inv = torch.where(absmax > 0, c127 / absmax, torch.zeros_like(absmax))
    xq = torch.round(xb * inv).clamp(-127, 127) * (absmax / c127)
    y = xq.reshape(rows, k) @ weight.t()
    if bias is not None:
        y = y + bias[: weight.shape[0]]
    return y if out_float else y.to(torch.bfloat16)


class KernelCall(NamedTuple):
    """A 4-bit projection as its op runs it: ``op(x, *weights, bias, out_features,
    out_float, AMX_MIN_ROWS, prompt_rows)``."""

    op: str  # the qualified op name, e.g. "met_w4a8_avx2_<hash>::linear"
    weights: tuple[torch.Tensor, ...]  # packed, d, m
    bias: torch.Tensor | None
    out_features: int


class _BlockKernelLinear(IntActivationLinear):
    """Shared by the two weight forms of csrc/w4a8.cpp: the kernel's buffers (``packed`` and
    the per-block scales, `_kernel_buffers`) where it runs, else the float32 weights the
    integers stand for and the same formula in plain PyTorch. Subclasses give the integers
    (`_integers`), their kernel layout (`_pack`), their float value (`_float_weight`) and how
    to read them back (`_unpack`)."""

    _op: str  # the kernel's op in csrc/w4a8.cpp
    _kernel_buffers: tuple[str, ...]  # the weight buffers the op takes, in order
    _takes_prompt_rows = False  # the op's last argument is prompt_rows (4-bit weights)
    takes_float32 = True  # both kernels and block_quantized_product quantize float32 rows

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 kernel: str | None = "auto"):
        """``kernel``: the extension that runs it ("w4a8", "w4a8_avx2"; None: PyTorch ops;
        "auto": the best this CPU runs), as the linear-method registry chose."""
        super().__init__()
        n, k = weight.shape
        if k % BLOCK:
            raise ValueError(f"quantization w4a8: input size {k} is not a multiple of {BLOCK}")
        self.out_features, self.in_features = n, k
        integers = self._integers(weight)
        if kernel == "auto":
            kernel = _kernel()[1] if available() else None
        if weight.device.type != "cpu":
            kernel = None
        self.kernel_key = kernel
        self.native = kernel is not None
        if self.native:
            for name, tensor in zip(self._kernel_buffers, self._pack(*integers), strict=True):
                self.register_buffer(name, tensor)
            bias_f = None if bias is None else F.pad(bias.detach().float(), (0, -n % _GROUP))
        else:
            self.register_buffer("weight_f32", self._float_weight(*integers).contiguous())
            bias_f = None if bias is None else bias.detach().float()
        self.register_buffer("bias", None if bias_f is None else bias_f.contiguous())

    @abstractmethod
    def _integers(self, weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The integers and per-block scales the weights become."""

    @abstractmethod
    def _pack(self, *integers: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The integers in the kernel's layout, `_kernel_buffers`' tensors in order."""

    @abstractmethod
    def _float_weight(self, *integers: torch.Tensor) -> torch.Tensor:
        """The float32 weights [N, K] the integers stand for."""

    @abstractmethod
    def _unpack(self) -> torch.Tensor:
        """`_float_weight` read back from the packed buffers ([N padded to 64, K])."""

    def bf16_rows(self) -> Callable[[torch.Tensor], torch.Tensor]:
        if not self.native:
            return super().bf16_rows()
        return self._rows_call(out_float=False)

    def float32_rows(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        return self._rows_call(out_float=True) if self.native else None

    def _rows_call(self, out_float: bool) -> Callable[[torch.Tensor], torch.Tensor]:
        """The kernel call on 2-D contiguous rows with every other argument bound."""
        kernel, weights, bias, n = self._bound()
        if self._takes_prompt_rows:
            return lambda x: kernel(x, *weights, bias, n, out_float, AMX_MIN_ROWS, 0)
        return lambda x: kernel(x, *weights, bias, n, out_float, AMX_MIN_ROWS)

    def kernel_call(self) -> KernelCall | None:
        """The 4-bit op and its bound arguments, for a caller that runs this projection from
        C++ (met.layers.layer_stack); None off the native kernel or for 8-bit weights."""
        if not (self.native and self._takes_prompt_rows):
            return None
        kernel, weights, bias, n = self._bound()
        return KernelCall(kernel.name(), weights, bias, n)

    def _bound(self) -> tuple[Callable, tuple[torch.Tensor, ...], torch.Tensor | None, int]:
        """What a bound kernel call needs: the op, the weight buffers, the bias, N."""
        weights = tuple(getattr(self, name) for name in self._kernel_buffers)
        return native_op(self.kernel_key, self._op), weights, self.bias, self.out_features

    def _product(self, x: torch.Tensor, out_float: bool) -> torch.Tensor:
        if self.native:
            return self.kernel(x, out_float, AMX_MIN_ROWS)
        return self._torch_product(x, out_float)

    def kernel(self, x: torch.Tensor, out_float: bool, amx_min_rows: int,
               prompt_rows: int = 0) -> torch.Tensor:
        """The native kernel on x [M, K] contiguous bfloat16 or float32; AMX tiles from
        ``amx_min_rows`` rows on (same bits either way); the first ``prompt_rows`` rows
        through bfloat16 weights (`Int4Dynamic.prompt_rows_kernel`)."""
        if prompt_rows and not self._takes_prompt_rows:
            raise ValueError(f"{type(self).__name__} has no prompt-rows path")
        kernel, weights, bias, n = self._bound()
        extra = (prompt_rows,) if self._takes_prompt_rows else ()
        return kernel(x, *weights, bias, n, out_float, amx_min_rows, *extra)

    def _torch_product(self, x: torch.Tensor, out_float: bool) -> torch.Tensor:
        return block_quantized_product(x, self.dequantized(), self.bias, out_float)

    def dequantized(self) -> torch.Tensor:
        """The float32 weights [N, K] the integers stand for."""
        return self._unpack()[: self.out_features] if self.native else self.weight_f32


class Int4Dynamic(_BlockKernelLinear):
    """Q4_1-form weights [N, K] × activations quantized per 32-value block."""

    _op = "linear"
    _kernel_buffers = ("packed", "d", "m")
    _takes_prompt_rows = True

    def prompt_rows_kernel(self) -> Callable[[torch.Tensor, int], torch.Tensor] | None:
        """``f(x, prompt_rows)``: x's first ``prompt_rows`` rows (positions inside their
        request's prompt, which the runner orders first) times the weights dequantized to
        bfloat16 (w = d q + m rounded once), unquantized, on AMX-BF16 tiles in float32;
        the other rows as `forward`. Prefill at many rows costs about half the int8 path
        (its per-block float steps are gone) and each row's output still depends on that
        row alone. None where the CPU has no AMX-BF16 (every row then takes the int8 path).
        """
        if not (self.kernel_key == "w4a8" and prompt_rows_available()):
            return None
        kernel, weights, bias, n = self._bound()
        return lambda x, prompt_rows: kernel(x, *weights, bias, n, False, AMX_MIN_ROWS,
                                             prompt_rows)

    def _integers(self, weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
        blocks = getattr(weight, "q4_blocks", None)
        if blocks is not None:  # a GGUF Q4_0 / Q4_1 tensor: its own integers and scales
            return blocks.q, blocks.scale.to(torch.float16), blocks.minimum.to(torch.float16)
        return fit_blocks(weight)

    def _pack(self, *integers: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return pack(*integers)

    def _float_weight(self, *integers: torch.Tensor) -> torch.Tensor:
        q, d, m = integers
        n, k = q.shape
        return (q.float().reshape(n, -1, BLOCK) * d.float()[..., None]
                + m.float()[..., None]).reshape(n, k)

    def _unpack(self) -> torch.Tensor:
        g, nb = self.packed.shape[0], self.packed.shape[1]
        nib = self.packed.permute(0, 3, 4, 1, 2, 5)  # [g, j, lane, b, p, i]
        q = torch.stack([nib & 15, nib >> 4], dim=-2)  # [g, j, lane, b, p, h, i]
        q = q.reshape(g * _GROUP, nb, BLOCK).float()
        return (q * _row_layout(self.d) + _row_layout(self.m)).reshape(g * _GROUP, -1)


def fit_q8_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float weights [N, K] → (q int8 -127..127, d float16 [N, K / 32]) with w ≈ d q: each
    block's max |w| over 127 (GGUF Q8_0's form)."""
    n, k = weight.shape
    w = weight.detach().float().reshape(n, k // BLOCK, BLOCK)
    d = (w.abs().amax(dim=-1) / 127.0).to(torch.float16)
    q = torch.round(w / d.float().clamp(min=1e-12)[..., None]).clamp(-127, 127)
    return q.to(torch.int8).reshape(n, k), d


def pack_q8(q: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8-bit kernel's layout (csrc/w4a8.cpp, linear_q8) of q [N, K] and d [N, K / 32]:
    q + 128 as bytes, [group][block][quad][16 channels][lane][4]."""
    n, k = q.shape
    pad = -n % _GROUP
    u = F.pad(q.to(torch.int16) + 128, (0, 0, 0, pad), value=128).to(torch.uint8)
    d = F.pad(d.to(torch.float16), (0, 0, 0, pad))
    groups, nb = u.shape[0] // _GROUP, k // BLOCK
    packed = u.reshape(groups, 4, 16, nb, 8, 4).permute(0, 3, 4, 1, 2, 5).contiguous()
    return packed, _scale_layout(d)


class Int8Blocks(_BlockKernelLinear):
    """8-bit weights in 32-value blocks (w = d · q, GGUF Q8_0's form) × activations quantized
    per 32-value block: the LM head under w4a8, the arithmetic llama.cpp runs a Q8_0 head
    with. Same kernel file and guarantees as `Int4Dynamic` (bitwise equal for any row count,
    AMX tiles from `AMX_MIN_ROWS` rows)."""

    _op = "linear_q8"
    _kernel_buffers = ("packed", "d")

    def _integers(self, weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return fit_q8_blocks(weight)

    def _pack(self, *integers: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return pack_q8(*integers)

    def _float_weight(self, *integers: torch.Tensor) -> torch.Tensor:
        q, d = integers
        n, k = q.shape
        return (q.float().reshape(n, -1, BLOCK) * d.float()[..., None]).reshape(n, k)

    def _unpack(self) -> torch.Tensor:
        g, nb = self.packed.shape[0], self.packed.shape[1]
        q = self.packed.permute(0, 3, 4, 1, 2, 5).reshape(g * _GROUP, nb, BLOCK)
        return ((q.float() - 128.0) * _row_layout(self.d)).reshape(g * _GROUP, -1)
