"""Paged varlen attention and the KV write as Triton kernels (the ``triton`` attention backend).

One kernel serves every row of a step, prefill chunks and decodes alike: a program takes
BLOCK_M query tokens of one sequence times the query heads of one KV head (GQA: the group's
heads share each key and value tile), walks the sequence's keys in BLOCK_N tiles through its
slot list with an online softmax, and masks per row (causal, sliding window, softcap). A
sequence's rows depend only on its own keys, so results are batch-invariant.

Caches are ``[Hkv, S, D]`` as in met.kernels.kv_cache: in the model's dtype, or int8 / fp8
(e4m3) rows with a float32 scale per (head, slot) row. Quantized keys are widened to the
query dtype (exact: |int8| <= 127 and every e4m3 value fit bfloat16); the key scale multiplies
each score and the value scale each softmax weight, so the cache is read directly.
"""

from __future__ import annotations

import functools
import os

import torch

from met.kernels.varlen import VarlenMeta

_QUANT = {torch.int8: 1, torch.float8_e4m3fn: 2}


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.cache
def _kernels():
    from met.kernels.triton import _jit

    return _jit.attn_kernel, _jit.write_kernel


def _scales(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None,
            v_scale: torch.Tensor | None) -> tuple[int, torch.Tensor, torch.Tensor]:
    """The kernels' QUANT code and scale operands (a cache stands in for absent scales: the
    pointer is never read when QUANT is 0)."""
    quant = _QUANT.get(k_cache.dtype, 0)
    return quant, (k_scale if quant else k_cache), (v_scale if quant else v_cache)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None,
             v_scale: torch.Tensor | None, slot_mapping: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """Store k, v [T, Hkv, D] at their slots of caches [Hkv, S, D] (quantizing rows as
    met.kernels.kv_cache.quantize_rows does for an int8 / fp8 cache)."""
    t, hkv, d = k.shape
    if t == 0:
        return
    assert k_cache.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1
    quant, ks, vs = _scales(k_cache, v_cache, k_scale, v_scale)
    _, write = _kernels()
    write[(t, hkv)](k, v, k_cache, v_cache, ks, vs, slot_mapping,
                    k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                    k_cache.stride(0), k_cache.stride(1), ks.stride(0) if quant else 0,
                    HEAD_DIM=d, BLOCK_D=_next_pow2(d), QUANT=quant)


@functools.cache
def _interpreted() -> bool:
    # The interpreter's tl.dot is wrong for 16-bit inputs (numpy has no bfloat16): it gets
    # them widened to float32, which is what the GPU's products are (exact, float32 sums).
    return os.environ.get("TRITON_INTERPRET") == "1"


def block_m(max_q_len: int, group_pad: int) -> int:
    """Query tokens per program: enough rows (tokens x group heads) for tensor-core tiles
    (>= 16), no more than a decode-only step needs."""
    rows = 16 if max_q_len == 1 else 64
    return max(1, rows // group_pad)


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, meta: VarlenMeta,
              scale: float, window: int | None = None,
              softcap: float | None = None) -> torch.Tensor:
    """Causal attention of q [T, H, D] over each sequence's cached keys; returns [T, H, D]."""
    t, h, d = q.shape
    hkv = k_cache.shape[0]
    out = torch.empty_like(q)
    if t == 0 or meta.num_seqs == 0:
        return out
    if q.stride(2) != 1:
        q = q.contiguous()
    group = h // hkv
    group_pad = _next_pow2(group)
    bm = block_m(meta.max_q_len, group_pad)
    tile_seq, tile_m0 = meta.tiles(bm)
    quant, ks, vs = _scales(k_cache, v_cache, k_scale, v_scale)
    attn, _ = _kernels()
    interpreted = _interpreted()
    attn[(tile_seq.numel(), hkv)](
        q, k_cache, v_cache, ks, vs, out, meta.slots, tile_seq, tile_m0,
        meta.q_start, meta.q_len, meta.ctx_len, meta.slot_start,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), ks.stride(0) if quant else 0,
        out.stride(0), out.stride(1),
        float(scale), float(softcap or 0.0), int(window or 0),
        GROUP=group, GROUP_PAD=group_pad, BLOCK_M=bm, BLOCK_N=32 if d > 128 else 64,
        HEAD_DIM=d, BLOCK_D=max(16, _next_pow2(d)), QUANT=quant, SOFTCAP=bool(softcap),
        WINDOW=bool(window), IEEE=q.dtype == torch.float32 or interpreted,
        UPCAST=interpreted)
    return out
