"""DeepSeek's routers: expert scores, then top-k restricted to the best expert groups.

The routed experts themselves run through `met.layers.moe.apply_experts`; this module only
decides which experts each token uses and with what weight, in float32 (as the reference
keeps its router in float32 whatever the model's dtype).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

# DeepSeek-V3 (sigmoid scores + correction bias, groups ranked by their two best experts)
# and DeepSeek-V2's topk_method values (softmax scores, groups ranked by their best one).
METHODS = ("noaux_tc", "greedy", "group_limited_greedy")


@dataclass(frozen=True)
class GroupedRouting:
    """How a token's experts are chosen (config fields of the same names)."""

    num_experts: int
    top_k: int
    method: str = "noaux_tc"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"topk_method: must be one of {', '.join(METHODS)}, "
                             f"got {self.method!r}")
        if self.method != "greedy":
            if self.n_group < 1 or self.num_experts % self.n_group:
                raise ValueError(f"n_group: must divide n_routed_experts ({self.num_experts}), "
                                 f"got {self.n_group}")
            if not 1 <= self.topk_group <= self.n_group:
                raise ValueError(f"topk_group: must be in [1, n_group={self.n_group}], "
                                 f"got {self.topk_group}")
            if self.top_k > self.topk_group * self.num_experts // self.n_group:
                raise ValueError(f"num_experts_per_tok: {self.top_k} exceeds the experts of "
                                 f"topk_group={self.topk_group} groups")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok: must be in [1, {self.num_experts}], "
                             f"got {self.top_k}")


class GroupedRouter(nn.Module):
    """The router's weight (and V3's e_score_correction_bias), named as in checkpoints, kept
    in float32."""

    def __init__(self, hidden: int, routing: GroupedRouting):
        super().__init__()
        self.routing = routing
        e = routing.num_experts
        self.weight = nn.Parameter(torch.empty(e, hidden, dtype=torch.float32), False)
        if routing.method == "noaux_tc":
            self.e_score_correction_bias = nn.Parameter(torch.empty(e, dtype=torch.float32),
                                                        False)
        else:
            self.e_score_correction_bias = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token expert weights (float32) and expert ids, both [T, top_k]."""
        logits = F.linear(x.float(), self.weight.float())
        return route(logits, self.routing, self.e_score_correction_bias)


def route(logits: torch.Tensor, r: GroupedRouting, bias: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 router logits [T, E] → (weights, expert ids) [T, top_k].

    noaux_tc: scores = sigmoid(logits); the bias only steers the choice (groups by the sum
    of their two best biased scores, then the top-k biased scores inside the kept groups),
    the weights are the unbiased scores. greedy / group_limited_greedy: softmax scores,
    groups ranked by their best score. Then the optional renormalisation and the scaling.
    """
    if r.method == "noaux_tc":
        scores = logits.sigmoid()
        choice = scores + bias
    else:
        scores = logits.softmax(dim=-1, dtype=torch.float32)
        choice = scores
    if r.method != "greedy":
        t = choice.shape[0]
        grouped = choice.view(t, r.n_group, r.num_experts // r.n_group)
        if r.method == "noaux_tc":
            group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1)[0].sum(dim=-1)
        else:
            group_scores = grouped.max(dim=-1).values
        kept = torch.topk(group_scores, r.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
        expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(t, r.num_experts)
        choice = choice.masked_fill(~expert_mask, float("-inf"))
    ids = torch.topk(choice, r.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if r.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * r.routed_scaling_factor, ids
