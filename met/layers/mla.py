"""Multi-head latent attention (DeepSeek-V2/V3) over a compressed paged cache.

Per token and layer the cache keeps one row: the normalised KV latent c (kv_lora_rank
values) followed by the shared rope key k_rot (qk_rope_head_dim values), as a single-"head"
key cache with no values (`KVCache` with v of width 0, `kv_cache.write_keys`). Keys and
values of head h are functions of that row: k_h = [W_uk,h c, k_rot], v_h = W_uv,h c, with
kv_b_proj = [W_uk; W_uv] per head.

Two ways to attend, equal in exact arithmetic:

- prompt chunks (several query rows of one request): up-project the context's latents to
  per-head keys and values and run SDPA, as the reference does;
- one-row queries (decodes, and speculative-verify rows): weight absorption. q_h · k_h =
  (W_uk,hᵀ q_nope,h) · c + q_rot,h · k_rot, so each query becomes a row over the latent
  and attends over the cached rows directly; the output head is W_uv,h (Σ p c). No key or
  value is materialised per head, which is the point of the compressed cache.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from met.kernels.kv_cache import KVCache, gather_keys, write_keys
from met.layers.batch import ForwardBatch
from met.layers.linear import Linear
from met.layers.norms import RMSNorm
from met.layers.rotary import RotaryEmbedding

# The reference builds q_a_layernorm and kv_a_layernorm with its RMSNorm's default eps, not
# config.rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def softmax_scale(config: Any) -> float:
    """qk_head_dim ** -0.5, times mscale² for YaRN with mscale_all_dim (DeepSeek folds YaRN's
    magnitude correction into the scores of the non-rope dims too)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling",
                                                                       None) or {})
    if params.get("rope_type", params.get("type", "default")) not in (None, "default"):
        mscale_all_dim = params.get("mscale_all_dim", 0)
        if mscale_all_dim:
            factor = float(params["factor"])
            m = 1.0 if factor <= 1 else 0.1 * mscale_all_dim * math.log(factor) + 1.0
            scale = scale * m * m
    return scale


