"""Gemma 3 (text) and Gemma 2: interleaved sliding/global attention, (1 + w) RMSNorms around
both blocks, a scaled embedding and query_pre_attn_scalar as the attention scale.

Gemma 3 adds q/k norms and separate rope bases for local and global layers; Gemma 2 instead
tanh-softcaps the attention scores (attn_logit_softcapping, run by the varlen reference or
Triton attention) and the final logits (final_logit_softcapping)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from met.layers.attention import KVCache, paged_attention
from met.layers.batch import ForwardBatch
from met.layers.linear import Embedding, Linear
from met.layers.norms import RMSNorm
from met.layers.rotary import RotaryEmbedding, rope_parameters
from met.models.base import CausalLM, config_head_dim
from met.models.llama import MLP, fuse_qkv, layer_sliding_windows, project_qkv


class Gemma3Attention(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype, window: int | None,
                 rotary: RotaryEmbedding):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config_head_dim(config)
        hidden, bias = config.hidden_size, bool(getattr(config, "attention_bias", False))
        self.q_proj = Linear(hidden, self.num_heads * self.head_dim, bias, dtype)
        self.k_proj = Linear(hidden, self.num_kv_heads * self.head_dim, bias, dtype)
        self.v_proj = Linear(hidden, self.num_kv_heads * self.head_dim, bias, dtype)
        self.o_proj = Linear(self.num_heads * self.head_dim, hidden, bias, dtype)
        qk_norm = config.model_type != "gemma2"
        eps = config.rms_norm_eps
        self.q_norm = RMSNorm(self.head_dim, eps, dtype, offset=True) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps, dtype, offset=True) if qk_norm else None
        self.scale = config.query_pre_attn_scalar**-0.5
        self.window = window
        self.rotary = rotary
        softcap = getattr(config, "attn_logit_softcapping", None)
        if softcap is not None and not float(softcap) > 0:
            raise ValueError(f"attn_logit_softcapping: must be > 0 or null, got {softcap!r}")
        self.softcap = float(softcap) if softcap else None

    fuse_projections = fuse_qkv

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = project_qkv(self, x)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(batch.positions, q, k, batch.memo, self.rotary.seq_lens(batch))
        o = paged_attention(q, k, v, kv_cache, batch, self.scale, self.window, self.softcap)
        return self.o_proj(o.reshape(t, -1))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype, window: int | None,
                 rotary: RotaryEmbedding):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Gemma3Attention(config, dtype, window, rotary)
        self.mlp = MLP(h, config.intermediate_size, config.hidden_activation, False, dtype)
        self.input_layernorm = RMSNorm(h, eps, dtype, offset=True)
        self.post_attention_layernorm = RMSNorm(h, eps, dtype, offset=True)
        self.pre_feedforward_layernorm = RMSNorm(h, eps, dtype, offset=True)
        self.post_feedforward_layernorm = RMSNorm(h, eps, dtype, offset=True)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        x = x + self.post_attention_layernorm(
            self.self_attn(self.input_layernorm(x), batch, kv_cache))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class _Gemma3Backbone(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype, max_positions: int):
        super().__init__()
        head_dim = config_head_dim(config)
        rotary_global = RotaryEmbedding(head_dim, max_positions,
                                        rope_parameters(config, "full_attention"))
        rotary_local = RotaryEmbedding(head_dim, max_positions, _local_rope(config))
        windows = layer_sliding_windows(config)
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, dtype, w, rotary_global if w is None else rotary_local)
            for w in windows
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, offset=True)
        # The reference multiplies by sqrt(hidden) rounded to the activation dtype.
        self.register_buffer("embed_scale", torch.tensor(config.hidden_size**0.5, dtype=dtype),
                             persistent=False)


def _local_rope(config: Any) -> dict[str, Any]:
    params = getattr(config, "rope_parameters", None) or {}
    if "sliding_attention" in params:
        return dict(params["sliding_attention"])
    if config.model_type == "gemma2":  # one rope for every layer
        return rope_parameters(config)
    return {"rope_theta": getattr(config, "rope_local_base_freq", 10000.0), "rope_type": "default"}


class Gemma3ForCausalLM(CausalLM):
    """Gemma 3 text / Gemma 2 decoder; the LM head is tied to the embedding."""

    def __init__(self, config: Any, dtype: torch.dtype, max_positions: int):
        super().__init__()
        self.model = _Gemma3Backbone(config, dtype, max_positions)
        self.set_lm_head(config, dtype, tied_default=True)
        softcap = getattr(config, "final_logit_softcapping", None)
        if softcap is not None and not float(softcap) > 0:
            raise ValueError(f"final_logit_softcapping: must be > 0 or null, got {softcap!r}")
        self.final_softcap = float(softcap) if softcap else None
        self.kv_layout = (config.num_hidden_layers, config.num_key_value_heads,
                          config_head_dim(config))

    def forward(self, batch: ForwardBatch, kv_caches: list[KVCache]) -> torch.Tensor:
        x = self.model.embed_tokens(batch.input_ids) * self.model.embed_scale
        for layer, kv in zip(self.model.layers, kv_caches, strict=True):
            x = layer(x, batch, kv)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def map_weight_name(self, name: str) -> str | None:
        # Multimodal Gemma 3 checkpoints nest the text model; take only its weights.
        if name.startswith("model.language_model."):
            return "model." + name[len("model.language_model."):]
        if name.startswith(("model.vision_tower.", "model.multi_modal_projector.")):
            return None
        return name
