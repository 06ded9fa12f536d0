"""One layer's paged KV cache, in the model's dtype or in int8 / fp8 with a scale per row.

A cache is ``[num_kv_heads, num_slots, head_dim]`` keys and values, a slot being
``block * block_size + offset``. With ``--kv-cache-dtype int8`` each (head, slot) row of
head_dim values is stored as int8 with one float32 scale (symmetric: scale max|x| / 127,
values x / scale rounded to nearest even): head_dim + 4 bytes per row instead of 2 · head_dim
in bfloat16, so the same memory holds ~1.9x the tokens at head_dim 64. ``fp8`` is the same
with float8 e4m3 values (scale max|x| / 448, values rounded to nearest e4m3). Each row is quantized
alone, from the value a bfloat16 cache would have stored, so a token's cached row never
depends on its batch. Speed on the 2-core test machine (docs/benchmarks.md): no gain at one
stream (widening int8 costs what the smaller rows save while they sit in cache), 5–8 % at
16–64 streams, where a step's caches are read from memory.

Writers: `write_kv` (any device, any dtype), the fused CPU op `rope_qkv_to_cache` (model
dtype and int8) and the Triton writer (met.kernels.triton.attention), which quantize the
same way bit for bit. Readers: the native CPU decode kernel (int8 rows widened in registers,
the scales folded into the scores and the value weights), the Triton kernel (int8 and fp8,
the same way) and `gather_kv`, which dequantizes a request's rows for the reference SDPA
path (fp8 on CPU goes there).
"""

from __future__ import annotations

import math
import mmap
from typing import NamedTuple

import torch

from met.kernels.triton import attention as triton_attention

# The stored types of the quantized cache dtypes, and the largest value each stores.
QUANTIZED = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


class KVCache(NamedTuple):
    """A layer's keys and values [Hkv, S, D]; int8 / fp8 caches carry float32 scales
    [Hkv, S]."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    # The attention backend that reads it (met.kernels.registry): "cpu-native", "triton" or
    # "torch" (the reference, whatever faster kernel could read this cache).
    backend: str = "cpu-native"

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    @property
    def native(self) -> bool:
        """Read by the native CPU kernels."""
        return self.backend == "cpu-native"

    @property
    def triton(self) -> bool:
        return self.backend == "triton"

    @property
    def cpu_writable(self) -> bool:
        """Whether the fused CPU op (`rope_qkv_to_cache`) can write it: a CPU cache in the
        model's dtype or int8, for a CPU backend."""
        return (self.k.device.type == "cpu" and not self.triton
                and self.k.dtype != torch.float8_e4m3fn)


def stored_dtype(kv_cache_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """The element type a cache of ``kv_cache_dtype`` stores for a model in ``dtype``."""
    if kv_cache_dtype == "bf16":
        return torch.bfloat16
    return QUANTIZED.get(kv_cache_dtype, dtype)


def allocate(num_kv_heads: int, num_slots: int, head_dim: int, dtype: torch.dtype,
             device: torch.device | str, kv_cache_dtype: str = "auto",
             backend: str = "cpu-native", v_head_dim: int | None = None) -> KVCache:
    """A zeroed cache of num_slots rows per kv head (int8 / fp8 + scales for "int8" /
    "fp8"), read by the attention ``backend``. ``v_head_dim``: the value rows' width when
    it is not head_dim; 0 keeps no values at all (MLA's latent cache, `write_keys`)."""
    shape = (num_kv_heads, num_slots, head_dim)
    v_shape = shape if v_head_dim is None else (num_kv_heads, num_slots, v_head_dim)
    v_rows = (num_kv_heads, num_slots if v_shape[2] else 0)  # no value rows: no scales
    stored = QUANTIZED.get(kv_cache_dtype)
    if stored is not None:
        return KVCache(_zeros(shape, stored, device), _zeros(v_shape, stored, device),
                       _zeros(shape[:2], torch.float32, device),
                       _zeros(v_rows, torch.float32, device), backend)
    dtype = stored_dtype(kv_cache_dtype, dtype)
    return KVCache(_zeros(shape, dtype, device), _zeros(v_shape, dtype, device),
                   backend=backend)


def nbytes(cache: KVCache) -> int:
    """The bytes a layer's cache holds (keys, values and any scales)."""
    return sum(t.numel() * t.element_size()
               for t in (cache.k, cache.v, cache.k_scale, cache.v_scale) if t is not None)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str
           ) -> torch.Tensor:
    """torch.zeros(shape). On CPU the memory is an anonymous memory map, whose pages the OS
    hands out zero-filled on first touch: startup does not fault in and clear the whole pool
    (torch.zeros took ~1.8 s for the default 2 GiB on the 2-core test machine), and resident
    memory grows with the part of the cache in use. Page-aligned, like the kernels' rows."""
    device = torch.device(device)
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    # frombuffer keeps the map alive as long as the tensor (or a view of it) lives.
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8).view(dtype).view(shape)


