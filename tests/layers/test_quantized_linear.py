"""Weight-only int8 / int4 linear layers: both kernels (few rows, many rows) compute the
same product of the same integers, the quantization error is bounded, GGUF Q4 integers are
used exactly, and fused projections equal the separate ones."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from met.kernels import int4_gemv
from met.layers.linear import (
    GEMV_MAX_ROWS,
    Int4Weight,
    Int8Weight,
    Linear,
    fuse_linears,
)
from met.loader.gguf import Q4Blocks


def _linear(n=96, k=128, bias=False, seed=0) -> Linear:
    g = torch.Generator().manual_seed(seed)
    lin = Linear(k, n, bias, torch.float32)
    lin.weight.data = torch.randn(n, k, generator=g) * 0.05
    if bias:
        lin.bias.data = torch.randn(n, generator=g)
    return lin


def _x(rows, k=128, seed=1):
    return torch.randn(rows, k, generator=torch.Generator().manual_seed(seed))


def test_int8_error_is_at_most_half_a_step_per_weight():
    lin = _linear()
    q = Int8Weight(lin.weight, None)
    err = (q.dequantized() - lin.weight).abs()
    step = q.scale.float()[:, None]
    assert (err <= step * 0.5 * (1 + 1e-5)).all()


@pytest.mark.parametrize("kind", [Int8Weight, Int4Weight])
def test_few_and_many_rows_agree(kind):
    """A row gives (nearly) the same output through the GEMV kernel and the bf16 path."""
    lin = _linear(bias=True)
    q = kind(lin.weight, lin.bias)
    x = _x(GEMV_MAX_ROWS + 12).bfloat16()
    many = q(x).float()
    few = torch.cat([q(x[i:i + 1]) for i in range(len(x))]).float()
    assert torch.allclose(few, many, atol=2e-2, rtol=2e-2)
    # Both kernels multiply the same bfloat16 values: only the float32 summation order
    # differs, so nearly every output is the same bits (torch's own int4 kernel, which skips
    # the bfloat16 rounding of the weights, matched ~57 % here; without AVX512-BF16 int4
    # takes the many-rows path for every row count and matched 79 % with it).
    assert (few == many).float().mean() > 0.99
    exact = x.float() @ lin.weight.T + lin.bias
    tol = 0.1 if kind is Int4Weight else 0.03  # 16 vs 255 levels
    assert (many - exact).abs().max() < tol * exact.abs().max()


@pytest.mark.parametrize("n, k", [(3072, 576), (576, 1536), (40, 64), (17, 96)])
def test_int4_gemv_rounds_weights_like_the_many_rows_path(n, k):
    """The few-row kernel's product equals F.linear over the dequantized bfloat16 weights up
    to summation order, for every row count it takes and partial channel blocks. (Without
    AVX512-BF16 or a compiler every row count takes the many-rows path: F.linear itself.)"""
    g = torch.Generator().manual_seed(n)
    q = Int4Weight(torch.randn(n, k, generator=g) * 0.05, None)
    assert (q.gemv_weights is not None) == int4_gemv.available()
    x = torch.randn(8, k, generator=g).bfloat16()
    many = F.linear(x, q.weight_bf16)
    for rows in range(1, GEMV_MAX_ROWS + 1):
        few = torch.cat([q._gemv(x[i:i + rows].contiguous()) for i in range(0, 8 - rows + 1,
                                                                           rows)])
        ref = many[:few.shape[0]]
        assert (few == ref).float().mean() > 0.999
        assert torch.allclose(few.float(), ref.float(), rtol=2**-7, atol=1e-6)
        # and a row's bits do not depend on how many rows came with it
        assert torch.equal(few, torch.cat([q._gemv(x[i:i + 1]) for i in range(few.shape[0])]))


def test_int4_uses_gguf_q4_integers_exactly():
    n, k = 32, 64
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    # Scales and minimums that bfloat16 holds exactly, so nothing is rounded on the way.
    scale = torch.randint(1, 64, (n, k // 32), generator=g).float() / 256
    minimum = -torch.randint(0, 64, (n, k // 32), generator=g).float() / 32
    w = q.float() * scale.repeat_interleave(32, 1) + minimum.repeat_interleave(32, 1)
    weight = w.clone()
    weight.q4_blocks = Q4Blocks(q, scale, minimum)
    layer = Int4Weight(weight, None)
    # The file's values (rounded once to bfloat16), not a min/max re-fit.
    assert torch.equal(layer.weight_bf16, w.to(torch.bfloat16))
    x = _x(1, k).bfloat16()
    # Both paths multiply those bfloat16 weights: only the output's rounding is left ...
    exact_bf16 = x.float() @ layer.weight_bf16.float().T
    assert torch.allclose(layer(x).float(), exact_bf16, atol=1e-3, rtol=2**-8)
    # ... and the weights' own rounding (2^-9 relative) against the file's float values.
    assert torch.allclose(layer(x).float(), x.float() @ w.T, atol=0.1, rtol=1e-2)


def test_fused_projection_equals_the_separate_ones():
    parts = [_linear(n, bias=True, seed=i) for i, n in enumerate((64, 32, 32))]
    x = _x(5)
    fused = fuse_linears(parts)
    assert torch.allclose(fused(x), torch.cat([p(x) for p in parts], dim=-1), atol=1e-5)


def test_linear_quantize_swaps_its_weights():
    lin = _linear(bias=True)
    ref = lin(_x(3))
    lin.quantize("int8")
    assert lin.weight is None and isinstance(lin.quantized, Int8Weight)
    out = lin(_x(3))
    assert out.dtype == torch.float32  # the caller's activation dtype comes back
    assert torch.allclose(out, ref, atol=0.05 * ref.abs().max())


@pytest.mark.parametrize("kind", [None, "int8", "int4", "w8a8", "w4a8"])
def test_bound_bf16_rows_path_is_the_modules_own_product(kind):
    """After pack(), 2-D contiguous bfloat16 rows (a decode step's) go through a kernel call
    bound once (`Linear.bf16_rows`): the same bits as the module path, for every row count;
    other inputs and a moved module take the module path."""
    lin = _linear(n=96, k=128, bias=True)
    lin.weight.data, lin.bias.data = lin.weight.data.bfloat16(), lin.bias.data.bfloat16()
    if kind is not None:
        lin.quantize(kind)
    lin.pack()
    assert lin.bf16_rows is not None
    for rows in (1, 3, 40):
        x = _x(rows).bfloat16()
        fast = lin(x)
        bound, lin.bf16_rows = lin.bf16_rows, None
        assert torch.equal(fast, lin(x)), (kind, rows)
        lin.bf16_rows = bound
    x3 = _x(6).bfloat16().reshape(2, 3, 128)  # 3-D: the module path, same rows
    assert torch.equal(lin(x3).reshape(6, -1), lin(x3.reshape(6, 128)))
    lin.to("cpu")  # .to() may replace the bound tensors: the binding is dropped
    assert lin.bf16_rows is None and torch.equal(lin(_x(3).bfloat16()), fast[:3])
