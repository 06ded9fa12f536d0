"""Paged attention, pure PyTorch: runs on CPU and CUDA and is the reference backend.

Each layer's KV cache is a pair of tensors [num_blocks, block_size, num_kv_heads, head_dim].
New keys/values are scattered into their slots, then every request attends over its own
context only, so a request's result never depends on what else is in the batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from met.layers.batch import ForwardBatch, SeqSpan

KVCache = tuple[torch.Tensor, torch.Tensor]


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: KVCache,
    batch: ForwardBatch,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of q [T, H, D] over each request's cached context; returns [T, H, D]."""
    k_cache, v_cache = kv_cache
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    k_flat.index_copy_(0, batch.slot_mapping, k.to(k_flat.dtype))
    v_flat.index_copy_(0, batch.slot_mapping, v.to(v_flat.dtype))

    out = torch.empty_like(q)
    for span in batch.seqs:
        q_seq = q[span.q_start : span.q_start + span.q_len]
        out[span.q_start : span.q_start + span.q_len] = _attend_one(
            q_seq, k_cache, v_cache, span, batch.block_size, scale, sliding_window
        )
    return out


def _attend_one(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    span: SeqSpan,
    block_size: int,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    first_q_pos = span.ctx_len - span.q_len
    # Keys older than the window of the first query are never attended: skip them.
    k_start = 0 if sliding_window is None else max(0, first_q_pos - sliding_window + 1)
    first_block = k_start // block_size
    blocks = span.block_table[first_block:]
    offset = first_block * block_size
    k = k_cache[blocks].flatten(0, 1)[k_start - offset : span.ctx_len - offset]
    v = v_cache[blocks].flatten(0, 1)[k_start - offset : span.ctx_len - offset]

    mask = None
    if span.q_len > 1 or sliding_window is not None:
        q_pos = torch.arange(first_q_pos, span.ctx_len, device=q.device)[:, None]
        k_pos = torch.arange(k_start, span.ctx_len, device=q.device)[None, :]
        mask = k_pos <= q_pos
        if sliding_window is not None:
            mask &= (q_pos - k_pos) < sliding_window
    # SDPA wants [B, H, L, D]; enable_gqa broadcasts the KV heads over query heads.
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return o.squeeze(0).transpose(0, 1)
