"""Qwen3-Next: gated delta-net layers (linear attention on state slots) interleaved with
gated attention layers (q/k RMSNorm with a 1 + w scale, partial rope, a sigmoid output
gate from a doubled q projection), each followed by an MLP.

Like Bamba, attention layers keep paged KV (``kv_layout`` counts only them) and delta-net
layers keep conv and delta-rule state in state rows (``state_layout``). Only dense MLP
layers are implemented (``mlp_only_layers`` covering every layer): the sparse MoE block
with its gated shared expert is refused by name.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from met.layers.attention import KVCache, paged_attention
from met.layers.batch import ForwardBatch
from met.layers.gated_delta import GatedDeltaNet
from met.layers.linear import Embedding, Linear
from met.layers.norms import RMSNorm
from met.layers.partial_rotary import PartialRotary, make_rotary
from met.layers.rotary import rope_parameters
from met.models.base import config_head_dim
from met.models.hybrid import HybridCausalLM
from met.models.llama import MLP


class GatedAttention(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype, rotary: PartialRotary):
        super().__init__()
        hidden, bias = config.hidden_size, bool(config.attention_bias)
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config_head_dim(config)
        d = self.head_dim
        self.q_proj = Linear(hidden, 2 * self.num_heads * d, bias, dtype)  # q | gate per head
        self.k_proj = Linear(hidden, self.num_kv_heads * d, bias, dtype)
        self.v_proj = Linear(hidden, self.num_kv_heads * d, bias, dtype)
        self.o_proj = Linear(self.num_heads * d, hidden, bias, dtype)
        self.q_norm = RMSNorm(d, config.rms_norm_eps, dtype, offset=True)
        self.k_norm = RMSNorm(d, config.rms_norm_eps, dtype, offset=True)
        self.rotary = rotary
        self.scale = d**-0.5

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        q, gate = self.q_proj(x).view(t, self.num_heads, 2 * d).chunk(2, dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(self.k_proj(x).view(t, self.num_kv_heads, d))
        v = self.v_proj(x).view(t, self.num_kv_heads, d)
        q, k = self.rotary(batch.positions, q, k, batch.memo, self.rotary.seq_lens(batch))
        o = paged_attention(q.contiguous(), k.contiguous(), v, kv_cache, batch, self.scale, None)
        return self.o_proj(o.reshape(t, -1) * torch.sigmoid(gate.reshape(t, -1)))


def _check_dense(config: Any, idx: int) -> None:
    experts = getattr(config, "num_experts", 0) or 0
    step = getattr(config, "decoder_sparse_step", 1) or 1
    dense = idx in (getattr(config, "mlp_only_layers", None) or [])
    if experts > 0 and not dense and (idx + 1) % step == 0:
        raise ValueError(f"num_experts: layer {idx} of this Qwen3-Next config is a sparse MoE "
                         "block (with a gated shared expert), which met does not run yet; "
                         "only dense layers (mlp_only_layers) are supported")


class NextLayer(nn.Module):
    def __init__(self, config: Any, idx: int, dtype: torch.dtype, rotary: PartialRotary):
        super().__init__()
        _check_dense(config, idx)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.is_attention = config.layer_types[idx] == "full_attention"
        if self.is_attention:
            self.self_attn = GatedAttention(config, dtype, rotary)
        else:
            self.linear_attn = GatedDeltaNet(config, dtype)
        self.mlp = MLP(hidden, config.intermediate_size, config.hidden_act, False, dtype)
        self.input_layernorm = RMSNorm(hidden, eps, dtype, offset=True)
        self.post_attention_layernorm = RMSNorm(hidden, eps, dtype, offset=True)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: Any) -> torch.Tensor:
        mixer = self.self_attn if self.is_attention else self.linear_attn
        x = x + mixer(self.input_layernorm(x), batch, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Backbone(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype, max_positions: int):
        super().__init__()
        head_dim = config_head_dim(config)
        params = rope_parameters(config)
        rotary = make_rotary(config, head_dim, max_positions, params)
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype)
        self.layers = nn.ModuleList(NextLayer(config, i, dtype, rotary)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, offset=True)


class Qwen3NextForCausalLM(HybridCausalLM):
    """Qwen3-Next decoder: delta-net layers on state slots, gated attention on paged KV."""

    family = "Qwen3-Next"

    def __init__(self, config: Any, dtype: torch.dtype, max_positions: int):
        super().__init__()
        self.model = _Backbone(config, dtype, max_positions)
        mixers = [layer.linear_attn for layer in self.model.layers if not layer.is_attention]
        self.init_hybrid(config, dtype, mixers, "layer_types")
