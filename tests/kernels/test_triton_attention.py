"""The Triton attention backend (met.kernels.triton.attention), run on CPU in Triton's
interpreter (TRITON_INTERPRET=1, set by tests/conftest.py without a GPU): the kernels against
the plain varlen reference and the torch backend on mixed prefill/decode batches, prefix
hits and scattered slots; the KV writer bit for bit against kv_cache.write_kv; and the
engine on the backend against transformers."""

from __future__ import annotations

import pytest
import torch
import triton  # noqa: F401  (a test extra: without it these tests fail at import)
from test_oracle_models import assert_matches_hf, generate_checked, greedy_params, make_llm
from tiny_models import ARCHS, oracle_prompts

from met.kernels import kv_cache
from met.kernels.triton import attention as ta
from met.kernels.varlen import attention_reference
from met.layers.attention import attend_cached
from met.layers.batch import ForwardBatch, SeqSpan


def _step(lens: list[tuple[int, int]], num_slots: int, seed: int = 0):
    """A step of sequences (q_len, ctx_len) whose contexts sit at scattered slots."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_slots, generator=g)
    spans, q0, s0 = [], 0, 0
    for q_len, ctx in lens:
        spans.append(SeqSpan(q0, q_len, ctx, perm[s0:s0 + ctx]))
        q0, s0 = q0 + q_len, s0 + ctx
    slot_mapping = torch.cat([s.ctx_slots[s.ctx_len - s.q_len:] for s in spans])
    return ForwardBatch(torch.zeros(q0, dtype=torch.long), torch.zeros(q0, dtype=torch.long),
                        slot_mapping, tuple(spans))


# prefill from scratch, a decode, a prefill chunk after a prefix hit, one-token contexts,
# a decode over more than one key tile
MIXED = [(9, 9), (1, 77), (20, 45), (1, 1), (3, 3), (1, 130)]


def _cache(hkv, s, d, dtype, stored, g):
    k = torch.randn(hkv, s, d, generator=g).to(dtype)
    v = torch.randn(hkv, s, d, generator=g).to(dtype)
    if stored is None:
        return kv_cache.KVCache(k, v, backend="triton")
    q = kv_cache.quantize_kv(k, v, stored)
    return q._replace(backend="triton")


@pytest.mark.parametrize("stored", [None, torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 4, 32), (6, 2, 64),
                                                             (8, 2, 80)])
def test_kernel_matches_the_varlen_reference(dtype, stored, heads, kv_heads, head_dim):
    g = torch.Generator().manual_seed(1)
    batch = _step(MIXED, 400)
    kv = _cache(kv_heads, 400, head_dim, dtype, stored, g)
    t = batch.slot_mapping.numel()
    q = torch.randn(t, heads, head_dim, generator=g).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for window, softcap in ((None, None), (7, None), (None, 5.0), (16, 20.0)):
        got = ta.attention(q, kv.k, kv.v, kv.k_scale, kv.v_scale, batch.varlen(), 0.3,
                           window, softcap)
        ref = attention_reference(q, kv.k, kv.v, kv.k_scale, kv.v_scale, batch.varlen(),
                                  0.3, window, softcap)
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol,
                                   msg=f"window {window} softcap {softcap}")


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_backend_matches_the_torch_backend(window, kv_cache_dtype):
    """attend_cached on a triton cache and on a torch-backend cache holding the same rows."""
    g = torch.Generator().manual_seed(2)
    batch = _step(MIXED, 300, seed=3)
    t = batch.slot_mapping.numel()
    ref_kv = kv_cache.allocate(2, 300, 64, torch.float32, "cpu", kv_cache_dtype,
                               backend="torch")
    tri_kv = kv_cache.allocate(2, 300, 64, torch.float32, "cpu", kv_cache_dtype,
                               backend="triton")
    every = torch.arange(300)
    rows_k, rows_v = torch.randn(300, 2, 64, generator=g), torch.randn(300, 2, 64, generator=g)
    kv_cache.write_kv(ref_kv, every, rows_k, rows_v)
    kv_cache.write_kv(tri_kv, every, rows_k, rows_v)
    q = torch.randn(t, 6, 64, generator=g)
    got = attend_cached(q, tri_kv, batch, 0.125, window)
    ref = attend_cached(q, ref_kv, batch, 0.125, window)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_writer_stores_what_write_kv_stores(dtype, kv_cache_dtype):
    """Bit for bit: the model-dtype rows, or the quantized rows and their scales."""
    g = torch.Generator().manual_seed(4)
    k = torch.randn(13, 3, 48, generator=g).to(dtype) * 3
    v = torch.randn(13, 3, 48, generator=g).to(dtype)
    k[5] = 0  # an all-zero row: scale 0, values 0
    slots = torch.randperm(64, generator=g)[:13]
    ref = kv_cache.allocate(3, 64, 48, dtype, "cpu", kv_cache_dtype, backend="torch")
    got = kv_cache.allocate(3, 64, 48, dtype, "cpu", kv_cache_dtype, backend="triton")
    kv_cache.write_kv(ref, slots, k, v)
    kv_cache.write_kv(got, slots, k, v)
    for a, b in zip(got, ref, strict=False):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                               b.view(torch.uint8) if b.element_size() == 1 else b)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_engine_on_the_triton_backend_matches_transformers(arch, tiny_checkpoint):
    """float32 greedy: --attention-backend triton gives transformers' tokens on every tiny
    architecture, prompts batched with chunked prefill, then again from prefix-cache hits."""
    model_dir = tiny_checkpoint(arch)
    llm = make_llm(model_dir, attention_backend="triton", max_num_batched_tokens=32)
    assert llm.engine.loaded.kernel_plan.attention.name == "triton"
    prompts = oracle_prompts(arch)
    for _ in range(2):
        outs = generate_checked(llm, [{"prompt_token_ids": p} for p in prompts],
                                greedy_params())
        for out, prompt in zip(outs, prompts, strict=True):
            assert_matches_hf(out, model_dir, prompt)
    assert any(o.num_cached_tokens for o in outs), "the second pass hit no cached prefix"
