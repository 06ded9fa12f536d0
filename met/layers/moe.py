"""Top-k routed mixture of experts (Qwen3-MoE style), experts stacked in three tensors."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from met.layers.activations import get_activation
from met.layers.linear import Linear


class SparseMoE(nn.Module):
    """Softmax router → top-k experts per token → weighted sum of the expert MLPs."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int,
                 normalize_top_k: bool, act: str, dtype: torch.dtype):
        super().__init__()
        self.gate = Linear(hidden, num_experts, False, dtype)
        self.experts = _Experts(hidden, intermediate, num_experts, dtype)
        self.top_k = top_k
        self.normalize_top_k = normalize_top_k
        self.act = get_activation(act)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token top-k expert weights (in x's dtype) and expert ids, both [T, k]."""
        router_probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(router_probs, self.top_k, dim=-1)
        if self.normalize_top_k:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        return apply_experts(x, weights, experts, self.experts, self.act)


def apply_experts(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                  stack: _Experts, act) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{experts[t, j]}(x[t]): the routed experts' MLPs (any
    router: softmax top-k, DeepSeek's grouped sigmoid, ...)."""
    out = torch.zeros_like(x)
    # Loop over the experts that got tokens this step; each runs one dense matmul.
    for e in torch.unique(experts).tolist():
        token_idx, slot = torch.where(experts == e)
        h = x[token_idx]
        gate = F.linear(h, stack.gate_proj[e])
        h = act(gate) * F.linear(h, stack.up_proj[e])
        h = F.linear(h, stack.down_proj[e]) * weights[token_idx, slot, None]
        out.index_add_(0, token_idx, h)
    return out


class _Experts(nn.Module):
    def __init__(self, hidden: int, intermediate: int, num_experts: int, dtype: torch.dtype):
        super().__init__()
        shape_in = (num_experts, intermediate, hidden)
        self.gate_proj = nn.Parameter(torch.empty(shape_in, dtype=dtype), False)
        self.up_proj = nn.Parameter(torch.empty(shape_in, dtype=dtype), False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate, dtype=dtype),
                                      False)
