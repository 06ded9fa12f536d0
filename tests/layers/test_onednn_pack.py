"""bfloat16 linear layers multiply oneDNN's pre-laid-out weight copy (met.layers.linear
.onednn_pack): the same bits as F.linear on the plain weight, for any number of rows, and
the plain weight is not kept. Where oneDNN has no bfloat16 kernels for the CPU (AVX2 only,
e.g. AMD Zen 3: its reorder raises there), nothing is packed and every layer keeps F.linear
on its plain weight, with the same outputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from met import LLM, SamplingParams
from met.layers import linear as linear_mod
from met.layers.linear import Int4Weight, Int8Weight, Linear, LMHead, onednn_linear, onednn_pack


def test_torch_has_onednn():
    """The pinned CPU torch wheel is built with oneDNN; every test below relies on it."""
    assert torch.backends.mkldnn.is_available()


# Whether this CPU packs (oneDNN's bfloat16 kernels need AVX512-BW/VL/DQ or AVX-NE-CONVERT).
PACKS = torch.ops.mkldnn._is_mkldnn_bf16_supported()

ROWS = [1, 3, 5, 64, 300]


def _bf16(*shape, seed=0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 0.1).bfloat16()


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("bias", [False, True])
def test_packed_product_is_bitwise_f_linear(rows, bias):
    w, x = _bf16(200, 96), _bf16(rows, 96, seed=1)
    b = _bf16(200, seed=2) if bias else None
    packed = onednn_pack(w)
    assert (packed is not None) == PACKS
    if packed is not None:
        assert torch.equal(onednn_linear(x, packed, b), F.linear(x, w, b))


def test_pack_applies_to_bfloat16_cpu_weights_only():
    assert onednn_pack(torch.randn(8, 16)) is None  # float32 stays the exact MKL path
    assert (onednn_pack(_bf16(8, 16)) is not None) == PACKS


def test_linear_pack_drops_the_plain_weight_and_keeps_its_output():
    lin = Linear(96, 200, True, torch.bfloat16)
    lin.weight.data, lin.bias.data = _bf16(200, 96), _bf16(200, seed=3)
    x = _bf16(7, 96, seed=4)
    before = lin(x)
    lin.pack()
    assert (lin.weight is None and lin.onednn_weight is not None) == PACKS
    assert torch.equal(lin(x), before)


@pytest.mark.parametrize("kind", [Int8Weight, Int4Weight])
def test_quantized_many_rows_path_packs_without_changing_outputs(kind):
    q = kind(_bf16(64, 128).float(), None)
    x = _bf16(20, 128, seed=5)  # more rows than the GEMV kernels take
    before = q(x)
    q.pack()
    assert (q.onednn_weight is not None) == PACKS
    assert torch.equal(q(x), before)


def test_lm_head_pack_keeps_the_tied_table():
    table = _bf16(300, 64)
    head = LMHead(table, None)
    x = _bf16(4, 64, seed=6)
    before = head(x)
    head.pack()
    assert head.weight is table and (head.onednn_weight is not None) == PACKS
    assert torch.equal(head(x), before)


def test_model_output_is_unchanged_by_packing(tiny_checkpoint, monkeypatch):
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
    prompts = [{"prompt_token_ids": [(5 * i + 3 * j) % 200 + 20 for j in range(n)]}
               for i, n in enumerate([4, 19, 33])]

    def run():
        llm = LLM(str(tiny_checkpoint("llama")), dtype="bfloat16", quantization=None,
                  max_model_len=128)
        return llm, [(o.outputs[0].token_ids, o.outputs[0].logprobs)
                     for o in llm.generate(prompts, params)]

    packed_llm, packed = run()
    assert (packed_llm.engine.runner.model.lm_head.onednn_weight is not None) == PACKS
    monkeypatch.setattr(linear_mod, "onednn_pack", lambda w: None)
    plain_llm, plain = run()
    assert plain_llm.engine.runner.model.lm_head.onednn_weight is None
    assert packed == plain
