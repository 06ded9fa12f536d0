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

from met.layers.batch import ForwardBatch
from met.layers.linear import Embedding
from met.layers.mamba import Mamba2Mixer
from met.layers.norms import RMSNorm
from met.layers.partial_rotary import PartialRotary, make_rotary
from met.layers.rotary import rope_parameters
from met.models.base import config_head_dim
from met.models.hybrid import HybridCausalLM
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
        rotary = make_rotary(config, head_dim, max_positions, params)
        types = list(config.layers_block_type)
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype)
        self.layers = nn.ModuleList(HybridLayer(config, t == "full_attention", dtype, rotary)
                                    for t in types)
        self.final_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)


class BambaForCausalLM(HybridCausalLM):
    """Bamba hybrid decoder: mixer layers on state slots, attention layers on paged KV."""

    final_norm_name = "final_layernorm"
    family = "Bamba"

    def __init__(self, config: Any, dtype: torch.dtype, max_positions: int):
        super().__init__()
        self.model = _Backbone(config, dtype, max_positions)
        mixers = [layer.mamba for layer in self.model.layers if not layer.is_attention]
        self.init_hybrid(config, dtype, mixers, "attn_layer_indices")
