"""DeepSeek-V2 / V3: multi-head latent attention (met.layers.mla) with a compressed latent
KV cache, and a mixture of experts with shared experts and group-limited routing
(met.layers.grouped_topk). The first ``first_k_dense_replace`` layers keep a dense MLP.

Runs on plain PyTorch modules in every dtype: the fused CPU layer paths assume Llama's
attention and are never built for it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from met.layers.activations import get_activation
from met.layers.attention import KVCache
from met.layers.batch import ForwardBatch
from met.layers.grouped_topk import GroupedRouter, GroupedRouting
from met.layers.linear import Embedding
from met.layers.mla import MLAttention
from met.layers.moe import ExpertStack, apply_experts
from met.layers.norms import RMSNorm
from met.layers.rotary import RotaryEmbedding, rope_parameters
from met.models.base import CausalLM
from met.models.llama import MLP, load_expert_weight


def routing_of(config: Any) -> GroupedRouting:
    """The router settings of a V2 or V3 config (V3 has no topk_method: noaux_tc)."""
    v3 = config.model_type == "deepseek_v3"
    method = "noaux_tc" if v3 else (getattr(config, "topk_method", None) or "greedy")
    return GroupedRouting(
        num_experts=config.n_routed_experts,
        top_k=config.num_experts_per_tok,
        method=method,
        n_group=getattr(config, "n_group", None) or 1,
        topk_group=getattr(config, "topk_group", None) or 1,
        # V2's reference never renormalises, whatever its config says.
        norm_topk_prob=v3 and bool(getattr(config, "norm_topk_prob", False)),
        routed_scaling_factor=float(getattr(config, "routed_scaling_factor", 1.0) or 1.0),
    )


class DeepseekMoE(nn.Module):
    """Routed experts (apply_experts) plus always-on shared experts."""

    def __init__(self, config: Any, dtype: torch.dtype):
        super().__init__()
        hidden, inter = config.hidden_size, config.moe_intermediate_size
        routing = routing_of(config)
        self.gate = GroupedRouter(hidden, routing)
        self.experts = ExpertStack(hidden, inter, routing.num_experts, dtype)
        bias = bool(getattr(config, "mlp_bias", False))
        self.shared_experts = (MLP(hidden, inter * config.n_shared_experts, config.hidden_act,
                                   bias, dtype) if config.n_shared_experts else None)
        self.act = get_activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = apply_experts(x, weights.to(x.dtype), ids, self.experts, self.act)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, config: Any, idx: int, dtype: torch.dtype, rotary: RotaryEmbedding):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = MLAttention(config, dtype, rotary)
        if idx >= (config.first_k_dense_replace or 0) and config.n_routed_experts:
            self.mlp = DeepseekMoE(config, dtype)
        else:
            self.mlp = MLP(h, config.intermediate_size, config.hidden_act,
                           bool(getattr(config, "mlp_bias", False)), dtype)
        self.input_layernorm = RMSNorm(h, eps, dtype)
        self.post_attention_layernorm = RMSNorm(h, eps, dtype)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), batch, kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class _DeepseekBackbone(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype, max_positions: int):
        super().__init__()
        rotary = RotaryEmbedding(config.qk_rope_head_dim, max_positions, rope_parameters(config))
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype)
        self.layers = nn.ModuleList(DeepseekDecoderLayer(config, i, dtype, rotary)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)


class DeepseekForCausalLM(CausalLM):
    """DeepSeek-V2 / V3 decoder with an LM head; the KV cache holds one latent row per token
    and layer (``kv_layout`` = (layers, 1, kv_lora_rank + qk_rope_head_dim), no values)."""

    kv_v_head_dim = 0

    def __init__(self, config: Any, dtype: torch.dtype, max_positions: int):
        super().__init__()
        self.num_layers = config.num_hidden_layers
        self.model = _DeepseekBackbone(config, dtype, max_positions)
        self.set_lm_head(config, dtype)
        self.kv_layout = (config.num_hidden_layers, 1,
                          config.kv_lora_rank + config.qk_rope_head_dim)

    def map_weight_name(self, name: str) -> str | None:
        # DeepSeek-V3 checkpoints append their multi-token-prediction layers after the last
        # decoder layer (model.layers.61 for 61 layers); met does not run them.
        if name.startswith("model.layers."):
            idx = name.split(".", 3)[2]
            if idx.isdigit() and int(idx) >= self.num_layers:
                return None
        return name

    def load_special_weight(self, name, tensor, params):
        return load_expert_weight(name, tensor, params)
