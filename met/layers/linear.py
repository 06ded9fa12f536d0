"""Linear layers: plain, fused (q/k/v, gate/up), and int8 / int4 weight-only.

Int8 weight-only (``Linear.quantize("int8")``): each output channel's weights become int8
with one scale (symmetric, scale = max|w| / 127); activations stay bfloat16. The kernel
depends on the number of rows: up to ``GEMV_MAX_ROWS`` rows go through torch's int8
weight-only kernel (it reads a quarter of float32's bytes, and decode at low concurrency is
memory bound); more rows multiply by the same integers held as bfloat16 (exact: |q| <= 127)
on the bfloat16 matrix units. Both round ``x · q`` to bfloat16 and then scale it, so a row's
result does not depend on which kernel its batch picked (measured: 99.997 % of outputs
bitwise equal, the rest one ulp apart from the accumulation order).

Int4 weight-only (``Linear.quantize("int4")``): groups of 32 weights along the input
dimension get a scale and a minimum (asymmetric, 16 levels: the layout of GGUF's Q4_1
blocks), run by met's int4 GEMV kernel (csrc/int4_gemv.cpp, CPUs with AVX512-BF16) for
few rows and as bfloat16 weights dequantized from the same integers for many (and for every
row count on other CPUs).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from met.kernels import gguf_blocks, int4_gemv
from met.kernels.gguf_blocks import Blocks
from met.kernels.int_activations import IntActivationLinear
from met.kernels.w4a8 import Int4Dynamic, Int8Blocks, KernelCall
from met.kernels.w8a8 import Int8Dynamic

# Rows up to which the int8 GEMV kernel beats bfloat16 matrix multiply on the CPU
# (docs/benchmarks.md: measured per layer shape of the embedded model).
GEMV_MAX_ROWS = 4


class _WeightOnly(nn.Module, ABC):
    """Shared by the weight-only layers: rows of bfloat16 go through ``_gemv`` (the
    subclass's kernel) up to GEMV_MAX_ROWS on the CPU and through the bfloat16 matrix units
    over ``weight_bf16`` (oneDNN's packed copy once `pack` ran) above; then the bias.
    Subclasses register ``weight_bf16`` and ``bias`` and set ``out_features``."""

    bias: torch.Tensor | None
    out_features: int
    onednn_weight: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The decode step's 2-D bfloat16 rows need no reshape or cast (each costs Python time
        # per layer).
        plain = x.dim() == 2 and x.dtype == torch.bfloat16
        x2 = x if plain else x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        y = self._product(x2)
        if self.bias is not None:
            y = y + self.bias
        return y if plain else y.reshape(*x.shape[:-1], self.out_features)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] bfloat16 times the weights, by the kernel for its number of rows."""
        if x.shape[0] <= GEMV_MAX_ROWS and x.device.type == "cpu":
            return self._gemv(x.contiguous())
        return self._many_rows(x)

    def _many_rows(self, x: torch.Tensor) -> torch.Tensor:
        """x times the bfloat16 weights on the matrix units (oneDNN's copy once packed)."""
        if self.onednn_weight is not None:
            return onednn_linear(x, self.onednn_weight, None)
        return F.linear(x, self.weight_bf16)

    @abstractmethod
    def _gemv(self, x: torch.Tensor) -> torch.Tensor:
        """The few-rows kernel over the quantized weights."""

    def pack(self) -> None:
        """Keep the many-rows path's weight in oneDNN's layout (see `onednn_pack`)."""
        packed = onednn_pack(self.weight_bf16)
        if packed is not None:
            self.onednn_weight = packed
            self.weight_bf16 = None


class Int8Weight(_WeightOnly):
    """int8 [N, K] weights with per-output-channel scales; ``forward(x)`` = x Wᵀ (+ bias)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 kernel: str | None = "auto"):  # no native kernel of its own
        super().__init__()
        w = weight.detach().float()
        # The kernel takes bfloat16 scales: round them up (never below max|w| / 127, so no
        # weight is clipped) and quantize against the rounded value.
        scale = ((w.abs().amax(dim=1) / 127.0).clamp(min=1e-12) * (1 + 2**-7)).to(torch.bfloat16)
        q = torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
        self.register_buffer("qweight", q.contiguous())
        self.register_buffer("scale", scale)
        self.register_buffer("ones", torch.ones_like(scale))
        # The integers as bfloat16 (exact), for the many-rows path.
        self.register_buffer("weight_bf16", q.to(torch.bfloat16).contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().to(torch.bfloat16))
        self.out_features, self.in_features = q.shape

    # Both paths round x·q to bfloat16 and then multiply by the scale, so a row's result is
    # the same whichever path its batch takes (up to the rare accumulation-order ulp).
    def _product(self, x: torch.Tensor) -> torch.Tensor:
        return super()._product(x) * self.scale

    def _gemv(self, x: torch.Tensor) -> torch.Tensor:
        """x · q rounded to bfloat16 (unscaled)."""
        return torch.ops.aten._weight_int8pack_mm.default(x, self.qweight, self.ones)

    def float_product(self, x: torch.Tensor) -> torch.Tensor:
        """x Wᵀ in float32 (the LM head's logits): the bfloat16 x · q times the scale, a
        product float32 holds exactly, instead of rounding it to bfloat16 once more (which
        made distinct logits tie)."""
        y = super()._product(x.reshape(-1, x.shape[-1]).to(torch.bfloat16)).float()
        return y * self.scale.float()

    def dequantized(self) -> torch.Tensor:
        """The weights these integers stand for, float32 [N, K]."""
        return self.qweight.float() * self.scale.float()[:, None]


INT4_GROUP = 32


class Int4Weight(_WeightOnly):
    """int4 [N, K] weights in groups of 32 along K, each with a scale and a minimum;
    ``forward(x)`` = x Wᵀ (+ bias)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 kernel: str | None = "auto"):
        """``kernel``: "int4_gemv" (few rows natively), None (bfloat16 only) or "auto"."""
        super().__init__()
        n, k = weight.shape
        if k % INT4_GROUP:
            raise ValueError(f"quantization int4: input size {k} is not a multiple of "
                             f"{INT4_GROUP}")
        blocks = getattr(weight, "q4_blocks", None)
        if blocks is not None:  # a GGUF Q4_0 / Q4_1 tensor: its own integers, exactly
            q = blocks.q.to(torch.int32)
            scale = blocks.scale.to(torch.bfloat16)
            lo = blocks.minimum
        else:  # float weights: 16 levels between each group's min and max
            w = weight.detach().float().reshape(n, k // INT4_GROUP, INT4_GROUP)
            lo, hi = w.amin(dim=-1), w.amax(dim=-1)
            scale = ((hi - lo) / 15.0).clamp(min=1e-12).to(torch.bfloat16)
            q = torch.round((w - lo[..., None]) / scale.float()[..., None]).clamp(0, 15)
            q = q.to(torch.int32).reshape(n, k)
        # The kernels compute (q - 8) · scale + zero; zero = min + 8 · scale.
        zero = (lo + 8.0 * scale.float()).to(torch.bfloat16)
        # Few rows: int4_gemv (same bfloat16 weights as the many-rows path) where the CPU has
        # AVX512-BF16. Elsewhere every row count takes the many-rows path: torch's int4
        # kernel kept the weights in float32 (rows then changed by ~1 bfloat16 ulp with their
        # batch) and refused N not a multiple of 16; w4a8 is the fast 4-bit path there.
        gemv = int4_gemv.available() if kernel == "auto" else kernel is not None
        self.gemv_weights = (int4_gemv.pack(q, scale, zero) if weight.device.type == "cpu"
                             and gemv else None)
        deq = ((q.float().reshape(n, -1, INT4_GROUP) - 8.0) * scale.float()[..., None]
               + zero.float()[..., None])
        self.register_buffer("weight_bf16", deq.reshape(n, k).to(torch.bfloat16).contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().to(torch.bfloat16))
        self.out_features, self.in_features = n, k

    def _gemv(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemv_weights is not None:
            return int4_gemv.linear(x, self.gemv_weights, self.out_features)
        return self._many_rows(x)


def attach_blocks(param: torch.Tensor, segments: list[Blocks]) -> None:
    """Make ``param`` stand for GGUF blocks (``param.gguf``): its data becomes a zero-stride
    view of one element, so the shape stays and no float copy of the matrix exists."""
    param.data = torch.zeros(1, dtype=param.dtype, device=param.device).expand(param.shape)
    param.gguf = segments


def blocks_of(param: torch.Tensor | None) -> list[Blocks] | None:
    """The GGUF blocks ``param`` stands for (`attach_blocks`), or None."""
    return getattr(param, "gguf", None)


class GGUFWeight(nn.Module):
    """GGUF blocks as they are in the file (``--quantization gguf``); float weights (a float
    checkpoint, or a float part of a fused projection) are quantized to Q8_0 as llama.cpp's
    quantizer does. ``forward(x)`` = x Wᵀ (+ bias) in x's dtype, summed in float32
    (met/kernels/gguf_blocks.py)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 kernel: str | None = "auto"):
        super().__init__()
        self.segments = blocks_of(weight) or [gguf_blocks.from_float(weight)]
        self.native = gguf_blocks.available() if kernel == "auto" else kernel is not None
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.out_features = sum(s.rows for s in self.segments)
        self.in_features = self.segments[0].cols

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._product(x, x.dtype if x.dtype in _ROW_DTYPES else torch.float32)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

    def float_product(self, x: torch.Tensor) -> torch.Tensor:
        """x Wᵀ as float32 (the LM head's logits), never rounded to x's dtype."""
        return self._product(x, torch.float32)

    def _product(self, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        if x2.dtype not in _ROW_DTYPES:
            x2 = x2.float()
        y = gguf_blocks.linear(x2.contiguous(), self.segments, out_dtype, self.native)
        return y.reshape(*x.shape[:-1], self.out_features)

    def pack(self) -> None:
        """Nothing to re-lay out: the kernel reads the file's blocks."""


_ROW_DTYPES = (torch.float32, torch.bfloat16)  # what the gguf kernel takes and returns


QUANTIZED_WEIGHTS = {"int8": Int8Weight, "int4": Int4Weight, "w8a8": Int8Dynamic,
                     "w4a8": Int4Dynamic, "gguf": GGUFWeight}


def onednn_pack(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's own blocked layout of a bfloat16 CPU weight [N, K], or None where oneDNN
    is unavailable or has no bfloat16 kernels for this CPU (then F.linear stays the path).

    ``F.linear`` on a plain bfloat16 weight re-lays the weight out for the matrix units on
    every call; multiplying a pre-laid-out copy (what torch.compile's CPU freezing does)
    computes the same bits and is ~2x faster: measured on a 2-core Sapphire Rapids, one
    thread, a decode step's linear layers and head of SmolLM2-135M, 19.8 → 10.9 ms at 1 row,
    37.9 → 18.2 ms at 64 rows (docs/benchmarks.md).
    """
    if (weight.device.type != "cpu" or weight.dtype != torch.bfloat16
            or not torch.backends.mkldnn.is_available()
            or not torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return None  # e.g. an AVX2-only CPU: oneDNN has no bfloat16 path there
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
                  ) -> torch.Tensor:
    """x Wᵀ (+ bias) with a weight from `onednn_pack`."""
    return torch.ops.mkldnn._linear_pointwise.default(x, packed, bias, "none", [None], "")


class Linear(nn.Module):
    """y = x W^T (+ b). Parameters are allocated empty; the loader fills them.

    ``quantize(kind)`` swaps the weights for an ``Int8Weight`` / ``Int4Weight`` (after
    loading)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), False) if bias else None
        self.quantized: nn.Module | None = None
        self.onednn_weight: torch.Tensor | None = None  # onednn_pack's copy, replacing weight
        # Built by pack(): the kernel call for 2-D contiguous bfloat16 rows (a decode step's),
        # with its tensors bound, so ~120 calls a step skip the module attribute lookups.
        self.bf16_rows: Callable[[torch.Tensor], torch.Tensor] | None = None
        # The same for float32 rows, where the quantized kernel takes and returns float32
        # (w4a8 under a float32 model: --dtype auto on CPUs without native bfloat16).
        self.float32_rows: Callable[[torch.Tensor], torch.Tensor] | None = None
        # Built by pack() under w4a8 where the CPU has AMX-BF16: ``f(x, prompt_rows)``, x's
        # first prompt_rows rows through bfloat16 weights (`Int4Dynamic.prompt_rows_kernel`).
        self.prompt_rows_fn: Callable[[torch.Tensor, int], torch.Tensor] | None = None
        # Set by met.lora.slots.LoRAManager: the adapters' delta added to every output.
        self.lora = None

    def forward(self, x: torch.Tensor, prompt_rows: int = 0) -> torch.Tensor:
        """x Wᵀ (+ b), plus this step's LoRA deltas where adapters are attached.
        ``prompt_rows`` > 0 (`ForwardBatch.prompt_rows`, set only for models whose every
        projection has `prompt_rows_fn`): x's first rows through that path."""
        y = self._base(x, prompt_rows)
        return y if self.lora is None else self.lora.add(x, y)

    def _base(self, x: torch.Tensor, prompt_rows: int) -> torch.Tensor:
        if prompt_rows:
            return self.prompt_rows_fn(x, prompt_rows)
        rows = (self.bf16_rows if x.dtype == torch.bfloat16
                else self.float32_rows if x.dtype == torch.float32 else None)
        if rows is not None and x.dim() == 2 and x.is_contiguous():
            return rows(x)
        if self.quantized is not None:
            # .forward: nn.Module's __call__ (hooks, tracing checks) costs a few µs, and a
            # decode step makes ~120 of these calls; the quantized module has no hooks.
            y = self.quantized.forward(x)
            return y if y.dtype == x.dtype else y.to(x.dtype)
        if self.onednn_weight is not None:
            return onednn_linear(x, self.onednn_weight, self.bias)
        return F.linear(x, self.weight, self.bias)

    def kernel_call(self) -> KernelCall | None:
        """The native 4-bit op this projection runs, with its bound arguments
        (`Int4Dynamic.kernel_call`), or None for any other kind of weights."""
        return self.quantized.kernel_call() if isinstance(self.quantized, Int4Dynamic) else None

    def pack(self) -> None:
        """Swap the (bfloat16 CPU) weight for oneDNN's pre-laid-out copy (after loading,
        fusing and quantizing; a no-op where oneDNN does not apply)."""
        if self.quantized is not None:
            self.quantized.pack()
        if self.weight is not None:
            self.onednn_weight = onednn_pack(self.weight.data)
            if self.onednn_weight is not None:
                del self.weight
                self.weight = None  # type: ignore[assignment]
        self._bind_bf16_rows()

    def _bind_bf16_rows(self) -> None:
        """Set `bf16_rows` (and `float32_rows`): the kernel `forward` picks for 2-D
        contiguous bfloat16 (float32) rows."""
        if isinstance(self.quantized, IntActivationLinear):
            self.bf16_rows = self.quantized.bf16_rows()
            self.float32_rows = self.quantized.float32_rows()
            if isinstance(self.quantized, Int4Dynamic):
                self.prompt_rows_fn = self.quantized.prompt_rows_kernel()
        elif self.quantized is not None:
            self.bf16_rows = self.quantized.forward  # bfloat16 in, bfloat16 out
        elif self.onednn_weight is not None:
            weight, bias = self.onednn_weight, self.bias
            self.bf16_rows = lambda x: onednn_linear(x, weight, bias)
        elif self.weight is not None and self.weight.dtype == torch.bfloat16:
            weight, bias = self.weight, self.bias  # no oneDNN bfloat16 on this CPU
            self.bf16_rows = lambda x: F.linear(x, weight, bias)

    def _apply(self, fn, recurse=True):  # .to() and friends replace the bound tensors
        self.bf16_rows = None
        self.float32_rows = None
        self.prompt_rows_fn = None
        return super()._apply(fn, recurse)

    def quantize(self, kind: str, kernel: str | None = "auto") -> None:
        """Swap the weights for the ``kind`` form, run by the native extension ``kernel``
        (the linear method's; None: PyTorch ops; "auto": the best this CPU runs)."""
        self.quantized = QUANTIZED_WEIGHTS[kind](self.weight, self.bias, kernel=kernel)
        del self.weight
        self.weight = None  # type: ignore[assignment]
        self.bias = None


def fuse_linears(parts: list[Linear]) -> Linear:
    """One Linear computing ``parts`` side by side (outputs concatenated in order): one
    matrix multiply instead of several on the same input."""
    first = parts[0]
    has_bias = first.bias is not None
    if any(blocks_of(p.weight) is not None for p in parts):  # GGUF blocks: stacked as they are
        segments = gguf_blocks.concat([blocks_of(p.weight) or [gguf_blocks.from_float(p.weight)]
                                       for p in parts])
        fused = Linear(first.in_features, sum(p.out_features for p in parts), has_bias,
                       first.weight.dtype)
        attach_blocks(fused.weight, segments)
        if has_bias:
            fused.bias.data = torch.cat([p.bias.data for p in parts], dim=0)  # type: ignore
        return fused
    weight = torch.cat([p.weight.data for p in parts], dim=0)
    fused = Linear(weight.shape[1], weight.shape[0], has_bias, weight.dtype)
    fused.weight.data = weight
    blocks = [getattr(p.weight, "q4_blocks", None) for p in parts]
    if all(b is not None for b in blocks):
        fused.weight.q4_blocks = type(blocks[0])(*(torch.cat(xs, dim=0)
                                                   for xs in zip(*blocks, strict=True)))
    if has_bias:
        fused.bias.data = torch.cat([p.bias.data for p in parts], dim=0)  # type: ignore[union-attr]
    return fused


class Embedding(nn.Module):
    """Token embedding table (also the tied LM head for models that share it)."""

    def __init__(self, num_embeddings: int, dim: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, dim, dtype=dtype), False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        blocks = blocks_of(self.weight)
        if blocks is not None:  # a GGUF table kept as blocks: decode the rows looked up
            rows = blocks[0].take_rows(ids.reshape(-1)).dequantize()
            return rows.to(self.weight.dtype).reshape(*ids.shape, rows.shape[-1])
        return F.embedding(ids, self.weight)


# The LM head's layer per quantization (`CausalLM.prepare`): the head decides every token, so
# it stays 8-bit; under w4a8 in 32-value blocks (GGUF Q8_0's form, llama.cpp's head of a Q4
# file) with block-quantized activations.
HEAD_WEIGHTS = {"int8": Int8Weight, "int4": Int8Weight, "w8a8": Int8Dynamic,
                "w4a8": Int8Blocks, "gguf": GGUFWeight}


class LMHead(nn.Module):
    """hidden → float32 logits, over a weight [vocab, hidden] (the tied embedding table or
    the model's own head); 8-bit (`HEAD_WEIGHTS`) when the model is quantized."""

    def __init__(self, weight: torch.Tensor, quantization: str | None,
                 kernel: str | None = "auto"):
        super().__init__()
        self.quantized = (None if quantization is None
                          else HEAD_WEIGHTS[quantization](weight, None, kernel=kernel))
        self.weight = None if quantization is not None else weight
        # onednn_pack's copy (the weight itself may be the embedding table, still needed).
        self.onednn_weight: torch.Tensor | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if isinstance(self.quantized, (Int8Weight, IntActivationLinear, GGUFWeight)):
            return self.quantized.float_product(hidden)
        if self.quantized is not None:
            return self.quantized(hidden).float()
        if self.onednn_weight is not None:
            return onednn_linear(hidden, self.onednn_weight, None).float()
        return F.linear(hidden, self.weight).float()

    def pack(self) -> None:
        """Multiply by oneDNN's pre-laid-out copy of the (bfloat16 CPU) weight."""
        if self.quantized is not None:
            self.quantized.pack()
        if self.weight is not None:
            self.onednn_weight = onednn_pack(self.weight.data)
