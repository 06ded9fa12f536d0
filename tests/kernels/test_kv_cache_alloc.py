"""met.kernels.kv_cache.allocate: a zeroed pool that costs memory only where it is used."""

from __future__ import annotations

import gc

import pytest
import torch

from met.kernels.kv_cache import allocate


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_pool_is_zeroed_writable_and_aligned(kv_cache_dtype):
    cache = allocate(3, 4096, 64, torch.bfloat16, "cpu", kv_cache_dtype)
    tensors = [cache.k, cache.v] + ([cache.k_scale, cache.v_scale] if cache.quantized else [])
    for t in tensors:
        assert t.is_contiguous() and t.data_ptr() % 64 == 0
        assert not t.any()
    assert cache.k.shape == (3, 4096, 64) and cache.quantized == (kv_cache_dtype == "int8")
    assert cache.k.dtype == (torch.int8 if cache.quantized else torch.bfloat16)
    cache.k[1, 7] = 5
    gc.collect()  # the tensors alone keep their memory alive
    assert cache.k[1, 7].tolist() == [5] * 64 and int(cache.k.ne(0).sum()) == 64
    assert not cache.v.any()  # k and v are separate memory


def test_unused_pool_takes_no_resident_memory():
    before = _resident_bytes()
    cache = allocate(3, 1 << 20, 64, torch.bfloat16, "cpu")  # 2 x 384 MiB
    assert _resident_bytes() - before < 32 << 20
    cache.k[:, : 1 << 18] = 1  # a quarter of the keys: ~96 MiB now in use
    grown = _resident_bytes() - before
    assert 90 << 20 < grown < 130 << 20
