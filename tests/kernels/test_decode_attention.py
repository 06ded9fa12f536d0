"""The native CPU decode-attention kernel: matches per-request SDPA and is batch-invariant."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from met.kernels.decode_attention import (
    decode_attention,
    decode_attention_available,
    decode_attention_reference,
)
from met.kernels.kv_cache import KVCache, gather_kv, quantize_kv


def _problem(
    n: int,
    h: int,
    hkv: int,
    d: int,
    dtype: torch.dtype,
    seed: int,
    max_len: int = 300,
    layout: str = "contiguous",
    lens: list[int] | None = None,
):
    """Random q, caches and per-request slot lists (shuffled, so reads are scattered).

    lens: the context lengths (default: random in 1..max_len, the first one 1).

    layout "transposed": q and the caches are views of [H, N, D] / [S, Hkv, D] buffers;
    "every_other": the head dim itself is strided (every other element of a wider buffer).
    """
    g = torch.Generator().manual_seed(seed)
    if lens is None:
        lens = torch.randint(1, max_len + 1, (n,), generator=g)
        lens[0] = 1  # always cover the single-key context
    else:
        lens = torch.tensor(lens)
    total = int(lens.sum())
    num_slots = total + 37
    if layout == "transposed":
        k = torch.randn(num_slots, hkv, d, generator=g).to(dtype).transpose(0, 1)
        v = torch.randn(num_slots, hkv, d, generator=g).to(dtype).transpose(0, 1)
        q = torch.randn(h, n, d, generator=g).to(dtype).transpose(0, 1)
    elif layout == "every_other":
        k = torch.randn(hkv, num_slots, 2 * d, generator=g).to(dtype)[..., ::2]
        v = torch.randn(hkv, num_slots, 2 * d, generator=g).to(dtype)[..., 1::2]
        q = torch.randn(n, h, 2 * d, generator=g).to(dtype)[..., ::2]
    else:
        k = torch.randn(hkv, num_slots, d, generator=g).to(dtype)
        v = torch.randn(hkv, num_slots, d, generator=g).to(dtype)
        q = torch.randn(n, h, d, generator=g).to(dtype)
    slots = torch.randperm(num_slots, generator=g)[:total]
    offsets = torch.zeros(n + 1, dtype=torch.long)
    offsets[1:] = lens.cumsum(0)
    return q, k, v, slots, offsets


def _float32(k: torch.Tensor, v: torch.Tensor) -> KVCache:
    return KVCache(k.float(), v.float())


def test_kernel_compiles_here():
    assert decode_attention_available()


# GQA 9/3 and MHA 4/4 at the engine's head dims; 40 and 96 exercise the padded and the
# partial-block paths, 128 two 32-wide bf16 blocks. Contiguous rows with D % 32 == 0 take the
# register-blocked path, whose heads go in blocks of three: 16/2 (8 per group: 3 + 3 + 2) and
# 8/2 at D 32 (3 + 1, a lone 32-wide value block) cover its remainders.
SHAPES = [
    (9, 3, 64),
    (4, 4, 64),
    (9, 3, 16),
    (4, 4, 16),
    (6, 2, 40),
    (8, 2, 96),
    (2, 1, 128),
    (16, 2, 64),
    (8, 2, 32),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("h", "hkv", "d"), SHAPES)
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "every_other"])
def test_matches_per_request_sdpa(dtype, h, hkv, d, layout):
    q, k, v, slots, offsets = _problem(7, h, hkv, d, dtype, seed=h * 100 + d, layout=layout)
    scale = d**-0.5
    out = decode_attention(q, KVCache(k, v), slots, offsets, scale)
    assert out.dtype == dtype and out.shape == q.shape
    # The reference in float32 on the same (possibly bf16-rounded) inputs.
    ref = decode_attention_reference(q.float(), _float32(k, v), slots, offsets, scale)
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    else:
        # bf16 output: one rounding of a value of magnitude < ~3 is at most ~8e-3.
        torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_peaked_softmax_is_stable(dtype):
    """Large logits must not overflow: the max is subtracted before exp."""
    q, k, v, slots, offsets = _problem(3, 4, 2, 64, dtype, seed=5)
    q = (q.float() * 40).to(dtype)
    out = decode_attention(q, KVCache(k, v), slots, offsets, 1.0)
    ref = decode_attention_reference(q.float(), _float32(k, v), slots, offsets, 1.0)
    assert torch.isfinite(out).all()
    atol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref, atol=atol, rtol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("h", "hkv", "d"), [(9, 3, 64), (4, 4, 16)])
def test_batch_invariance(dtype, h, hkv, d):
    """A request's row is bitwise the same alone, in a batch of 17, and in reversed order."""
    q, k, v, slots, offsets = _problem(17, h, hkv, d, dtype, seed=11)
    scale = d**-0.5
    batched = decode_attention(q, KVCache(k, v), slots, offsets, scale)

    order = list(range(16, -1, -1))
    seqs = [slots[offsets[i] : offsets[i + 1]] for i in order]
    rev_offsets = torch.zeros(18, dtype=torch.long)
    rev_offsets[1:] = torch.tensor([s.numel() for s in seqs]).cumsum(0)
    reversed_out = decode_attention(q[order], KVCache(k, v), torch.cat(seqs), rev_offsets, scale)

    for i in range(17):
        own = slots[offsets[i] : offsets[i + 1]]
        alone = decode_attention(q[i : i + 1], KVCache(k, v), own,
                                 torch.tensor([0, own.numel()]), scale)
        assert torch.equal(alone[0], batched[i]), f"request {i}: alone != in batch"
        assert torch.equal(reversed_out[16 - i], batched[i]), f"request {i}: order changed it"


