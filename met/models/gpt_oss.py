"""gpt-oss: attention with per-head sinks and biases, alternating sliding/full layers, and a
top-k-then-softmax routed MoE whose experts have biases and a clamped SwiGLU."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from met.layers.attention import KVCache, paged_attention
from met.layers.batch import ForwardBatch
from met.layers.linear import Embedding, Linear
from met.layers.moe import TopKSoftmaxMoE
from met.layers.norms import RMSNorm
from met.layers.rotary import RotaryEmbedding, rope_parameters
from met.models.base import CausalLM, config_head_dim
from met.models.llama import fuse_qkv, layer_sliding_windows, project_qkv


class GptOssAttention(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype, window: int | None,
                 rotary: RotaryEmbedding):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config_head_dim(config)
        hidden, bias = config.hidden_size, bool(getattr(config, "attention_bias", True))
        self.q_proj = Linear(hidden, self.num_heads * self.head_dim, bias, dtype)
        self.k_proj = Linear(hidden, self.num_kv_heads * self.head_dim, bias, dtype)
        self.v_proj = Linear(hidden, self.num_kv_heads * self.head_dim, bias, dtype)
        self.o_proj = Linear(self.num_heads * self.head_dim, hidden, bias, dtype)
        self.sinks = nn.Parameter(torch.empty(self.num_heads, dtype=dtype), False)
        self.scale = self.head_dim**-0.5
        self.window = window
        self.rotary = rotary

    fuse_projections = fuse_qkv

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = project_qkv(self, x)
        q, k = self.rotary(batch.positions, q, k, batch.memo, self.rotary.seq_lens(batch))
        o = paged_attention(q, k, v, kv_cache, batch, self.scale, self.window, sinks=self.sinks)
        return self.o_proj(o.reshape(t, -1))


class GptOssDecoderLayer(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype, window: int | None,
                 rotary: RotaryEmbedding):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = GptOssAttention(config, dtype, window, rotary)
        self.mlp = TopKSoftmaxMoE(
            hidden=h, intermediate=config.intermediate_size,
            num_experts=config.num_local_experts, top_k=config.num_experts_per_tok,
            dtype=dtype, alpha=float(config.swiglu_alpha), limit=float(config.swiglu_limit))
        self.input_layernorm = RMSNorm(h, eps, dtype)
        self.post_attention_layernorm = RMSNorm(h, eps, dtype)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), batch, kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class _GptOssBackbone(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype, max_positions: int):
        super().__init__()
        rotary = RotaryEmbedding(config_head_dim(config), max_positions, rope_parameters(config))
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype)
        self.layers = nn.ModuleList(
            GptOssDecoderLayer(config, dtype, w, rotary) for w in layer_sliding_windows(config))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)


class GptOssForCausalLM(CausalLM):
    """gpt-oss decoder with an untied LM head (float experts; see `load_special_weight`)."""

    def __init__(self, config: Any, dtype: torch.dtype, max_positions: int):
        super().__init__()
        self.model = _GptOssBackbone(config, dtype, max_positions)
        self.set_lm_head(config, dtype)
        self.kv_layout = (config.num_hidden_layers, config.num_key_value_heads,
                          config_head_dim(config))

    def load_special_weight(self, name, tensor, params):
        return load_gpt_oss_expert_weight(name, tensor, params)


def load_gpt_oss_expert_weight(name: str, tensor: torch.Tensor, params: dict) -> list[str]:
    """gpt-oss's expert tensors into the stacked [E, out, in] parameters.

    The checkpoint stores them transposed ([E, in, out]) with gate and up interleaved along
    the output (gate = columns 0, 2, 4, ..., up = 1, 3, 5, ...), biases [E, out] alike."""
    if ".mlp.experts." not in name:
        return []
    base, _, part = name.rpartition(".")
    if part.endswith(("_blocks", "_scales")):
        raise ValueError(
            f"checkpoint tensor {name!r}: MXFP4 experts without a quantization_config "
            "(quant_method mxfp4) in config.json, which says to dequantize them")
    if part == "gate_up_proj":
        fills = [("gate_proj", tensor[:, :, 0::2].transpose(1, 2)),
                 ("up_proj", tensor[:, :, 1::2].transpose(1, 2))]
    elif part == "gate_up_proj_bias":
        fills = [("gate_bias", tensor[:, 0::2]), ("up_bias", tensor[:, 1::2])]
    elif part == "down_proj":
        fills = [("down_proj", tensor.transpose(1, 2))]
    elif part == "down_proj_bias":
        fills = [("down_bias", tensor)]
    else:
        return []
    filled = []
    for target, value in fills:
        param = params[f"{base}.{target}"]
        if tuple(param.shape) != tuple(value.shape):
            raise ValueError(f"checkpoint tensor {name!r} gives {target} the shape "
                             f"{tuple(value.shape)}, the model expects {tuple(param.shape)}")
        param.data.copy_(value)
        filled.append(f"{base}.{target}")
    return filled
