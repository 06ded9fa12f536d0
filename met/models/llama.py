"""The Llama family: Llama (incl. Llama-3 rope), Mistral, Qwen2, Qwen3, Qwen3-MoE, Mixtral,
Granite and (through met.models.phi3 and met.models.olmo2) Phi-3 and OLMo-2.

They share one decoder; config flags switch on qkv bias (Qwen2), per-head q/k RMSNorm
(Qwen3), sliding-window layers (Mistral, Mixtral, layer_types), routed experts (Qwen3-MoE,
Mixtral), partial rotary (Phi-3) and Granite's multipliers (embedding, residual, attention
scale, logits).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from met.kernels import fused_ops
from met.kernels.gguf_blocks import Blocks
from met.layers import layer_stack
from met.layers.activations import get_activation
from met.layers.attention import KVCache, attend_cached, paged_attention
from met.layers.batch import ForwardBatch
from met.layers.fused_layer import FusedLayer
from met.layers.linear import Embedding, Linear, fuse_linears
from met.layers.moe import SparseMoE, attach_expert_blocks
from met.layers.norms import RMSNorm
from met.layers.partial_rotary import make_rotary
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
        # Granite's attention_multiplier replaces 1/sqrt(head_dim).
        multiplier = getattr(config, "attention_multiplier", None)
        self.scale = self.head_dim**-0.5 if multiplier is None else float(multiplier)

    fuse_projections = fuse_qkv

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        t = x.shape[0]
        if self.q_norm is None and hasattr(self, "qkv_proj"):
            # q and k side by side in the fused output: one rope over both.
            qkv = self.qkv_proj(x)
            hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
            qk = self.rotary.apply_(qkv[:, :(hq + hkv) * d].view(t, hq + hkv, d),
                                    batch.positions, batch.memo, self.rotary.seq_lens(batch))
            q, k = qk[:, :hq], qk[:, hq:]
            v = qkv[:, (hq + hkv) * d:].view(t, hkv, d)
        else:
            q, k, v = project_qkv(self, x)
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = self.rotary(batch.positions, q, k, batch.memo, self.rotary.seq_lens(batch))
        o = paged_attention(q, k, v, kv_cache, batch, self.scale, self.sliding_window)
        return self.o_proj(o.reshape(t, -1))

    def supports_fused(self) -> bool:
        """Whether the fused path (`LlamaForCausalLM._forward_fused`) applies: fused q|k|v,
        no q/k norm, a full-width rope with tables in float32."""
        return (hasattr(self, "qkv_proj") and self.q_norm is None
                and isinstance(self.rotary, RotaryEmbedding)
                and self.rotary.cos.dtype == torch.float32 and self.head_dim % 2 == 0
                and not self.rotary.length_dependent)


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
        """Whether the fused path applies: fused gate|up with SiLU."""
        return hasattr(self, "gate_up_proj") and self.act is F.silu

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
        # Granite scales each block's output before the residual add.
        self.residual_multiplier = float(getattr(config, "residual_multiplier", None) or 1.0)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        r = self.residual_multiplier
        if r != 1.0:
            x = x + self.self_attn(self.input_layernorm(x), batch, kv_cache) * r
            return x + self.mlp(self.post_attention_layernorm(x)) * r
        x = x + self.self_attn(self.input_layernorm(x), batch, kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))

    def supports_fused(self) -> bool:
        return (isinstance(self.mlp, MLP) and self.mlp.supports_fused()
                and self.self_attn.supports_fused() and self.residual_multiplier == 1.0)

    def fused_plan(self, next_norm: RMSNorm) -> FusedLayer:
        """This layer for `LlamaForCausalLM._forward_fused`, followed by ``next_norm`` (the
        next layer's input norm, or the final norm)."""
        attn, post = self.self_attn, self.post_attention_layernorm
        return FusedLayer(
            qkv_proj=attn.qkv_proj.forward, o_proj=attn.o_proj.forward,
            gate_up_proj=self.mlp.gate_up_proj.forward, down_proj=self.mlp.down_proj.forward,
            splits_prompt_rows=all(proj.prompt_rows_fn is not None for proj in (
                attn.qkv_proj, attn.o_proj, self.mlp.gate_up_proj, self.mlp.down_proj)),
            cos=attn.rotary.cos, sin=attn.rotary.sin, num_heads=attn.num_heads,
            num_kv_heads=attn.num_kv_heads, scale=attn.scale, window=attn.sliding_window,
            post_norm=post.weight, post_eps=post.eps, next_norm=next_norm.weight,
            next_eps=next_norm.eps)


def _make_mlp(config: Any, idx: int, dtype: torch.dtype) -> nn.Module:
    act = config.hidden_act
    # Mixtral's config spells it num_local_experts (transformers maps num_experts onto it).
    num_experts = (getattr(config, "num_experts", None)
                   or getattr(config, "num_local_experts", None) or 0)
    sparse_step = getattr(config, "decoder_sparse_step", 1) or 1
    dense_only = idx in (getattr(config, "mlp_only_layers", None) or [])
    if num_experts > 0 and not dense_only and (idx + 1) % sparse_step == 0:
        return SparseMoE(
            hidden=config.hidden_size,
            # Mixtral's experts are intermediate_size wide and always renormalise the top k.
            intermediate=getattr(config, "moe_intermediate_size", None)
            or config.intermediate_size,
            num_experts=num_experts,
            top_k=config.num_experts_per_tok,
            normalize_top_k=(config.model_type == "mixtral"
                             or bool(getattr(config, "norm_topk_prob", False))),
            act=act,
            dtype=dtype,
        )
    bias = bool(getattr(config, "mlp_bias", False))
    return MLP(config.hidden_size, config.intermediate_size, act, bias, dtype)


class _Backbone(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype, max_positions: int,
                 layer_cls: type[nn.Module]):
        super().__init__()
        head_dim = config_head_dim(config)
        rotary = make_rotary(config, head_dim, max_positions, rope_parameters(config))
        windows = layer_sliding_windows(config)
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype)
        self.layers = nn.ModuleList(
            layer_cls(config, i, dtype, windows[i], rotary)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)