def bytes_per_token(num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                    kv_cache_dtype: str = "auto", v_head_dim: int | None = None) -> int:
    """Bytes one token's keys and values take in one layer's cache (``v_head_dim`` as in
    `allocate`)."""
    v_dim = head_dim if v_head_dim is None else v_head_dim
    if kv_cache_dtype in QUANTIZED:
        return num_kv_heads * (head_dim + 4 + (v_dim + 4 if v_dim else 0))
    return num_kv_heads * (head_dim + v_dim) * stored_dtype(kv_cache_dtype, dtype).itemsize


def quantize_rows(x: torch.Tensor, stored: torch.dtype = torch.int8
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows x [..., D] (any float dtype) -> int8 (or fp8) [..., D] and float32 scales [...]:
    the scale is max|x| / 127 (448 for fp8 e4m3), the value round-half-even(x / scale) (0 for
    an all-zero row), all in float32. The fused CPU op and the Triton writer compute exactly
    this (the same float32 operations)."""
    qmax = _QMAX[stored]
    xf = x.float()
    scale = torch.div(xf.abs().amax(dim=-1), torch.tensor(qmax))
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.where(scale.unsqueeze(-1) > 0, xf / safe.unsqueeze(-1), torch.zeros_like(xf))
    if stored == torch.int8:
        q = q.round()
    return q.clamp(-qmax, qmax).to(stored), scale


def quantize_kv(k: torch.Tensor, v: torch.Tensor, stored: torch.dtype = torch.int8) -> KVCache:
    """An int8 (or fp8) cache holding the rows of k, v [Hkv, S, D] (quantize_rows of each)."""
    (kq, ks), (vq, vs) = quantize_rows(k, stored), quantize_rows(v, stored)
    return KVCache(kq, vq, ks, vs)


def write_kv(kv: KVCache, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Store the step's keys and values k, v [T, Hkv, D] in their slots. An int8 cache
    quantizes the rows as stored in the model's dtype (what a float cache would hold)."""
    if kv.triton:
        triton_attention.write_kv(kv.k, kv.v, kv.k_scale, kv.v_scale, slot_mapping, k, v)
        return
    if not kv.quantized:
        kv.k.index_copy_(1, slot_mapping, k.transpose(0, 1).to(kv.k.dtype))
        kv.v.index_copy_(1, slot_mapping, v.transpose(0, 1).to(kv.v.dtype))
        return
    for rows, cache, scales in ((k, kv.k, kv.k_scale), (v, kv.v, kv.v_scale)):
        q, s = quantize_rows(rows.transpose(0, 1), cache.dtype)
        _bytes(cache).index_copy_(1, slot_mapping, _bytes(q))
        scales.index_copy_(1, slot_mapping, s)


def gather_kv(kv: KVCache, slots: torch.Tensor, dtype: torch.dtype
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [Hkv, len(slots), D] of the given slots, in ``dtype`` (dequantized
    int8 rows are q · scale in float32, then rounded once to ``dtype``)."""
    if not kv.quantized:
        return kv.k.index_select(1, slots), kv.v.index_select(1, slots)
    k = _bytes(kv.k).index_select(1, slots).view(kv.k.dtype)
    v = _bytes(kv.v).index_select(1, slots).view(kv.v.dtype)
    ks, vs = kv.k_scale.index_select(1, slots), kv.v_scale.index_select(1, slots)
    return ((k.float() * ks.unsqueeze(-1)).to(dtype), (v.float() * vs.unsqueeze(-1)).to(dtype))


def write_keys(kv: KVCache, slot_mapping: torch.Tensor, k: torch.Tensor) -> None:
    """Store rows k [T, Hkv, D] in the key cache only, on any device and backend: a cache
    without values (MLA keeps one latent row per token, read back by `gather_keys`). Int8 /
    fp8 rows are quantized as `write_kv` does."""
    if not kv.quantized:
        kv.k.index_copy_(1, slot_mapping, k.transpose(0, 1).to(kv.k.dtype))
        return
    q, s = quantize_rows(k.transpose(0, 1), kv.k.dtype)
    _bytes(kv.k).index_copy_(1, slot_mapping, _bytes(q))
    kv.k_scale.index_copy_(1, slot_mapping, s)


def gather_keys(kv: KVCache, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The key rows [Hkv, len(slots), D] of the given slots in ``dtype`` (dequantized as in
    `gather_kv`)."""
    if not kv.quantized:
        return kv.k.index_select(1, slots).to(dtype)
    k = _bytes(kv.k).index_select(1, slots).view(kv.k.dtype)
    return (k.float() * kv.k_scale.index_select(1, slots).unsqueeze(-1)).to(dtype)


def _bytes(x: torch.Tensor) -> torch.Tensor:
    # torch's CPU index ops have no float8 kernels; one-byte rows move as uint8.
    return x.view(torch.uint8)
