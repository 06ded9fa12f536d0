"""Fused bfloat16 CPU ops (met/layers/fused_ops.py): each gives what the ATen chain it
replaces gives, row by row whatever the batch, and the Llama model's fused path gives the
unfused path's tokens and (nearly) its logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from met import LLM, SamplingParams
from met.kernels import fused_ops, kv_cache, sampler_ops
from met.kernels.kv_cache import KVCache
from met.layers import layer_stack
from met.layers.norms import RMSNorm
from met.layers.rotary import RotaryEmbedding


def test_fused_ops_compile_here():
    """The install brings a C++ compiler (scripts/install.sh), so the ops must build; the
    tests below would otherwise fail on the missing op rather than be skipped."""
    assert fused_ops.available(torch.zeros(1, dtype=torch.bfloat16))

# Widths with and without a partial last vector (16 lanes).
WIDTHS = [576, 64, 40, 17]
ROWS = [1, 7, 300]


def _bf16(*shape, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).bfloat16()


def _norm(d: int) -> RMSNorm:
    norm = RMSNorm(d, 1e-5, torch.bfloat16)
    norm.weight.data = _bf16(d, seed=9)
    return norm


@pytest.mark.parametrize("d", WIDTHS)
@pytest.mark.parametrize("t", ROWS)
def test_rms_norm_matches_module_within_one_ulp(t, d):
    norm, x = _norm(d), _bf16(t, d, scale=3.0)
    ref, got = norm(x), fused_ops.rms_norm(x, norm.weight, norm.eps)
    # The mean of squares is summed in another order: an output may round one ulp apart.
    ulp = ref.float().abs().clamp(min=1e-30) * 2**-7
    assert ((got.float() - ref.float()).abs() <= ulp).all()
    assert (got == ref).float().mean() > 0.999


@pytest.mark.parametrize("d", WIDTHS)
@pytest.mark.parametrize("t", ROWS)
def test_add_rms_norm_returns_the_exact_sum_and_its_norm(t, d):
    norm, x, delta = _norm(d), _bf16(t, d, seed=1), _bf16(t, d, seed=2)
    total, normed = fused_ops.add_rms_norm(x, delta, norm.weight, norm.eps)
    assert torch.equal(total, x + delta)
    assert torch.allclose(normed.float(), norm(x + delta).float(), rtol=2**-7, atol=0)


@pytest.mark.parametrize("width", [3072, 170, 128, 34, 18])  # 170: 64 + 16 + 5 per half
@pytest.mark.parametrize("t", ROWS)
def test_silu_mul_is_bitwise_silu_times_up(t, width):
    gate_up = _bf16(t, width, scale=4.0)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(fused_ops.silu_mul(gate_up), F.silu(gate) * up)


@pytest.mark.parametrize("head_dim", [64, 16, 20])
@pytest.mark.parametrize("t", ROWS)
def test_rope_to_cache_is_bitwise_rope_and_writes_only_its_slots(t, head_dim):
    h, hkv, slots_total = 6, 2, 700
    rotary = RotaryEmbedding(head_dim, 4096, {"rope_theta": 10000.0})
    qkv = _bf16(t, (h + 2 * hkv) * head_dim)
    positions = torch.randint(0, 4096, (t,), generator=torch.Generator().manual_seed(3))
    slots = torch.randperm(slots_total, generator=torch.Generator().manual_seed(4))[:t]
    k_cache = _bf16(hkv, slots_total, head_dim, seed=5)
    v_cache = _bf16(hkv, slots_total, head_dim, seed=6)
    k_before, v_before = k_cache.clone(), v_cache.clone()

    q = fused_ops.rope_qkv_to_cache(qkv, positions, rotary.cos, rotary.sin,
                                    KVCache(k_cache, v_cache), slots, h, hkv)

    qk = rotary.apply_(qkv[:, :(h + hkv) * head_dim].view(t, h + hkv, head_dim), positions)
    assert torch.equal(q, qk[:, :h])
    assert torch.equal(k_cache[:, slots].transpose(0, 1), qk[:, h:])
    v = qkv[:, (h + hkv) * head_dim:].view(t, hkv, head_dim)
    assert torch.equal(v_cache[:, slots].transpose(0, 1), v)
    untouched = torch.ones(slots_total, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(k_cache[:, untouched], k_before[:, untouched])
    assert torch.equal(v_cache[:, untouched], v_before[:, untouched])


@pytest.mark.parametrize("head_dim", [64, 16, 20])
@pytest.mark.parametrize("t", ROWS)
def test_rope_to_int8_cache_quantizes_like_write_kv(t, head_dim):
    """An int8 cache gets, bit for bit, what kv_cache.write_kv stores for the rotated bf16
    keys and the values (same int8 rows, same scales), and nothing outside its slots."""
    h, hkv, slots_total = 6, 2, 700
    rotary = RotaryEmbedding(head_dim, 4096, {"rope_theta": 10000.0})
    qkv = _bf16(t, (h + 2 * hkv) * head_dim, scale=3.0)
    if t > 1:
        qkv[1, (h + hkv) * head_dim:(h + hkv + 1) * head_dim] = 0  # an all-zero value row
    positions = torch.randint(0, 4096, (t,), generator=torch.Generator().manual_seed(3))
    slots = torch.randperm(slots_total, generator=torch.Generator().manual_seed(4))[:t]
    fused = kv_cache.allocate(hkv, slots_total, head_dim, torch.bfloat16, "cpu", "int8")
    ref = kv_cache.allocate(hkv, slots_total, head_dim, torch.bfloat16, "cpu", "int8")

    q = fused_ops.rope_qkv_to_cache(qkv, positions, rotary.cos, rotary.sin, fused, slots, h,
                                    hkv)

    qk = rotary.apply_(qkv[:, :(h + hkv) * head_dim].view(t, h + hkv, head_dim), positions)
    assert torch.equal(q, qk[:, :h])
    v = qkv[:, (h + hkv) * head_dim:].view(t, hkv, head_dim)
    kv_cache.write_kv(ref, slots, qk[:, h:], v)
    for got, want in zip(fused[:4], ref[:4], strict=True):  # k, v and their scales
        assert torch.equal(got, want)  # untouched slots stay zero in both
    # Dequantized, every row is within half a step of what a bfloat16 cache would hold.
    keys, values = kv_cache.gather_kv(fused, slots, torch.float32)
    for deq, exact, scale in ((keys, qk[:, h:], fused.k_scale), (values, v, fused.v_scale)):
        err = (deq - exact.transpose(0, 1).float()).abs()
        assert (err <= scale[:, slots, None] * 0.5 + 1e-6).all()


def test_each_row_is_computed_alone():
    """Batch invariance: a row's result is the same bits alone or among 300 rows."""
    d = 576
    norm, x, delta = _norm(d), _bf16(300, d, seed=7), _bf16(300, d, seed=8)
    many = fused_ops.add_rms_norm(x, delta, norm.weight, norm.eps)[1]
    one_by_one = torch.cat([fused_ops.add_rms_norm(x[i:i + 1], delta[i:i + 1], norm.weight,
                                                   norm.eps)[1] for i in range(300)])
    assert torch.equal(many, one_by_one)
    gate_up = _bf16(300, 3072, seed=10)
    assert torch.equal(fused_ops.silu_mul(gate_up),
                       torch.cat([fused_ops.silu_mul(gate_up[i:i + 1]) for i in range(300)]))


