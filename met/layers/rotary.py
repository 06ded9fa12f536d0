"""Rotary position embeddings (half-rotation layout, as in Hugging Face checkpoints)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def rope_inv_freq(head_dim: int, params: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin scale for a rope parameter dict.

    Supports rope_type default, linear and llama3; anything else is a clear error.
    """
    base = float(params["rope_theta"])
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / float(params["factor"]), 1.0
    if rope_type == "llama3":
        factor = params["factor"]
        low, high = params["low_freq_factor"], params["high_freq_factor"]
        old_len = params["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    raise ValueError(
        f"rope_type: {rope_type!r} is not supported yet; supported: default, linear, llama3"
    )


class RotaryEmbedding(nn.Module):
    """Applies rope to query/key heads at given absolute positions.

    cos/sin are tabulated once in float32 up to max_positions and cast to the activation
    dtype at use, which reproduces the reference's per-call computation exactly.
    """

    def __init__(self, head_dim: int, max_positions: int, params: dict[str, Any]):
        super().__init__()
        inv_freq, scale = rope_inv_freq(head_dim, params)
        pos = torch.arange(max_positions, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos() * scale, persistent=False)
        self.register_buffer("sin", emb.sin() * scale, persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
        memo: dict | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [T, H, D], k: [T, Hkv, D]
        cos, sin = self.cos_sin(positions, q.dtype, memo)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype, memo: dict | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, 1, D] at ``positions``; ``memo`` (the step's) keeps them for the
        other layers that share this rotary."""
        key = (id(self), dtype)
        if memo is not None and key in memo:
            return memo[key]
        out = (self.cos[positions].to(dtype).unsqueeze(1),
               self.sin[positions].to(dtype).unsqueeze(1))
        if memo is not None:
            memo[key] = out
        return out

    def apply_(self, x: torch.Tensor, positions: torch.Tensor, memo: dict | None = None
               ) -> torch.Tensor:
        """Rope on the heads of one tensor [T, H, D] (e.g. q and k side by side)."""
        cos, sin = self.cos_sin(positions, x.dtype, memo)
        return x * cos + _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_parameters(config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """Read rope settings from a transformers 5 config (rope_parameters) or a 4.x one."""
    params = getattr(config, "rope_parameters", None)
    if params:
        if layer_type is not None and layer_type in params:
            return dict(params[layer_type])
        if "rope_theta" in params:
            return dict(params)
    out: dict[str, Any] = {"rope_theta": getattr(config, "rope_theta", 10000.0)}
    scaling = getattr(config, "rope_scaling", None)
    if scaling:
        out.update(scaling)
    return out
