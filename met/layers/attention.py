"""Paged attention, pure PyTorch: runs on CPU and CUDA and is the reference backend.

Each layer's KV cache (met.kernels.kv_cache.KVCache) is keys and values [num_kv_heads,
num_slots, head_dim], a slot being block * block_size + offset, in the model's dtype or int8
with a scale per row. New keys/values are scattered into their slots, then every request
attends over its own context only, so a request's result never depends on what else is in
the batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from met.kernels import varlen
from met.kernels.decode_attention import decode_attention
from met.kernels.kv_cache import KVCache, gather_kv, write_kv
from met.kernels.prompt_attention import prompt_attention, prompt_attention_applies
from met.kernels.triton import attention as triton_attention
from met.layers.batch import ForwardBatch

__all__ = ["KVCache", "attend_cached", "paged_attention"]


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: KVCache,
    batch: ForwardBatch,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of q [T, H, D] over each request's cached context; returns [T, H, D].

    Writes the step's new keys and values k, v [T, Hkv, D] into their slots first."""
    write_kv(kv_cache, batch.slot_mapping, k, v)
    return attend_cached(q, kv_cache, batch, scale, sliding_window, softcap, sinks)


def attend_cached(
    q: torch.Tensor,
    kv_cache: KVCache,
    batch: ForwardBatch,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """`paged_attention` once the step's keys and values are already in the cache.

    The Triton backend takes every row in one call. Otherwise a model that runs prompt rows
    through their own kernels (`ForwardBatch.prompt_rows`) has them attended by the
    prompt-attention kernel where it applies (a bfloat16 cache on an AMX-BF16 CPU, full
    attention); every other row as before. Score softcapping (Gemma-2) runs on the Triton
    kernel or the plain varlen reference. Attention sinks (gpt-oss: a logit per head in
    every softmax denominator) run on the plain varlen reference only, on any device: the
    native CPU and Triton kernels do not take them yet."""
    if sinks is not None:
        return varlen.attention_reference(q, kv_cache.k, kv_cache.v, kv_cache.k_scale,
                                          kv_cache.v_scale, batch.varlen(), scale,
                                          sliding_window, softcap, sinks)
    if kv_cache.triton or softcap:
        run = triton_attention.attention if kv_cache.triton else varlen.attention_reference
        return run(q, kv_cache.k, kv_cache.v, kv_cache.k_scale, kv_cache.v_scale,
                   batch.varlen(), scale, sliding_window, softcap)
    gqa = q.shape[1] != kv_cache.k.shape[0]
    first = batch.prompt_rows
    if not (first and sliding_window is None and prompt_attention_applies(q, kv_cache)):
        first = 0
    prompt_out = None
    if first:
        chunks = batch.prompt_chunks()
        prompt_out = prompt_attention(q[:first], kv_cache, chunks.slots, chunks.bounds, scale)
        if first == q.shape[0]:
            return prompt_out
    plan = batch.window_plan(sliding_window, first)
    if not plan.per_seq and prompt_out is None:  # a pure decode step: one call, rows in order
        return decode_attention(q, kv_cache, plan.decode_slots, plan.decode_offsets, scale)
    out = torch.empty_like(q)
    if prompt_out is not None:
        out[:first] = prompt_out
    if plan.decode_rows.numel():
        # All decodes in one call: per-request results, without a Python loop per request.
        out[plan.decode_rows] = decode_attention(
            q[plan.decode_rows], kv_cache, plan.decode_slots, plan.decode_offsets, scale
        )
    for span, slots, mask in plan.per_seq:
        rows = slice(span.q_start, span.q_start + span.q_len)
        keys, values = gather_kv(kv_cache, slots, q.dtype)
        # SDPA wants [B, H, L, D]; enable_gqa broadcasts the KV heads over query heads.
        o = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1).unsqueeze(0),
            keys.unsqueeze(0),
            values.unsqueeze(0),
            attn_mask=mask,
            scale=scale,
            enable_gqa=gqa,
        )
        out[rows] = o[0].transpose(0, 1)
    return out
