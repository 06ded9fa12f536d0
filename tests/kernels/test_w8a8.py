"""w8a8 linear layers (int8 weights, int8 activations per row): every kernel computes the same
integer sums and scales them the same way, so a row's output is bitwise the same through the
GEMV kernel (few rows), oneDNN's int8 matmul (many rows) and the plain-PyTorch fallback; the
error against the float product stays within what 8-bit quantization of both sides allows."""

from __future__ import annotations

import pytest
import torch

from met.kernels import w8a8
from met.kernels.w8a8 import Int8Dynamic
from met.layers.linear import Linear, LMHead

# (out_features, in_features): the embedded model's shapes, sizes off the kernels' tiles.
SHAPES = [(960, 576), (576, 1536), (37, 100), (1000, 64), (70, 6)]


def _weights(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * 0.05, torch.randn(n, generator=g)


def _x(rows, k, seed=1):
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed)) * 3
    x[2] = 0  # an all-zero row: scale 0, output = bias
    return x.bfloat16()


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_every_kernel_gives_the_same_bits_for_a_row(n, k, bias):
    w, b = _weights(n, k)
    layer = Int8Dynamic(w, b if bias else None)
    x = _x(40, k)
    many = layer(x)  # 40 rows: quantize + oneDNN int8 matmul + scale_out
    assert layer.gemv_max_rows < 40
    assert torch.equal(many, layer._torch_product(x, out_float=False))
    for rows in (1, 2, 3, 4, 5, 8, 13, 16):  # GEMV kernel, every row-tile remainder
        for start in (0, 2, 21):
            assert torch.equal(layer(x[start:start + rows]), many[start:start + rows]), rows
    logits = layer.float_product(x)
    assert logits.dtype == torch.float32
    assert torch.equal(logits, layer._torch_product(x, out_float=True))
    assert torch.equal(layer.float_product(x[:3]), logits[:3])
    assert torch.equal(many, logits.bfloat16())
    if bias:
        assert torch.equal(logits[2], b)  # zero row


@pytest.mark.parametrize("n,k", SHAPES)
def test_error_is_what_two_int8_roundings_allow(n, k):
    w, b = _weights(n, k)
    layer = Int8Dynamic(w, b)
    x = _x(24, k)
    exact = x.float() @ w.T + b
    got = layer.float_product(x)
    # Per product the two roundings add at most half a step of each side: bound the sum by
    # its worst case over the row and check the typical error is far below it.
    step_w = layer.scale[:n] / 2
    step_x = x.float().abs().amax(dim=1) / 127 / 2
    bound = (step_x[:, None] * w.abs().sum(dim=1)[None, :]
             + x.float().abs().sum(dim=1)[:, None] * step_w[None, :]
             + k * step_x[:, None] * step_w[None, :])
    assert ((got - exact).abs() <= bound * (1 + 1e-4) + 1e-5).all()
    assert (got - exact).abs().mean() < 0.25 * bound.mean()  # errors mostly cancel


def test_weight_quantization_is_symmetric_per_channel():
    w, _ = _weights(64, 96)
    q, scale = w8a8.quantize_weight(w)
    assert q.dtype == torch.int8 and q.abs().max() == 127
    assert ((q.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 * (1 + 1e-5)).all()


def test_gemv_layout_holds_every_weight_once():
    q = torch.randint(-127, 128, (70, 10), dtype=torch.int8)
    packed, wsum = w8a8.pack(q)
    assert packed.shape == (2, 3, 4, 16, 4)  # N padded to 128, K to 12
    assert wsum[:70].tolist() == (q.int().sum(dim=1) * 128).tolist() and wsum[70:].eq(0).all()
    # channel n = 64 g + 16 j + lane, k = 4 u + byte
    n, k = 53, 6
    assert packed[n // 64, k // 4, (n % 64) // 16, n % 16, k % 4] == q[n, k]


def test_linear_and_head_switch_to_w8a8():
    w, b = _weights(48, 32)
    lin = Linear(32, 48, True, torch.float32)
    lin.weight.data, lin.bias.data = w.clone(), b.clone()
    lin.quantize("w8a8")
    lin.pack()
    assert isinstance(lin.quantized, Int8Dynamic) and lin.weight is None
    x = _x(5, 32)
    assert lin(x).dtype == torch.bfloat16
    exact = x.float() @ w.T + b
    assert (lin(x).float() - exact).abs().max() < 0.05 * exact.abs().max()
    head = LMHead(w, "w8a8")
    logits = head(x)
    assert logits.dtype == torch.float32 and logits.shape == (5, 48)
    assert torch.equal(logits, head.quantized.float_product(x))
