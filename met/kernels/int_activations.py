"""What the layers with int8 activations (w8a8, w4a8) share: the shape handling around a
kernel that takes contiguous 2-D bfloat16 rows (and, where ``takes_float32``, float32 rows)
and returns bfloat16 or float32."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch
from torch import nn


class IntActivationLinear(nn.Module, ABC):
    """``forward(x)`` = x Wᵀ (+ bias) in bfloat16, ``float_product(x)`` the same in float32
    (the LM head's logits); subclasses set ``out_features`` and implement ``_product``."""

    out_features: int
    # The kernel quantizes float32 rows itself (w4a8): a float32 model's activations go in
    # as they are and come out float32, instead of through bfloat16.
    takes_float32 = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The decode step's 2-D contiguous bfloat16 rows need no reshape or cast.
        if x.dim() == 2 and x.dtype == torch.bfloat16 and x.is_contiguous():
            return self._product(x, out_float=False)
        # float32 rows the kernel takes come back float32, as the model computes.
        out_float = x.dtype == torch.float32 and self.takes_float32
        y = self._product(self._kernel_rows(x), out_float=out_float)
        return y.reshape(*x.shape[:-1], self.out_features)

    def float_product(self, x: torch.Tensor) -> torch.Tensor:
        """x Wᵀ in float32 [M, N]."""
        return self._product(self._kernel_rows(x), out_float=True)

    def _kernel_rows(self, x: torch.Tensor) -> torch.Tensor:
        """x as contiguous 2-D rows of a dtype the kernel takes: float32 where it takes
        them (``takes_float32``), else bfloat16."""
        keep = x.dtype == torch.float32 and self.takes_float32
        return x.reshape(-1, x.shape[-1]).to(x.dtype if keep else torch.bfloat16).contiguous()

    def bf16_rows(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """`forward` for 2-D contiguous bfloat16 rows, as a function (`Linear.bf16_rows`);
        subclasses bind their kernel call to skip the module lookups."""
        return lambda x: self._product(x, out_float=False)

    def float32_rows(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """`forward` for 2-D contiguous float32 rows where the kernel takes them
        (``takes_float32``; float32 out), as a bound function (`Linear.float32_rows`), else
        None (`forward` then casts)."""
        return None

    @abstractmethod
    def _product(self, x: torch.Tensor, out_float: bool) -> torch.Tensor:
        """x [M, K] contiguous bfloat16 (or float32, where ``takes_float32``) times the
        weights (+ bias)."""

    def pack(self) -> None:
        """Nothing to re-lay out: the kernels' layouts are built at construction (called by
        `Linear.pack` like the other quantized layers)."""
