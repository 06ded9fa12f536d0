"""RMSNorm variants, computed in float32 as the reference implementations do."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """Llama-style RMSNorm: normalise in float32, cast back, then scale by weight.

    With ``offset=True`` (Gemma) the scale is ``1 + weight`` and is applied in float32
    before the cast, matching Gemma's reference.
    """

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, offset: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype), False)
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        in_dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (xf * (1.0 + self.weight.float())).to(in_dtype)
        return self.weight * xf.to(in_dtype)
