"""w4a8 linear layers (Q4_1-form weights, int8 activations per 32-value block): one kernel for
every row count, so a row's output is bitwise the same alone or in any batch; GGUF integers are
kept exactly; the result is the block formula (checked against plain PyTorch) and close to the
float product."""

from __future__ import annotations

import pytest
import torch

from met.kernels import w4a8
from met.kernels.w4a8 import Int4Dynamic, Int8Blocks
from met.layers.linear import Linear, LMHead
from met.loader.gguf import Q4Blocks

SHAPES = [(960, 576), (576, 1536), (37, 96), (1000, 64)]  # (out, in); off the 64-channel tiles


def _weights(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * 0.05, torch.randn(n, generator=g)


def _x(rows, k, seed=1):
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed)) * 3
    x[2] = 0
    x[min(5, rows - 1), :32] = 0  # an all-zero block
    return x.bfloat16()


@pytest.mark.parametrize("n,k", SHAPES)
def test_a_row_gives_the_same_bits_in_any_batch(n, k):
    w, b = _weights(n, k)
    layer = Int4Dynamic(w, b)
    x = _x(40, k)
    every = layer(x)
    # every remainder of the 4-row tiles, below and from 8 rows (one or two passes per group)
    for rows in (1, 2, 3, 4, 5, 7, 8, 11, 16):
        for start in (0, 2, 21):
            assert torch.equal(layer(x[start:start + rows]), every[start:start + rows]), rows
    logits = layer.float_product(x)
    assert logits.dtype == torch.float32 and torch.equal(every, logits.bfloat16())
    assert torch.equal(logits[2], b)  # zero row: only the bias


@pytest.mark.parametrize("n,k", SHAPES)
def test_kernel_computes_the_block_formula(n, k):
    """Against plain PyTorch's float evaluation of the same quantized operands (float32 sums
    in another order: ~1e-6 relative), and within 8-bit activation error of the float
    product over the same 4-bit weights."""
    w, b = _weights(n, k)
    layer = Int4Dynamic(w, b)
    x = _x(24, k)
    got = layer.float_product(x)
    formula = layer._torch_product(x, out_float=True)
    assert torch.allclose(got, formula, rtol=1e-5, atol=1e-5 * formula.abs().max())
    exact = x.float() @ layer.dequantized().T + b
    assert (got - exact).abs().max() < 0.02 * exact.abs().max()


