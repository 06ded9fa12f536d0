"""Routed mixture of experts: routers (softmax top-k, gpt-oss's top-k-then-softmax) and the
experts as one grouped operation over the tokens routed to them.

`apply_experts` sorts the step's (token, slot) pairs by expert, gathers their rows once, runs
each projection as a grouped matmul over all experts (met.kernels.grouped_mm), and
scatter-adds the weighted results back to their tokens. An expert stack says how its
projections run (`ExpertStack.project`: float stacks in one grouped call, GGUF blocks
through the native quantized kernel per expert group) and how gate and up combine
(`combine`: act(gate) * up, or gpt-oss's clamped SwiGLU).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from met.kernels import gguf_blocks
from met.kernels.gguf_blocks import Blocks
from met.kernels.grouped_mm import grouped_mm
from met.layers.activations import get_activation
from met.layers.linear import Linear


class SparseMoE(nn.Module):
    """Softmax router → top-k experts per token → weighted sum of the expert MLPs (Qwen3-MoE,
    Mixtral: ``normalize_top_k`` renormalises the k chosen probabilities)."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int,
                 normalize_top_k: bool, act: str, dtype: torch.dtype):
        super().__init__()
        self.gate = Linear(hidden, num_experts, False, dtype)
        self.experts = ExpertStack(hidden, intermediate, num_experts, dtype)
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
                  stack: ExpertStack, act: Callable[[torch.Tensor], torch.Tensor]
                  ) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{experts[t, j]}(x[t]): the routed experts' MLPs (any
    router: softmax top-k, DeepSeek's grouped sigmoid, ...), x [T, H], weights and experts
    [T, k]. No Python loop over experts or tokens for float stacks."""
    t, k = experts.shape
    flat = experts.reshape(-1)
    # Stable sort: within an expert, rows keep token order (the per-expert loop's order).
    order = torch.argsort(flat, stable=True)
    token = order // k
    offsets = torch.bincount(flat, minlength=stack.num_experts).cumsum(0).to(torch.int32)
    h = x[token]
    h = stack.combine(stack.project("gate", h, offsets), stack.project("up", h, offsets), act)
    h = stack.project("down", h, offsets) * weights.reshape(-1)[order, None]
    return torch.zeros_like(x).index_add_(0, token, h)


class ExpertStack(nn.Module):
    """num_experts SwiGLU MLPs stacked: gate_proj, up_proj [E, I, H], down_proj [E, H, I]
    (the HF nn.Linear layout per expert), optional per-expert biases."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, dtype: torch.dtype,
                 bias: bool = False):
        super().__init__()
        self.num_experts = num_experts
        # GGUF experts kept quantized (``--quantization gguf``): projection name -> one
        # Blocks per expert, set by `keep_blocks`; the float parameter is then an empty view.
        self.blocks: dict[str, list[Blocks]] = {}
        self.native = False
        shape_in = (num_experts, intermediate, hidden)
        self.gate_proj = nn.Parameter(torch.empty(shape_in, dtype=dtype), False)
        self.up_proj = nn.Parameter(torch.empty(shape_in, dtype=dtype), False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate, dtype=dtype),
                                      False)
        if bias:
            self.gate_bias = nn.Parameter(torch.empty(num_experts, intermediate, dtype=dtype),
                                          False)
            self.up_bias = nn.Parameter(torch.empty(num_experts, intermediate, dtype=dtype), False)
            self.down_bias = nn.Parameter(torch.empty(num_experts, hidden, dtype=dtype), False)

    def project(self, name: str, h: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Rows h [N, in] sorted by expert (``offsets``: cumulative row ends per expert)
        through projection ``name`` ("gate", "up", "down") of each row's expert."""
        blocks = self.blocks.get(name)
        if blocks is None:
            y = grouped_mm(h, getattr(self, f"{name}_proj"), offsets)
        else:
            y = _blocks_grouped(h, blocks, offsets, self.native)
        bias = getattr(self, f"{name}_bias", None)
        if bias is not None:
            y = y + expert_rows(bias, offsets, h.shape[0])
        return y

    def combine(self, gate: torch.Tensor, up: torch.Tensor,
                act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        return act(gate) * up

    def keep_blocks(self, kernel: str | None = "auto") -> None:
        """After loading: the projections whose experts came as GGUF blocks
        (`attach_expert_blocks`) run on them, through the native quantized matmul per
        expert group (gguf-py's dequantize where the kernel is not built)."""
        blocks = {}
        for name in ("gate", "up", "down"):
            param = getattr(self, f"{name}_proj")
            experts = getattr(param, "gguf_experts", None)
            if experts is not None:
                missing = [e for e, b in enumerate(experts) if b is None]
                if missing:
                    raise ValueError(f"checkpoint is missing {name}_proj of experts {missing}")
                blocks[name] = experts
                del param.gguf_experts
        self.blocks = blocks
        self.native = gguf_blocks.available() if kernel == "auto" else kernel is not None

    @property
    def segments(self) -> list[Blocks]:
        """Every kept expert's blocks (what `CausalLM.weight_bytes` counts)."""
        return [b for experts in self.blocks.values() for b in experts]


def attach_expert_blocks(param: torch.Tensor, expert: int, blocks: Blocks, name: str) -> None:
    """Make stacked expert parameter ``param`` [E, out, in] hold expert ``expert`` as GGUF
    blocks: on the first one its float data becomes a zero-stride view (no float copy)."""
    if (blocks.rows, blocks.cols) != tuple(param.shape[1:]):
        raise ValueError(f"checkpoint tensor {name!r} has shape {(blocks.rows, blocks.cols)}, "
                         f"the model expects {tuple(param.shape[1:])}")
    experts = getattr(param, "gguf_experts", None)
    if experts is None:
        experts = param.gguf_experts = [None] * param.shape[0]
        param.data = torch.zeros(1, dtype=param.dtype, device=param.device).expand(param.shape)
    experts[expert] = blocks


def _blocks_grouped(h: torch.Tensor, experts: list[Blocks], offsets: torch.Tensor,
                    native: bool) -> torch.Tensor:
    """`grouped_mm` over GGUF blocks: one quantized matmul per expert that has rows (the
    kernel takes one matrix per call)."""
    out_dtype = h.dtype if h.dtype in (torch.float32, torch.bfloat16) else torch.float32
    h = h.to(out_dtype).contiguous()
    y = h.new_empty(h.shape[0], experts[0].rows)
    start = 0
    for e, end in enumerate(offsets.tolist()):
        if end > start:
            y[start:end] = gguf_blocks.linear(h[start:end], [experts[e]], out_dtype, native)
        start = end
    return y


# The stack's name before it became public (callers of apply_experts written against it).
_Experts = ExpertStack


class ClampedSwiGLUExperts(ExpertStack):
    """gpt-oss's experts: biases everywhere and a clamped SwiGLU,
    (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with g = min(gate, limit)."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, dtype: torch.dtype,
                 alpha: float, limit: float):
        super().__init__(hidden, intermediate, num_experts, dtype, bias=True)
        self.alpha, self.limit = alpha, limit

    def combine(self, gate, up, act):
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


def expert_rows(per_expert: torch.Tensor, offsets: torch.Tensor, n: int) -> torch.Tensor:
    """per_expert [E, D] repeated for each expert's rows: [n, D] in the sorted order."""
    ends = offsets.long()
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    return per_expert.repeat_interleave(counts, dim=0, output_size=n)


class TopKSoftmaxMoE(nn.Module):
    """gpt-oss's MoE: router logits with a bias → top-k → softmax over the k chosen logits."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int,
                 dtype: torch.dtype, alpha: float, limit: float):
        super().__init__()
        self.router = Linear(hidden, num_experts, True, dtype)
        self.experts = ClampedSwiGLUExperts(hidden, intermediate, num_experts, dtype, alpha,
                                            limit)
        self.top_k = top_k

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits, experts = torch.topk(self.router(x), self.top_k, dim=-1)
        return F.softmax(logits, dim=-1, dtype=logits.dtype), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        return apply_experts(x, weights, experts, self.experts, F.silu)
