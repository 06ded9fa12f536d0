"""Rope on the first ``rotary_dim`` channels of each head only (Phi-3/Phi-4-mini's
``partial_rotary_factor``); the rest of the head passes through unrotated."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from met.layers.rotary import RotaryEmbedding


class PartialRotary(nn.Module):
    """The `RotaryEmbedding` interface (forward, apply_) over a head's leading channels.

    The frequencies are those of a ``rotary_dim``-wide rope, as the reference computes them
    (``base ** (2i / rotary_dim)``), so this is a `RotaryEmbedding(rotary_dim)` applied to a
    slice."""

    def __init__(self, head_dim: int, rotary_dim: int, max_positions: int,
                 params: dict[str, Any]):
        super().__init__()
        if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
            raise ValueError(f"partial_rotary_factor: gives {rotary_dim} rotary channels of a "
                             f"{head_dim}-wide head; must be even and in (0, {head_dim}]")
        self.rotary_dim = rotary_dim
        self.inner = RotaryEmbedding(rotary_dim, max_positions, params)

    @property
    def length_dependent(self) -> bool:
        return self.inner.length_dependent

    def prefix_key(self, prompt_len: int) -> int:
        return self.inner.prefix_key(prompt_len)

    def seq_lens(self, batch: Any) -> torch.Tensor | None:
        return self.inner.seq_lens(batch)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                memo: dict | None = None, seq_lens: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        return (self.apply_(q, positions, memo, seq_lens),
                self.apply_(k, positions, memo, seq_lens))

    def apply_(self, x: torch.Tensor, positions: torch.Tensor, memo: dict | None = None,
               seq_lens: torch.Tensor | None = None) -> torch.Tensor:
        r = self.rotary_dim
        rot = self.inner.apply_(x[..., :r], positions, memo, seq_lens)
        return torch.cat([rot, x[..., r:]], dim=-1)


def make_rotary(config: Any, head_dim: int, max_positions: int, params: dict[str, Any]
                ) -> nn.Module:
    """A full `RotaryEmbedding`, or a `PartialRotary` where the config's
    ``partial_rotary_factor`` (in rope_parameters, or top level in older configs) is < 1."""
    factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    factor = 1.0 if factor is None else float(factor)
    if not 0.0 < factor <= 1.0:
        raise ValueError(f"partial_rotary_factor: must be in (0, 1], got {factor}")
    rotary_dim = int(head_dim * factor)
    if rotary_dim == head_dim:
        return RotaryEmbedding(head_dim, max_positions, params)
    return PartialRotary(head_dim, rotary_dim, max_positions, params)