class _Weight(nn.Module):
    """A plain weight [out, in] under a checkpoint name, never quantized or packed:
    absorption reads its per-head blocks."""

    def __init__(self, out_features: int, in_features: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), False)


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rope on interleaved pairs (x0, x1), (x2, x3), ... of x [T, H, D]; the result lists the
    rotated first members, then the second ones (the reference's layout: keys and queries
    get the same permutation, so their products are unchanged). cos, sin: [T, 1, D], the
    usual cat(freqs, freqs) tables."""
    half = x.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


class MLAttention(nn.Module):
    """DeepSeek's attention block, parameters named as in Hugging Face checkpoints."""

    def __init__(self, config: Any, dtype: torch.dtype, rotary: RotaryEmbedding):
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = h = config.num_attention_heads
        self.q_lora_rank = config.q_lora_rank
        self.kv_lora_rank = r = config.kv_lora_rank
        self.rope_dim = dr = config.qk_rope_head_dim
        self.nope_dim = dn = config.qk_nope_head_dim
        self.v_dim = dv = config.v_head_dim
        for field in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
            if int(getattr(config, field)) < 1:
                raise ValueError(f"{field}: must be positive, got {getattr(config, field)}")
        if dr % 2:
            raise ValueError(f"qk_rope_head_dim: must be even for rope, got {dr}")
        bias = bool(getattr(config, "attention_bias", False))
        if self.q_lora_rank is None:
            self.q_proj = Linear(hidden, h * (dn + dr), False, dtype)
        else:
            self.q_a_proj = Linear(hidden, self.q_lora_rank, bias, dtype)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LATENT_NORM_EPS, dtype)
            self.q_b_proj = Linear(self.q_lora_rank, h * (dn + dr), False, dtype)
        self.kv_a_proj_with_mqa = Linear(hidden, r + dr, bias, dtype)
        self.kv_a_layernorm = RMSNorm(r, LATENT_NORM_EPS, dtype)
        self.kv_b_proj = _Weight(h * (dn + dv), r, dtype)
        self.o_proj = Linear(h * dv, hidden, bias, dtype)
        self.rotary = rotary
        self.scale = softmax_scale(config)
        # DeepSeek checkpoints store the rope dims as interleaved pairs (V2 always; V3 by
        # its rope_interleave flag).
        self.interleave = bool(getattr(config, "rope_interleave", True))

    @property
    def latent_dim(self) -> int:
        """The width of one cached row: kv_lora_rank + qk_rope_head_dim."""
        return self.kv_lora_rank + self.rope_dim

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        t, h = x.shape[0], self.num_heads
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(t, h, self.nope_dim + self.rope_dim)
        q_nope, q_rot = q.split([self.nope_dim, self.rope_dim], dim=-1)
        c, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        c = self.kv_a_layernorm(c)
        k_rot = k_rot.reshape(t, 1, self.rope_dim)
        seq_lens = self.rotary.seq_lens(batch)
        if self.interleave:
            cos, sin = self.rotary.cos_sin(batch.positions, q.dtype, batch.memo, seq_lens)
            q_rot, k_rot = rope_interleaved(q_rot, cos, sin), rope_interleaved(k_rot, cos, sin)
        else:
            q_rot, k_rot = self.rotary(batch.positions, q_rot, k_rot, batch.memo, seq_lens)
        write_keys(kv_cache, batch.slot_mapping, torch.cat([c.unsqueeze(1), k_rot], dim=-1))

        plan = batch.window_plan(None)
        out = x.new_empty(t, h, self.v_dim)
        if plan.decode_rows.numel():
            rows = plan.decode_rows
            out[rows] = self._absorbed(q_nope[rows], q_rot[rows], kv_cache, plan.decode_slots,
                                       plan.decode_offsets)
        for span, slots, mask in plan.per_seq:
            rows = slice(span.q_start, span.q_start + span.q_len)
            out[rows] = self._expanded(q_nope[rows], q_rot[rows], kv_cache, slots, mask)
        return self.o_proj(out.reshape(t, h * self.v_dim))

    def _expanded(self, q_nope: torch.Tensor, q_rot: torch.Tensor, kv_cache: KVCache,
                  slots: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """One request's query rows [n, H, *] over its context's latents, up-projected to
        per-head keys and values; [n, H, v_head_dim]."""
        h, dn, r = self.num_heads, self.nope_dim, self.kv_lora_rank
        latent = gather_keys(kv_cache, slots, q_nope.dtype)[0]  # [L, r + dr]
        length = latent.shape[0]
        kv = F.linear(latent[:, :r], self.kv_b_proj.weight).view(length, h, dn + self.v_dim)
        k_nope, v = kv.split([dn, self.v_dim], dim=-1)
        k = torch.cat([k_nope, latent[:, None, r:].expand(length, h, self.rope_dim)], dim=-1)
        q = torch.cat([q_nope, q_rot], dim=-1)
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0), attn_mask=mask, scale=self.scale)
        return o[0].transpose(0, 1)

    def _absorbed(self, q_nope: torch.Tensor, q_rot: torch.Tensor, kv_cache: KVCache,
                  slots: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """One-row queries [N, H, *], row i over the latents at slots[offsets[i]:
        offsets[i + 1]], attending in the latent space (weight absorption); [N, H, v]."""
        h, dn, r = self.num_heads, self.nope_dim, self.kv_lora_rank
        w = self.kv_b_proj.weight.view(h, dn + self.v_dim, r)
        w_uk, w_uv = w[:, :dn], w[:, dn:]
        q_latent = torch.einsum("nhd,hdr->nhr", q_nope, w_uk)
        query = torch.cat([q_latent, q_rot], dim=-1)  # [N, H, r + dr]
        lengths = offsets[1:] - offsets[:-1]
        width = int(lengths.max())
        steps = torch.arange(width, device=slots.device)
        valid = steps[None, :] < lengths[:, None]  # [N, Lmax]
        index = torch.where(valid, offsets[:-1, None] + steps[None, :], 0)
        rows = gather_keys(kv_cache, slots, query.dtype)[0][index]  # [N, Lmax, r + dr]
        scores = torch.einsum("nhc,nlc->nhl", query, rows) * self.scale
        scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        o_latent = torch.einsum("nhl,nlr->nhr", probs, rows[..., :r])
        return torch.einsum("nhr,hvr->nhv", o_latent, w_uv)
