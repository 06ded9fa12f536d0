"""OLMo-2 (Olmo2ForCausalLM): the Llama decoder in post-norm layout (each block's output
is normalised before the residual add; no input norms) with q/k RMSNorm over the whole
projected width (all heads together), applied before rope."""

from __future__ import annotations

from typing import Any

import torch

from met.layers.attention import KVCache, paged_attention
from met.layers.batch import ForwardBatch
from met.layers.norms import RMSNorm
from met.models.llama import Attention, DecoderLayer, LlamaForCausalLM, _make_mlp, project_qkv


class Olmo2RMSNorm(RMSNorm):
    """OLMo-2's reference scales by the weight in float32, then casts (Llama's casts first):
    the same in float32, another rounding in bfloat16."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * xf).to(x.dtype)


class Olmo2Attention(Attention):
    """q_norm / k_norm span num_heads·head_dim and num_kv_heads·head_dim channels."""

    def __init__(self, config: Any, dtype: torch.dtype, window: int | None, rotary):
        qkv_bias = bool(getattr(config, "attention_bias", False))
        super().__init__(config, dtype, qkv_bias, False, window, rotary)
        eps = config.rms_norm_eps
        self.q_norm = Olmo2RMSNorm(self.num_heads * self.head_dim, eps, dtype)
        self.k_norm = Olmo2RMSNorm(self.num_kv_heads * self.head_dim, eps, dtype)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = project_qkv(self, x)
        q = self.q_norm(q.reshape(t, -1)).view(t, self.num_heads, self.head_dim)
        k = self.k_norm(k.reshape(t, -1)).view(t, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(batch.positions, q, k, batch.memo, self.rotary.seq_lens(batch))
        o = paged_attention(q, k, v, kv_cache, batch, self.scale, self.sliding_window)
        return self.o_proj(o.reshape(t, -1))


class Olmo2DecoderLayer(DecoderLayer):
    def __init__(self, config: Any, idx: int, dtype: torch.dtype, window: int | None, rotary):
        torch.nn.Module.__init__(self)
        h, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Olmo2Attention(config, dtype, window, rotary)
        self.mlp = _make_mlp(config, idx, dtype)
        self.post_attention_layernorm = Olmo2RMSNorm(h, eps, dtype)
        self.post_feedforward_layernorm = Olmo2RMSNorm(h, eps, dtype)
        self.residual_multiplier = 1.0

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(x, batch, kv_cache))
        return x + self.post_feedforward_layernorm(self.mlp(x))

    def supports_fused(self) -> bool:
        """The fused path is pre-norm only."""
        return False


class Olmo2ForCausalLM(LlamaForCausalLM):
    """OLMo-2 decoder with an LM head (untied in the published checkpoints)."""

    layer_cls = Olmo2DecoderLayer

    def __init__(self, config: Any, dtype: torch.dtype, max_positions: int):
        super().__init__(config, dtype, max_positions)
        self.model.norm = Olmo2RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
