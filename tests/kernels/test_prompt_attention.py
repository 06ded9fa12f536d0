"""Prompt attention on AMX-BF16 tiles (met.kernels.prompt_attention): causal attention of
prompt chunks over the paged cache, checked against float64 attention on the same bfloat16
inputs, and bitwise the same for a row however its prompt is chunked or batched."""

from __future__ import annotations

import math

import pytest
import torch

from met.kernels.kv_cache import KVCache, allocate
from met.kernels.prompt_attention import (
    prompt_attention,
    prompt_attention_applies,
    prompt_attention_available,
)

SLOTS = 4096
BLOCK = 16


def _cache(hkv: int, d: int, seed: int = 0) -> KVCache:
    g = torch.Generator().manual_seed(seed)
    return KVCache(torch.randn(hkv, SLOTS, d, generator=g).bfloat16(),
                   torch.randn(hkv, SLOTS, d, generator=g).bfloat16())


def _context_slots(n: int, seed: int) -> torch.Tensor:
    """n slots the way the paged cache hands them out: whole blocks in a random order."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randperm(SLOTS // BLOCK, generator=g)[: -(-n // BLOCK)]
    return (blocks[:, None] * BLOCK + torch.arange(BLOCK)).flatten()[:n]


def _call(q, kv, chunks, scale):
    """chunks: (rows of q, context slots) per chunk, the rows being the context's last."""
    bounds, slots, start = [], [], 0
    for rows, ctx in chunks:
        bounds.append([rows.start, rows.stop - rows.start, len(ctx), start])
        slots.append(ctx)
        start += len(ctx)
    return prompt_attention(q, kv, torch.cat(slots), torch.tensor(bounds), scale)


def _reference(q, kv, chunks, scale):
    out = torch.zeros(q.shape, dtype=torch.float64)
    group = q.shape[1] // kv.k.shape[0]
    for rows, ctx in chunks:
        n, length = rows.stop - rows.start, len(ctx)
        k = kv.k[:, ctx].double().repeat_interleave(group, 0)
        v = kv.v[:, ctx].double().repeat_interleave(group, 0)
        scores = q[rows].double().transpose(0, 1) @ k.transpose(1, 2) * scale
        pos = torch.arange(length - n, length)[:, None]
        scores = scores.masked_fill(torch.arange(length)[None, :] > pos, float("-inf"))
        out[rows] = (scores.softmax(-1) @ v).transpose(0, 1)
    return out


AMX = prompt_attention_available()


@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (4, 4, 32), (4, 2, 128), (2, 1, 96)])
def test_matches_float64_attention_within_bfloat16_rounding(heads, kv_heads, d):
    kv = _cache(kv_heads, d)
    assert prompt_attention_applies(torch.empty(1, heads, d, dtype=torch.bfloat16), kv) == AMX
    if not AMX:  # no AMX-BF16 here: models keep prompt rows on the decode kernel
        return
    # A whole 100-token prompt, a 37-row chunk at the end of a 70-token context, a 1-row
    # chunk (a prompt's last token after a prefix hit) and a 300-token prompt.
    chunks = [(range(0, 100), _context_slots(100, 1)), (range(100, 137), _context_slots(70, 2)),
              (range(137, 138), _context_slots(45, 3)), (range(138, 438), _context_slots(300, 4))]
    g = torch.Generator().manual_seed(5)
    q = (torch.randn(438, heads, d, generator=g) * 2).bfloat16()
    scale = 1 / math.sqrt(d)
    got = _call(q, kv, chunks, scale)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    ref = _reference(q, kv, chunks, scale)
    err = (got.double() - ref).abs()
    rounding = (ref.bfloat16().double() - ref).abs()
    # Within one bfloat16 step of the exact result everywhere (1e-5 absolute where outputs
    # cancel to near zero; float32 sums leave ~1e-6 there), and on average as close as
    # rounding the exact result itself.
    assert (err <= 2 ** -7 * ref.abs() + 1e-5).all(), err.max()
    assert err.mean() <= 1.05 * rounding.mean(), (err.mean(), rounding.mean())


def test_a_row_gives_the_same_bits_in_any_chunking_and_batch():
    if not AMX:
        return
    kv = _cache(3, 64)
    ctx = _context_slots(150, 7)
    other = _context_slots(80, 8)
    g = torch.Generator().manual_seed(9)
    q = torch.randn(150, 9, 64, generator=g).bfloat16()
    q_other = torch.randn(80, 9, 64, generator=g).bfloat16()
    scale = 0.125
    whole = _call(q, kv, [(range(0, 150), ctx)], scale)
    for size in (1, 7, 16, 33, 64):
        for start in range(0, 150, size):
            stop = min(150, start + size)
            got = _call(q[start:stop], kv, [(range(0, stop - start), ctx[:stop])], scale)
            assert torch.equal(got, whole[start:stop]), (size, start)
    # Beside another prompt, before and after it.
    both = _call(torch.cat([q_other, q]), kv,
                 [(range(0, 80), other), (range(80, 230), ctx)], scale)
    assert torch.equal(both[80:], whole)
    both = _call(torch.cat([q, q_other]), kv,
                 [(range(0, 150), ctx), (range(150, 230), other)], scale)
    assert torch.equal(both[:150], whole)
    # Any number of threads.
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(_call(q, kv, [(range(0, 150), ctx)], scale), whole)
    finally:
        torch.set_num_threads(threads)


def test_slots_outside_the_context_are_never_read():
    """A freshly allocated or reused cache holds anything past a chunk's context: NaN there
    must not reach the output."""
    if not AMX:
        return
    kv = allocate(3, SLOTS, 64, torch.bfloat16, "cpu")
    kv.k.fill_(float("nan"))
    kv.v.fill_(float("nan"))
    ctx = _context_slots(45, 11)  # 45 keys: the last 16- and 32-key tiles are partial
    g = torch.Generator().manual_seed(12)
    kv.k[:, ctx] = torch.randn(3, 45, 64, generator=g).bfloat16()
    kv.v[:, ctx] = torch.randn(3, 45, 64, generator=g).bfloat16()
    q = torch.randn(20, 9, 64, generator=g).bfloat16()
    got = _call(q, kv, [(range(0, 20), ctx)], 0.125)
    assert torch.isfinite(got.float()).all()
    ref = _reference(q, kv, [(range(0, 20), ctx)], 0.125)
    assert ((got.double() - ref).abs() <= 2 ** -7 * ref.abs() + 1e-5).all()


def test_bad_shapes_are_refused_naming_what_is_wrong():
    kv = _cache(2, 48)
    q = torch.zeros(4, 4, 48, dtype=torch.bfloat16)
    assert not prompt_attention_applies(q, kv)  # head_dim 48: not a multiple of 32
    int8 = allocate(2, 64, 64, torch.bfloat16, "cpu", "int8")
    assert not prompt_attention_applies(torch.zeros(1, 4, 64, dtype=torch.bfloat16), int8)
    assert not prompt_attention_applies(torch.zeros(1, 4, 64), _cache(2, 64))  # float32
    if not AMX:
        return
    with pytest.raises(RuntimeError, match="head_dim must be a multiple of 32"):
        _call(q, kv, [(range(0, 4), torch.arange(4))], 0.1)
    kv = _cache(2, 64)
    q = torch.zeros(4, 4, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="chunk 0 does not fit"):
        _call(q, kv, [(range(0, 5), torch.arange(5))], 0.1)  # 5 rows of a 4-row q
    with pytest.raises(RuntimeError, match="chunk 0 does not fit"):
        _call(q, kv, [(range(0, 4), torch.arange(3))], 0.1)  # more rows than context