def test_rejects_other_dtypes_mixed_dtypes_and_bad_slots():
    norm = _norm(64)
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        fused_ops.rms_norm(torch.randn(2, 64).half(), norm.weight, 1e-5)
    with pytest.raises(RuntimeError, match="x's dtype"):
        fused_ops.rms_norm(torch.randn(2, 64), norm.weight, 1e-5)  # bfloat16 weight
    # float32 only where the caller allows it (a quantized model, never the exact reference)
    assert not fused_ops.available(torch.randn(2, 64))
    assert fused_ops.available(torch.randn(2, 64), allow_float32=True)
    rotary = RotaryEmbedding(16, 64, {"rope_theta": 10000.0})
    cache = torch.zeros(1, 8, 16, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="slot 8 outside the cache"):
        fused_ops.rope_qkv_to_cache(_bf16(1, 48), torch.tensor([0]), rotary.cos, rotary.sin,
                                    KVCache(cache, cache.clone()), torch.tensor([8]), 1, 1)


# ---- the model's fused path -------------------------------------------------------------

PROMPTS = [[(7 * i + 13 * j + 5) % 200 + 20 for j in range(n)]
           for i, n in enumerate([3, 17, 40, 70])]


def _logprobs_and_tokens(llm: LLM, max_tokens: int = 10
                         ) -> tuple[list[list[int]], list[list[float]]]:
    """Greedy tokens on PROMPTS and their logprobs (tests/layers/test_layer_stack.py too)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                            logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [[lp[t] for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids,
                                                  strict=True)] for o in outs]
    return tokens, logprobs


def _assert_fused_gives_the_unfused_tokens(llm: LLM, monkeypatch, atol: float,
                                           after_fused=lambda: True) -> None:
    """``llm``'s greedy tokens on PROMPTS equal those of its unfused path (fused ops turned
    off), logprobs within ``atol``; ``after_fused()`` must hold after the fused run."""
    fused_tokens, fused_lp = _logprobs_and_tokens(llm)
    assert after_fused(), "the model should take the fused path"
    monkeypatch.setattr(fused_ops, "available", lambda *args: False)
    llm.reset_prefix_cache()
    plain_tokens, plain_lp = _logprobs_and_tokens(llm)
    assert fused_tokens == plain_tokens
    for a, b in zip(fused_lp, plain_lp, strict=True):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=atol)


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_llama_fused_path_gives_the_unfused_tokens(tiny_checkpoint, arch, monkeypatch):
    llm = LLM(str(tiny_checkpoint(arch)), dtype="bfloat16", quantization=None,
              max_model_len=128)
    model = llm.engine.runner.model
    assert model._fused_layers, "the tiny model should take the fused bfloat16 path"
    _assert_fused_gives_the_unfused_tokens(llm, monkeypatch, atol=2e-2)


@pytest.mark.parametrize("t", ROWS)
def test_float32_ops_match_the_float32_aten_chains(t):
    """The float32 instantiations (a quantized float32 model's path): the residual sum
    exact, the rest within float32 rounding of ATen's chains (RMSNorm sums in another
    order, SiLU's exp is a polynomial, rope's products may fuse into FMAs)."""
    d, head_dim, h, hkv = 576, 64, 9, 3
    g = torch.Generator().manual_seed(5)
    norm = RMSNorm(d, 1e-5, torch.float32)
    norm.weight.data = torch.randn(d, generator=g)
    x, delta = torch.randn(t, d, generator=g), torch.randn(t, d, generator=g)
    total, normed = fused_ops.add_rms_norm(x, delta, norm.weight, norm.eps)
    assert torch.equal(total, x + delta)
    assert torch.allclose(normed, norm(x + delta), rtol=1e-5, atol=1e-6)
    assert torch.allclose(fused_ops.rms_norm(x, norm.weight, norm.eps), norm(x), rtol=1e-5,
                          atol=1e-6)
    gate_up = torch.randn(t, 2 * 1536, generator=g) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.allclose(fused_ops.silu_mul(gate_up), F.silu(gate) * up, rtol=1e-5,
                          atol=1e-6)
    rotary = RotaryEmbedding(head_dim, 4096, {"rope_theta": 10000.0})
    qkv = torch.randn(t, (h + 2 * hkv) * head_dim, generator=g)
    positions = torch.randint(0, 4096, (t,), generator=g)
    slots = torch.randperm(700, generator=g)[:t]
    k_cache, v_cache = torch.zeros(hkv, 700, head_dim), torch.zeros(hkv, 700, head_dim)
    q = fused_ops.rope_qkv_to_cache(qkv, positions, rotary.cos, rotary.sin,
                                    KVCache(k_cache, v_cache), slots, h, hkv)
    qk = rotary.apply_(qkv[:, :(h + hkv) * head_dim].clone().view(t, h + hkv, head_dim),
                       positions)
    assert q.dtype == torch.float32
    assert torch.allclose(q, qk[:, :h], rtol=1e-5, atol=1e-5)
    assert torch.allclose(k_cache[:, slots].transpose(0, 1), qk[:, h:], rtol=1e-5, atol=1e-5)
    v = qkv[:, (h + hkv) * head_dim:].view(t, hkv, head_dim)
    assert torch.equal(v_cache[:, slots].transpose(0, 1), v)


def test_quantized_float32_model_takes_the_fused_path_with_the_same_tokens(tiny_checkpoint,
                                                                           monkeypatch):
    """w4a8 in float32 (auto's pick on a CPU without native bfloat16) is not the exact
    reference, so it runs the fused ops: the same greedy tokens as its unfused path."""
    llm = LLM(str(tiny_checkpoint("llama")), dtype="float32", quantization="w4a8",
              max_model_len=128)
    model = llm.engine.runner.model
    assert model.fused_float32 and model._fused_layers
    # The Python loop of fused ops (the native layer stack, which replaces it where it
    # applies, gives its bits: tests/layers/test_layer_stack.py).
    monkeypatch.setattr(layer_stack.LayerStack, "run", lambda self, *args: None)
    calls = []
    real = fused_ops.add_rms_norm
    monkeypatch.setattr(fused_ops, "add_rms_norm", lambda *a: calls.append(1) or real(*a))
    _assert_fused_gives_the_unfused_tokens(llm, monkeypatch, atol=1e-3,
                                           after_fused=lambda: calls)


def test_float32_never_takes_the_fused_path(tiny_checkpoint, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("float32 must stay on the exact ATen path")

    for name in ("rms_norm", "add_rms_norm", "silu_mul", "rope_qkv_to_cache"):
        monkeypatch.setattr(fused_ops, name, refuse)
    llm = LLM(str(tiny_checkpoint("llama")), dtype="float32", quantization=None,
              max_model_len=128)
    out = llm.generate([{"prompt_token_ids": PROMPTS[1]}],
                       SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("shape", [(1, 49152), (64, 49152), (3, 17), (5, 100)])
def test_argmax_is_torch_argmax_with_ties_nans_and_infs(shape):
    t, v = shape
    x = torch.randn(t, v, generator=torch.Generator().manual_seed(11))
    assert torch.equal(sampler_ops.argmax(x), x.argmax(dim=-1))
    x[0, v // 3] = x[0, v // 2] = x[0].max() + 1  # a tie: the first index wins
    assert int(sampler_ops.argmax(x)[0]) == v // 3
    x[-1, v - 1] = x[-1, 2] = float("nan")  # NaN counts as the maximum
    assert torch.equal(sampler_ops.argmax(x), x.argmax(dim=-1))
    x[0] = float("-inf")
    assert torch.equal(sampler_ops.argmax(x), x.argmax(dim=-1))
