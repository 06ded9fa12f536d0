"""A decoder layer as the fused CPU paths run it: its modules and tensors, looked up once.

A model family builds one `FusedLayer` per decoder layer from its own modules (e.g.
`met.models.llama.DecoderLayer.fused_plan`); its fused Python loop and the native layer
stack (`met.layers.layer_stack`) both run from these.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class FusedLayer:
    """A decoder layer's modules and tensors, looked up once for the fused bfloat16 CPU path
    (a decode step runs ~30 layers × ~10 lookups, each a few hundred ns through nn.Module)."""

    # The Linear modules' forward(x, prompt_rows) (ForwardBatch.prompt_rows).
    qkv_proj: Callable[[torch.Tensor, int], torch.Tensor]
    o_proj: Callable[[torch.Tensor, int], torch.Tensor]
    gate_up_proj: Callable[[torch.Tensor, int], torch.Tensor]
    down_proj: Callable[[torch.Tensor, int], torch.Tensor]
    splits_prompt_rows: bool  # every projection has a prompt-rows kernel
    cos: torch.Tensor  # the rotary tables, float32
    sin: torch.Tensor
    num_heads: int
    num_kv_heads: int
    scale: float
    window: int | None
    post_norm: torch.Tensor  # post-attention RMSNorm weight and eps
    post_eps: float
    next_norm: torch.Tensor  # the next layer's input norm (the final norm after the last)
    next_eps: float