class LlamaForCausalLM(CausalLM):
    """Llama / Mistral / Qwen2 / Qwen3 / Qwen3-MoE / Mixtral / Granite decoder with an LM head."""

    # The decoder layer a subclass family swaps in (OLMo-2's post-norm layer).
    layer_cls: type[nn.Module] = DecoderLayer

    def __init__(self, config: Any, dtype: torch.dtype, max_positions: int):
        super().__init__()
        self.model = _Backbone(config, dtype, max_positions, self.layer_cls)
        # Granite: the embedding is scaled on input, the logits divided on output.
        self.embedding_multiplier = float(getattr(config, "embedding_multiplier", None) or 1.0)
        self.logits_scaling = float(getattr(config, "logits_scaling", None) or 1.0)
        self.set_lm_head(config, dtype)
        self.kv_layout = (config.num_hidden_layers, config.num_key_value_heads,
                          config_head_dim(config))

    def forward(self, batch: ForwardBatch, kv_caches: list[KVCache]) -> torch.Tensor:
        x = self.model.embed_tokens(batch.input_ids)
        if self.embedding_multiplier != 1.0:
            x = x * self.embedding_multiplier
        if (self._fused_layers and fused_ops.available(x, self.fused_float32)
                and kv_caches[0].cpu_writable):
            return self._forward_fused(x, batch, kv_caches)
        for layer, kv in zip(self.model.layers, kv_caches, strict=True):
            x = layer(x, batch, kv)
        return self.model.norm(x)

    def _forward_fused(self, x: torch.Tensor, batch: ForwardBatch, kv_caches: list[KVCache]
                       ) -> torch.Tensor:
        """The bfloat16 (or quantized float32) CPU path: `DecoderLayer.forward` with rope +
        cache writes, SiLU · up and each residual add + RMSNorm as fused ops."""
        stack = self._layer_stack
        normed = None if stack is None else stack.run(x, batch, kv_caches)
        if normed is not None:
            return normed
        first = self.model.layers[0].input_layernorm
        normed = fused_ops.rms_norm(x, first.weight, first.eps)
        positions, slots, t = batch.positions, batch.slot_mapping, x.shape[0]
        p = batch.prompt_rows
        for layer, kv in zip(self._fused_layers, kv_caches, strict=True):
            q = fused_ops.rope_qkv_to_cache(layer.qkv_proj(normed, p), positions, layer.cos,
                                            layer.sin, kv, slots, layer.num_heads,
                                            layer.num_kv_heads)
            o = attend_cached(q, kv, batch, layer.scale, layer.window)
            x, normed = fused_ops.add_rms_norm(x, layer.o_proj(o.view(t, -1), p),
                                               layer.post_norm, layer.post_eps)
            mlp = layer.down_proj(fused_ops.silu_mul(layer.gate_up_proj(normed, p)), p)
            x, normed = fused_ops.add_rms_norm(x, mlp, layer.next_norm, layer.next_eps)
        return normed

    @functools.cached_property
    def _fused_layers(self) -> list[FusedLayer]:
        """Every layer's `FusedLayer`, or [] where a layer cannot run fused (decided once,
        after `prepare` fused and packed the projections)."""
        layers, norm = self.model.layers, self.model.norm
        if norm.offset or not all(layer.supports_fused() for layer in layers):
            return []
        next_norms = [layer.input_layernorm for layer in layers[1:]] + [norm]
        return [layer.fused_plan(nxt) for layer, nxt in zip(layers, next_norms, strict=True)]

    @functools.cached_property
    def _layer_stack(self) -> layer_stack.LayerStack | None:
        """The fused layers as one native call (met.layers.layer_stack), where it applies."""
        if not self._fused_layers:
            return None
        layers = self.model.layers
        projections = [(layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                        layer.mlp.gate_up_proj, layer.mlp.down_proj) for layer in layers]
        first = layers[0].input_layernorm
        return layer_stack.build(self._fused_layers, projections, first.weight, first.eps)

    @property
    def prompt_rows_first(self) -> bool:
        layers = self._fused_layers
        return (bool(layers) and all(layer.splits_prompt_rows for layer in layers)
                and fused_ops.available(self.model.embed_tokens.weight))

    def _apply(self, fn, recurse=True):  # .to() and friends replace the tensors bound above
        self.__dict__.pop("_fused_layers", None)
        self.__dict__.pop("_layer_stack", None)
        return super()._apply(fn, recurse)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        if self.logits_scaling != 1.0:
            logits = logits / self.logits_scaling
        return logits

    def map_weight_name(self, name: str) -> str | None:
        return mixtral_weight_name(name)

    def load_special_weight(self, name, tensor, params):
        return load_expert_weight(name, tensor, params)


# Mixtral checkpoints on the Hub: block_sparse_moe.{gate, experts.E.w1 | w2 | w3}.
_MIXTRAL_EXPERT_PROJ = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}


def mixtral_weight_name(name: str) -> str:
    """A Mixtral Hub tensor name in the names this family's modules use (others unchanged)."""
    if ".block_sparse_moe." not in name:
        return name
    name = name.replace(".block_sparse_moe.", ".mlp.")
    prefix, sep, rest = name.partition(".mlp.experts.")
    parts = rest.split(".")
    if sep and len(parts) == 3 and parts[1] in _MIXTRAL_EXPERT_PROJ:
        return f"{prefix}.mlp.experts.{parts[0]}.{_MIXTRAL_EXPERT_PROJ[parts[1]]}.{parts[2]}"
    return name


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
        if isinstance(tensor, Blocks):  # a GGUF expert kept quantized
            attach_expert_blocks(params[target], e, tensor, name)
        else:
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
