"""The Llama family: Llama (incl. Llama-3 rope), Mistral, Qwen2, Qwen3 and Qwen3-MoE.

They share one decoder; config flags switch on qkv bias (Qwen2), per-head q/k RMSNorm
(Qwen3), sliding-window layers (Mistral, layer_types) and routed experts (Qwen3-MoE).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from met.layers import fused_ops
from met.layers.activations import get_activation
from met.layers.attention import KVCache, attend_cached, paged_attention
from met.layers.batch import ForwardBatch
from met.layers.linear import Embedding, Linear, LMHead, fuse_linears
from met.layers.moe import SparseMoE
from met.layers.norms import RMSNorm
from met.layers.rotary import RotaryEmbedding, rope_parameters
from met.models.base import CausalLM, config_head_dim


def layer_sliding_windows(config: Any) -> list[int | None]:
    """Per-layer sliding window (None = full attention), from layer_types or a global window."""
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return [window if t == "sliding_attention" else None for t in layer_types]
    if getattr(config, "use_sliding_window", True) is False:
        return [None] * n
    return [window] * n


def fuse_qkv(attn: nn.Module) -> None:
    """Replace q_proj, k_proj, v_proj by one ``qkv_proj`` (one matmul per layer)."""
    attn.qkv_proj = fuse_linears([attn.q_proj, attn.k_proj, attn.v_proj])
    del attn.q_proj, attn.k_proj, attn.v_proj


def project_qkv(attn: nn.Module, x: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [T, H, D], k and v [T, Hkv, D], from the fused projection once it exists."""
    t = x.shape[0]
    hq, hkv, d = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim, attn.head_dim
    if hasattr(attn, "qkv_proj"):
        q, k, v = attn.qkv_proj(x).split([hq, hkv, hkv], dim=-1)
    else:
        q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    return (q.view(t, attn.num_heads, d), k.view(t, attn.num_kv_heads, d),
            v.view(t, attn.num_kv_heads, d))


class Attention(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype, qkv_bias: bool, qk_norm: bool,
                 sliding_window: int | None, rotary: RotaryEmbedding):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config_head_dim(config)
        hidden = config.hidden_size
        self.q_proj = Linear(hidden, self.num_heads * self.head_dim, qkv_bias, dtype)
        self.k_proj = Linear(hidden, self.num_kv_heads * self.head_dim, qkv_bias, dtype)
        self.v_proj = Linear(hidden, self.num_kv_heads * self.head_dim, qkv_bias, dtype)
        o_bias = bool(getattr(config, "attention_bias", False)) and not qkv_bias_only(config)
        self.o_proj = Linear(self.num_heads * self.head_dim, hidden, o_bias, dtype)
        eps = config.rms_norm_eps
        self.q_norm = RMSNorm(self.head_dim, eps, dtype) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps, dtype) if qk_norm else None
        self.sliding_window = sliding_window
        self.rotary = rotary
        self.scale = self.head_dim**-0.5

    fuse_projections = fuse_qkv

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        t = x.shape[0]
        if self.q_norm is None and hasattr(self, "qkv_proj"):
            # q and k side by side in the fused output: one rope over both.
            qkv = self.qkv_proj(x)
            hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
            qk = self.rotary.apply_(qkv[:, :(hq + hkv) * d].view(t, hq + hkv, d),
                                    batch.positions, batch.memo)
            q, k = qk[:, :hq], qk[:, hq:]
            v = qkv[:, (hq + hkv) * d:].view(t, hkv, d)
        else:
            q, k, v = project_qkv(self, x)
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = self.rotary(batch.positions, q, k, batch.memo)
        o = paged_attention(q, k, v, kv_cache, batch, self.scale, self.sliding_window)
        return self.o_proj(o.reshape(t, -1))

    def supports_fused(self) -> bool:
        """Whether `forward_fused` applies: fused q|k|v, no q/k norm, rope tables in float32."""
        return (hasattr(self, "qkv_proj") and self.q_norm is None
                and self.rotary.cos.dtype == torch.float32 and self.head_dim % 2 == 0)

    def forward_fused(self, x: torch.Tensor, batch: ForwardBatch, kv_cache: KVCache
                      ) -> torch.Tensor:
        """`forward` with rope and the cache writes in one native call (bfloat16 on CPU)."""
        k_cache, v_cache = kv_cache
        q = fused_ops.rope_qkv_to_cache(self.qkv_proj(x), batch.positions, self.rotary.cos,
                                        self.rotary.sin, k_cache, v_cache, batch.slot_mapping,
                                        self.num_heads, self.num_kv_heads)
        o = attend_cached(q, kv_cache, batch, self.scale, self.sliding_window)
        return self.o_proj(o.view(x.shape[0], -1))