# Around the 512-key chunk a long context is split into: one chunk, one plus a single key,
# three chunks, and a short request beside them.
SPLIT_LENS = [512, 513, 1500, 7]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["contiguous", "every_other"])
def test_long_contexts_split_into_chunks_still_match_and_stay_invariant(dtype, layout):
    """Chunked long contexts (merged in chunk order) still give the per-request SDPA result,
    bitwise the same alone as in the batch, and on one thread as on several."""
    q, k, v, slots, offsets = _problem(4, 9, 3, 64, dtype, seed=21, layout=layout, lens=SPLIT_LENS)
    scale = 0.125
    batched = decode_attention(q, KVCache(k, v), slots, offsets, scale)
    ref = decode_attention_reference(q.float(), _float32(k, v), slots, offsets, scale)
    if dtype == torch.float32:
        torch.testing.assert_close(batched, ref, atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(batched.float(), ref, atol=1e-2, rtol=1e-2)
    for i in range(4):
        own = slots[offsets[i] : offsets[i + 1]]
        alone = decode_attention(q[i : i + 1], KVCache(k, v), own,
                                 torch.tensor([0, own.numel()]), scale)
        assert torch.equal(alone[0], batched[i]), f"request {i}: alone != in batch"
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = decode_attention(q, KVCache(k, v), slots, offsets, scale)
        torch.set_num_threads(max(2, before))
        many = decode_attention(q, KVCache(k, v), slots, offsets, scale)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, batched) and torch.equal(many, batched)