def test_gguf_q4_integers_are_kept_exactly():
    g = torch.Generator().manual_seed(3)
    n, k = 70, 64
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scale = (torch.rand(n, k // 32, generator=g) * 0.01).half().float()
    minimum = (-torch.rand(n, k // 32, generator=g) * 0.05).half().float()
    weight = (q.float().reshape(n, -1, 32) * scale[..., None] + minimum[..., None]).reshape(n, k)
    weight.q4_blocks = Q4Blocks(q, scale, minimum)
    layer = Int4Dynamic(weight, None)
    assert torch.equal(layer.dequantized(), weight)


def test_fitting_float_weights_to_blocks_is_within_half_a_step():
    w, _ = _weights(48, 96)
    q, d, m = w4a8.fit_blocks(w)
    assert q.max() <= 15 and d.dtype == m.dtype == torch.float16
    deq = q.float().reshape(48, 3, 32) * d.float()[..., None] + m.float()[..., None]
    step = d.float()[..., None]
    # m is the block minimum rounded to float16, so allow its rounding on top of half a step
    assert ((deq - w.reshape(48, 3, 32)).abs() <= step / 2 + m.float().abs()[..., None] * 1e-3
            + 1e-6).all()


def test_linear_quantizes_to_w4a8():
    w, b = _weights(64, 32)
    lin = Linear(32, 64, True, torch.float32)
    lin.weight.data, lin.bias.data = w.clone(), b.clone()
    lin.quantize("w4a8")
    lin.pack()
    assert isinstance(lin.quantized, Int4Dynamic) and lin.weight is None
    x = _x(5, 32)
    y = lin(x)
    assert y.dtype == torch.bfloat16 and y.shape == (5, 64)
    exact = x.float() @ w.T + b
    assert (y.float() - exact).abs().max() < 0.1 * exact.abs().max()  # 16 levels per block


def test_input_size_must_be_a_multiple_of_32():
    with pytest.raises(ValueError, match="w4a8: input size 40"):
        Int4Dynamic(torch.zeros(8, 40), None)


@pytest.mark.parametrize("n,k", SHAPES)
def test_amx_tiles_give_the_vnni_bits(n, k):
    """From AMX_MIN_ROWS rows on the block sums come from AMX tiles (16 rows at a time, zero
    rows padding the last): the same bits as the VNNI kernel on every row count around the
    tile edges (both paths run the VNNI kernel where the CPU has no AMX)."""
    w, b = _weights(n, k)
    layer = Int4Dynamic(w, b)
    x = _x(49, k)
    if not w4a8.available():  # no VNNI: the plain-PyTorch path is the only one
        assert not layer.native and torch.equal(layer(x), layer._torch_product(x, False))
        return
    for rows in (1, 15, 16, 17, 32, 33, 49):
        for out_float in (False, True):
            vnni = layer.kernel(x[:rows], out_float, amx_min_rows=10**9)
            amx = layer.kernel(x[:rows], out_float, amx_min_rows=1)
            assert torch.equal(vnni, amx), (rows, out_float)
    assert w4a8.AMX_MIN_ROWS <= 49  # the layer's own choice reaches the tiles at 49 rows
    assert torch.equal(layer(x), layer.kernel(x, False, amx_min_rows=10**9))


# ---- prompt rows: bfloat16 activations × the weights dequantized to bfloat16 ---------------


@pytest.mark.parametrize("n,k", SHAPES)
def test_prompt_rows_multiply_bfloat16_weights_and_depend_on_their_row_alone(n, k):
    """``prompt_rows_kernel()(x, p)``: rows [0, p) against the float32 product of the same
    rows with the 4-bit weights rounded to bfloat16 (within one bfloat16 rounding of the
    output, plus the dequantizing FMA's single rounding); each prompt row bitwise the same
    alone, in any number of prompt rows and beside any generated rows; rows [p, M) bitwise
    the int8-activation kernel's."""
    w, b = _weights(n, k)
    layer = Int4Dynamic(w, b)
    f = layer.prompt_rows_kernel()
    assert (f is not None) == (layer.native and w4a8.prompt_rows_available())
    if f is None:  # no AMX-BF16 here: every row takes the int8-activation kernel
        return
    x = _x(70, k)
    ref = x.float() @ layer.dequantized().bfloat16().float().T + b
    every = f(x, 70)
    assert every.dtype == torch.bfloat16
    err = (every.float() - ref).abs()
    assert (err <= 2 ** -7 * ref.abs() + 1e-3 * ref.abs().max()).all(), err.max()
    assert torch.equal(every[2], b.bfloat16())  # zero row: only the bias
    for rows, prompt in ((1, 1), (5, 3), (16, 16), (33, 17), (70, 31), (40, 0)):
        got = f(x[:rows], prompt)
        assert torch.equal(got[:prompt], every[:prompt]), (rows, prompt)
        if prompt < rows:
            assert torch.equal(got[prompt:], layer(x[prompt:rows])), (rows, prompt)
    with pytest.raises(RuntimeError, match="prompt_rows"):
        f(x[:4], 5)


# ---- 8-bit weights in blocks (the LM head under w4a8) ------------------------------------


@pytest.mark.parametrize("n,k", SHAPES)
def test_q8_blocks_give_the_same_bits_in_any_batch_and_on_either_kernel(n, k):
    w, b = _weights(n, k)
    layer = Int8Blocks(w, b)
    x = _x(49, k)
    every = layer.float_product(x)
    for rows in (1, 2, 3, 4, 5, 7, 16, 33):
        for start in (0, 2):
            got = layer.float_product(x[start:start + rows])
            assert torch.equal(got, every[start:start + rows]), rows
    assert torch.equal(layer(x), every.bfloat16())
    assert torch.equal(every[2], b)  # zero row: only the bias
    if layer.native:  # VNNI for every row count vs AMX tiles from one row on: same bits
        for rows in (1, 16, 17, 49):
            assert torch.equal(layer.kernel(x[:rows], True, amx_min_rows=10**9),
                               layer.kernel(x[:rows], True, amx_min_rows=1)), rows


@pytest.mark.parametrize("n,k", SHAPES)
def test_q8_blocks_compute_the_block_formula(n, k):
    w, b = _weights(n, k)
    layer = Int8Blocks(w, b)
    x = _x(24, k)
    got = layer.float_product(x)
    formula = w4a8.block_quantized_product(x, layer.dequantized(), layer.bias, True)
    assert torch.allclose(got, formula, rtol=1e-5, atol=1e-5 * formula.abs().max())
    exact = x.float() @ w.T + b  # the float weights themselves: 8-bit weights are close
    assert (got - exact).abs().max() < 0.02 * exact.abs().max()


def test_q8_block_fit_is_within_half_a_step_and_keeps_q8_0_integers():
    w, _ = _weights(48, 96)
    q, d = w4a8.fit_q8_blocks(w)
    assert q.dtype == torch.int8 and q.abs().max() <= 127 and d.dtype == torch.float16
    deq = q.float().reshape(48, 3, 32) * d.float()[..., None]
    assert ((deq - w.reshape(48, 3, 32)).abs() <= d.float()[..., None] * 0.51 + 1e-7).all()
    # weights already of the form d · q (a Q8_0 file's) come back as the same integers
    q2, d2 = w4a8.fit_q8_blocks(deq.reshape(48, 96))
    assert torch.equal(q2, q) and torch.equal(d2, d)


def test_lm_head_of_w4a8_is_8_bit_blocks():
    w, _ = _weights(300, 64)
    head = LMHead(w.bfloat16(), "w4a8")
    assert isinstance(head.quantized, Int8Blocks)
    x = _x(3, 64)
    logits = head(x)
    assert logits.dtype == torch.float32
    exact = x.float() @ w.bfloat16().float().T
    assert torch.allclose(logits, exact, atol=0.02 * logits.abs().max())


# ---- float32 rows and the AVX2 kernel ----------------------------------------------------


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("cls", [Int4Dynamic, Int8Blocks])
def test_float32_rows_are_quantized_directly_with_the_same_guarantees(n, k, cls):
    """A float32 model (w4a8 where the CPU has no native bfloat16) passes float32 rows: each
    row bitwise the same alone or batched, float32 out, the block formula on the float32
    values; rows that bfloat16 holds exactly give the bfloat16 rows' bits."""
    w, b = _weights(n, k)
    layer = cls(w, b)
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(7)) * 3
    every = layer(x)
    assert every.dtype == torch.float32 and every.shape == (40, n)
    for rows in (1, 2, 3, 5, 8, 11):
        assert torch.equal(layer(x[3:3 + rows]), every[3:3 + rows]), rows
    formula = w4a8.block_quantized_product(x, layer.dequantized(), layer.bias, True)
    assert torch.allclose(every, formula, rtol=1e-5, atol=1e-5 * formula.abs().max())
    held = x.bfloat16()
    assert torch.equal(layer(held.float()), layer.float_product(held))


def test_a_float32_linear_calls_the_kernel_directly_with_the_module_path_bits():
    """A packed w4a8 `Linear` in a float32 model binds the kernel call for 2-D contiguous
    float32 rows (`float32_rows`, as `bf16_rows` for bfloat16): float32 out, the bits of
    the quantized module's own forward; other shapes still go through that forward."""
    w, b = _weights(64, 64)
    lin = Linear(64, 64, True, torch.float32)
    lin.weight.data, lin.bias.data = w.clone(), b.clone()
    lin.quantize("w4a8")
    lin.pack()
    assert lin.float32_rows is not None
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(3))
    y = lin(x)
    assert y.dtype == torch.float32 and torch.equal(y, lin.quantized.forward(x))
    batched = lin(x.reshape(2, 3, 64))  # 3-D: the module path, same rows, same bits
    assert torch.equal(batched.reshape(6, 64), y)


def test_every_kernel_this_cpu_runs_gives_the_same_bits():
    """csrc/w4a8.cpp (AVX512-VNNI) and csrc/w4a8_avx2.cpp compute the same exact integer sums
    and the same float steps: where a CPU runs both, their outputs are equal bit for bit
    (4-bit and 8-bit weights, bfloat16 and float32 rows and outputs). Every x86-64 machine
    met is tested on runs at least the AVX2 one, and auto picks the best it has."""
    from met.kernels.capability import probe
    from met.kernels.native import load_native_ops

    ran = []
    w, b = _weights(200, 96)
    x16 = _x(13, 96)
    for isa, key, runs in w4a8._KERNELS:
        ops = load_native_ops(key) if runs(probe()) else None
        if ops is None:
            continue
        int4 = Int4Dynamic(w, b)
        int8 = Int8Blocks(w, b)
        outs = []
        for x in (x16, x16.float() * 1.5):
            for out_float in (False, True):
                outs.append(ops.linear(x, int4.packed, int4.d, int4.m, int4.bias, 200,
                                       out_float, 10**9, 0))
                outs.append(ops.linear_q8(x, int8.packed, int8.d, int8.bias, 200, out_float,
                                          10**9))
        ran.append((isa, outs))
    assert ran, "no w4a8 kernel runs on this CPU"
    assert w4a8.kernel_isa() == ran[0][0]
    for isa, outs in ran[1:]:
        for got, want in zip(outs, ran[0][1], strict=True):
            assert torch.equal(got, want), isa
