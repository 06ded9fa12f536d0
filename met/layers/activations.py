"""Activation functions by their Hugging Face config names."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_tanh": _gelu_tanh,
}


def get_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """Return the activation called ``name`` in a Hugging Face config."""
    try:
        return _ACTIVATIONS[name]
    except KeyError:
        raise ValueError(
            f"hidden_act: unsupported activation {name!r}; supported: {', '.join(_ACTIVATIONS)}"
        ) from None