def qkv_bias_only(config: Any) -> bool:
    """Qwen2 puts biases on q/k/v but not on the output projection."""
    return config.model_type == "qwen2"


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, bias, dtype)
        self.up_proj = Linear(hidden, intermediate, bias, dtype)
        self.down_proj = Linear(intermediate, hidden, bias, dtype)
        self.act = get_activation(act)

    def fuse_projections(self) -> None:
        """Replace gate_proj and up_proj by one ``gate_up_proj`` (one matmul)."""
        self.gate_up_proj = fuse_linears([self.gate_proj, self.up_proj])
        del self.gate_proj, self.up_proj

    def supports_fused(self) -> bool:
        """Whether `forward_fused` applies: fused gate|up with SiLU."""
        return hasattr(self, "gate_up_proj") and self.act is F.silu

    def forward_fused(self, x: torch.Tensor) -> torch.Tensor:
        """`forward` with SiLU(gate) · up in one native call (bfloat16 on CPU)."""
        return self.down_proj(fused_ops.silu_mul(self.gate_up_proj(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "gate_up_proj"):
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(self.act(gate) * up)
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: Any, idx: int, dtype: torch.dtype, window: int | None,
                 rotary: RotaryEmbedding):
        super().__init__()
        qkv_bias = config.model_type == "qwen2" or bool(getattr(config, "attention_bias", False))
        qk_norm = config.model_type in ("qwen3", "qwen3_moe")
        self.self_attn = Attention(config, dtype, qkv_bias, qk_norm, window, rotary)
        self.mlp = _make_mlp(config, idx, dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), batch, kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))

    def supports_fused(self) -> bool:
        return (isinstance(self.mlp, MLP) and self.mlp.supports_fused()
                and self.self_attn.supports_fused())

    def forward_fused(self, x: torch.Tensor, normed: torch.Tensor, batch: ForwardBatch,
                      kv_cache: KVCache, next_norm: RMSNorm
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer on (residual x, its input norm): returns the new residual and its
        ``next_norm`` (the next layer's input norm, or the final norm), each residual add
        done inside a fused RMSNorm."""
        attn = self.self_attn.forward_fused(normed, batch, kv_cache)
        post = self.post_attention_layernorm
        x, normed = fused_ops.add_rms_norm(x, attn, post.weight, post.eps)
        return fused_ops.add_rms_norm(x, self.mlp.forward_fused(normed), next_norm.weight,
                                      next_norm.eps)


def _make_mlp(config: Any, idx: int, dtype: torch.dtype) -> nn.Module:
    act = config.hidden_act
    num_experts = getattr(config, "num_experts", 0) or 0
    sparse_step = getattr(config, "decoder_sparse_step", 1) or 1
    dense_only = idx in (getattr(config, "mlp_only_layers", None) or [])
    if num_experts > 0 and not dense_only and (idx + 1) % sparse_step == 0:
        return SparseMoE(
            hidden=config.hidden_size,
            intermediate=config.moe_intermediate_size,
            num_experts=num_experts,
            top_k=config.num_experts_per_tok,
            normalize_top_k=bool(getattr(config, "norm_topk_prob", False)),
            act=act,
            dtype=dtype,
        )
    bias = bool(getattr(config, "mlp_bias", False))
    return MLP(config.hidden_size, config.intermediate_size, act, bias, dtype)


class _Backbone(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype, max_positions: int):
        super().__init__()
        head_dim = config_head_dim(config)
        rotary = RotaryEmbedding(head_dim, max_positions, rope_parameters(config))
        windows = layer_sliding_windows(config)
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, dtype, windows[i], rotary)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)


class LlamaForCausalLM(CausalLM):
    """Llama / Mistral / Qwen2 / Qwen3 / Qwen3-MoE decoder with an LM head."""

    def __init__(self, config: Any, dtype: torch.dtype, max_positions: int):
        super().__init__()
        self.model = _Backbone(config, dtype, max_positions)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, False, dtype)
        self.kv_layout = (config.num_hidden_layers, config.num_key_value_heads,
                          config_head_dim(config))

    def forward(self, batch: ForwardBatch, kv_caches: list[KVCache]) -> torch.Tensor:
        x = self.model.embed_tokens(batch.input_ids)
        if self._fused_layers and fused_ops.available(x):
            return self._forward_fused(x, batch, kv_caches)
        for layer, kv in zip(self.model.layers, kv_caches, strict=True):
            x = layer(x, batch, kv)
        return self.model.norm(x)

    def _forward_fused(self, x: torch.Tensor, batch: ForwardBatch, kv_caches: list[KVCache]
                       ) -> torch.Tensor:
        """The bfloat16 CPU path: norms, rope + cache writes and SiLU · up as fused ops."""
        layers = self.model.layers
        first = layers[0].input_layernorm
        normed = fused_ops.rms_norm(x, first.weight, first.eps)
        next_norms = [layer.input_layernorm for layer in layers[1:]] + [self.model.norm]
        for layer, kv, next_norm in zip(layers, kv_caches, next_norms, strict=True):
            x, normed = layer.forward_fused(x, normed, batch, kv, next_norm)
        return normed

    @functools.cached_property
    def _fused_layers(self) -> bool:
        """Every layer can run fused (decided once, after `prepare` fused the projections)."""
        norm = self.model.norm
        return (not norm.offset and all(layer.supports_fused() for layer in self.model.layers))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if isinstance(self.lm_head, LMHead):
            return self.lm_head(hidden)
        return torch.nn.functional.linear(hidden, self.lm_head.weight).float()

    def load_special_weight(self, name, tensor, params):
        return load_expert_weight(name, tensor, params)


def load_expert_weight(name: str, tensor: torch.Tensor, params: dict) -> list[str]:
    """Place HF expert tensors (per-expert or fused) into the stacked expert parameters."""
    if ".mlp.experts." not in name:
        return []
    prefix, rest = name.split(".mlp.experts.", 1)
    base = f"{prefix}.mlp.experts"
    parts = rest.split(".")
    if parts[0].isdigit():  # model.layers.N.mlp.experts.E.gate_proj.weight
        e, proj = int(parts[0]), parts[1]
        target = f"{base}.{proj}"
        params[target].data[e].copy_(tensor)
        return [target]
    if parts[0] == "gate_up_proj":  # transformers 5 fused layout [E, 2I, H]
        inter = tensor.shape[1] // 2
        params[f"{base}.gate_proj"].data.copy_(tensor[:, :inter])
        params[f"{base}.up_proj"].data.copy_(tensor[:, inter:])
        return [f"{base}.gate_proj", f"{base}.up_proj"]
    if parts[0] == "down_proj":
        params[f"{base}.down_proj"].data.copy_(tensor)
        return [f"{base}.down_proj"]
    return []
