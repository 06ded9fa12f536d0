"""What the hybrid families (Bamba, Qwen3-Next) share: layers that are either attention on
the paged KV (``is_attention``) or a state-space mixer on state slots, one KV cache per
attention layer and one state layout for all mixers."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from met.layers.attention import KVCache
from met.layers.batch import ForwardBatch
from met.models.base import CausalLM, config_head_dim


class HybridCausalLM(CausalLM):
    """A subclass builds ``self.model`` (embed_tokens, layers, a final norm named
    ``final_norm_name``) and calls `init_hybrid` with its mixers."""

    final_norm_name = "norm"
    family = "hybrid"

    def init_hybrid(self, config: Any, dtype: torch.dtype, mixers: list[nn.Module],
                    field: str) -> None:
        """The LM head, ``kv_layout`` over the attention layers only and ``state_layout``
        over ``mixers``; ``field``: the config field to name when no layer attends."""
        num_attention = len(self.model.layers) - len(mixers)
        if not num_attention:
            raise ValueError(f"{field}: met runs hybrids with at least one attention layer; "
                             "this config has none")
        self.set_lm_head(config, dtype)
        self.kv_layout = (num_attention, config.num_key_value_heads, config_head_dim(config))
        self.state_layout = mixers[0].layout(len(mixers)) if mixers else None

    def forward(self, batch: ForwardBatch, kv_caches: list[KVCache]) -> torch.Tensor:
        x = self.model.embed_tokens(batch.input_ids)
        kv = iter(kv_caches)
        states = iter(batch.state.caches if batch.state is not None else ())
        for layer in self.model.layers:
            x = layer(x, batch, next(kv) if layer.is_attention else next(states))
        return getattr(self.model, self.final_norm_name)(x)

    def first_layers(self, n: int) -> CausalLM:
        raise ValueError("speculative_config.method: self-speculation cuts the layer stack, "
                         f"which a hybrid state-space model ({self.family}) does not support")
