"""Bamba (and Granite-4.0-H-style dense hybrids): Mamba-2 mixer layers interleaved with
attention layers, each followed by a SwiGLU MLP.

Attention layers keep their KV in the paged cache (``kv_layout`` counts only them); mixer
layers keep conv and SSM state in the runner's state rows (``state_layout``), one state slot
per running request (`met.cache.state_slots`). No fused or native layer stack applies: the
plain module path is the only execution plan.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from met.layers.attention import KVCache
from met.layers.batch import ForwardBatch
from met.layers.linear import Embedding, Linear, LMHead
from met.layers.mamba import Mamba2Mixer, MambaLayout
from met.layers.norms import RMSNorm
from met.layers.partial_rotary import PartialRotary
from met.layers.rotary import rope_parameters
from met.models.base import CausalLM, config_head_dim
from met.models.llama import MLP, Attention


class HybridLayer(nn.Module):
    """norm → (Mamba-2 mixer | attention) → residual → norm → MLP → residual."""

    def __init__(self, config: Any, is_attention: bool, dtype: torch.dtype,
                 rotary: PartialRotary):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.is_attention = is_attention
        if is_attention:
            self.self_attn = Attention(config, dtype, bool(config.attention_bias), False, None,
                                       rotary)
        else:
            self.mamba = Mamba2Mixer(config, dtype)
        self.feed_forward = MLP(hidden, config.intermediate_size, config.hidden_act,
                                bool(getattr(config, "mlp_bias", False)), dtype)
        self.input_layernorm = RMSNorm(hidden, eps, dtype)
        self.pre_ff_layernorm = RMSNorm(hidden, eps, dtype)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: Any) -> torch.Tensor:
        mixer = self.self_attn if self.is_attention else self.mamba
        x = x + mixer(self.input_layernorm(x), batch, cache)
        return x + self.feed_forward(self.pre_ff_layernorm(x))


class _Backbone(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype, max_positions: int):
        super().__init__()
        head_dim = config_head_dim(config)
        params = rope_parameters(config)
        factor = float(params.pop("partial_rotary_factor", 1.0))
        rotary = PartialRotary(head_dim, int(head_dim * factor), max_positions, params)
        types = list(config.layers_block_type)
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype)
        self.layers = nn.ModuleList(HybridLayer(config, t == "full_attention", dtype, rotary)
                                    for t in types)
        self.final_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)


class BambaForCausalLM(CausalLM):
    """Bamba hybrid decoder: mixer layers on state slots, attention layers on paged KV."""

    def __init__(self, config: Any, dtype: torch.dtype, max_positions: int):
        super().__init__()
        self.model = _Backbone(config, dtype, max_positions)
        layers = list(self.model.layers)
        attention = [layer for layer in layers if layer.is_attention]
        mixers = [layer.mamba for layer in layers if not layer.is_attention]
        if not attention:
            raise ValueError("attn_layer_indices: met runs hybrids with at least one "
                             "attention layer; this config has none")
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, False, dtype)
        self.kv_layout = (len(attention), config.num_key_value_heads, config_head_dim(config))
        self.state_layout: MambaLayout | None = mixers[0].layout(len(mixers)) if mixers else None

    def forward(self, batch: ForwardBatch, kv_caches: list[KVCache]) -> torch.Tensor:
        x = self.model.embed_tokens(batch.input_ids)
        kv = iter(kv_caches)
        states = iter(batch.state.caches if batch.state is not None else ())
        for layer in self.model.layers:
            x = layer(x, batch, next(kv) if layer.is_attention else next(states))
        return self.model.final_layernorm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if isinstance(self.lm_head, LMHead):
            return self.lm_head(hidden)
        return torch.nn.functional.linear(hidden, self.lm_head.weight).float()

    def first_layers(self, n: int) -> CausalLM:
        raise ValueError("speculative_config.method: self-speculation cuts the layer stack, "
                         "which a hybrid state-space model (Bamba) does not support")