def _int8(k: torch.Tensor, v: torch.Tensor) -> tuple[KVCache, KVCache]:
    """The int8 cache of k, v and, as float32, the rows it dequantizes to."""
    cache = quantize_kv(k, v)
    every = torch.arange(k.shape[1])
    return cache, KVCache(*gather_kv(cache, every, torch.float32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("h", "hkv", "d", "lens"), [
    (9, 3, 64, None), (4, 4, 128, None), (16, 2, 64, None), (9, 3, 64, SPLIT_LENS)])
def test_int8_cache_is_attention_over_its_dequantized_rows(dtype, h, hkv, d, lens):
    """An int8 cache (met.kernels.kv_cache) gives the float path's result on the rows it
    dequantizes to, split contexts included, and stays batch-invariant."""
    n = 7 if lens is None else len(lens)
    q, k, v, slots, offsets = _problem(n, h, hkv, d, torch.float32, seed=h + d, lens=lens)
    q = q.to(dtype)
    cache, dequantized = _int8(k, v)
    out = decode_attention(q, cache, slots, offsets, d**-0.5)
    assert out.dtype == dtype and out.shape == q.shape
    ref = decode_attention_reference(q.float(), dequantized, slots, offsets, d**-0.5)
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=1e-2)
    # ... and it stays close to attention over the exact rows (int8 steps of max|x| / 127).
    exact = decode_attention_reference(q.float(), KVCache(k, v), slots, offsets, d**-0.5)
    assert (out.float() - exact).abs().max() < 0.05
    for i in range(n):
        own = slots[offsets[i] : offsets[i + 1]]
        alone = decode_attention(q[i : i + 1], cache, own, torch.tensor([0, own.numel()]),
                                 d**-0.5)
        assert torch.equal(alone[0], out[i]), f"request {i}: alone != in batch"


def test_int8_cache_of_other_head_dims_goes_to_the_reference():
    """head_dim 32: the kernel reads int8 rows 64 at a time, so the reference answers."""
    q, k, v, slots, offsets = _problem(5, 4, 2, 32, torch.bfloat16, seed=9)
    cache, _ = _int8(k, v)
    out = decode_attention(q, cache, slots, offsets, 0.25)
    assert torch.equal(out, decode_attention_reference(q, cache, slots, offsets, 0.25))


@pytest.mark.parametrize("int8", [False, True])
def test_thread_count_does_not_change_results(int8):
    q, k, v, slots, offsets = _problem(17, 9, 3, 64, torch.bfloat16, seed=3)
    cache = quantize_kv(k, v) if int8 else KVCache(k, v)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = decode_attention(q, cache, slots, offsets, 0.125)
        torch.set_num_threads(max(2, before))
        many = decode_attention(q, cache, slots, offsets, 0.125)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, many)


def test_rejects_bad_slots_instead_of_reading_out_of_bounds():
    q, k, v, slots, offsets = _problem(2, 4, 2, 16, torch.float32, seed=1)
    bad = slots.clone()
    bad[-1] = k.shape[1]
    with pytest.raises(RuntimeError, match="outside the cache"):
        decode_attention(q, KVCache(k, v), bad, offsets, 0.25)
    empty = offsets.clone()
    empty[1] = empty[0]
    with pytest.raises(RuntimeError, match="empty or out-of-range"):
        decode_attention(q, KVCache(k, v), slots, empty, 0.25)


def test_falls_back_to_sdpa_loop_with_one_warning_when_the_build_fails(tmp_path):
    """No working compiler: one warning, then the reference loop gives the same answers."""
    script = """
import logging, torch
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s %(message)s")
from met.kernels.decode_attention import (
    decode_attention, decode_attention_available, decode_attention_reference)
from met.kernels.kv_cache import KVCache
q, k, v = torch.randn(2, 4, 16), torch.randn(2, 50, 16), torch.randn(2, 50, 16)
slots, offsets = torch.arange(30), torch.tensor([0, 10, 30])
assert not decode_attention_available()
for _ in range(3):
    out = decode_attention(q, KVCache(k, v), slots, offsets, 0.25)
assert torch.equal(out, decode_attention_reference(q, KVCache(k, v), slots, offsets, 0.25))
print("FELL_BACK")
"""
    repo = Path(__file__).resolve().parents[2]
    env = {
        **os.environ,
        "TORCH_EXTENSIONS_DIR": str(tmp_path),  # no cached build to load
        "CXX": str(tmp_path / "no-such-compiler"),
        "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "FELL_BACK" in proc.stdout
    warnings = [
        line
        for line in proc.stderr.splitlines()
        if line.startswith("WARNING met.kernels.native") and "decode_attention unavailable" in line
    ]
    assert len(warnings) == 1, proc.stderr[-3000:]
