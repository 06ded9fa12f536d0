"""Checkpoints saved quantized (``quantization_config`` in config.json): what met reads.

MXFP4 (gpt-oss's expert weights, as OpenAI ships them) is dequantized at load into the
float layout of the same tensor, so the model loads it as it loads a bfloat16 checkpoint
(the weights then take bfloat16's memory, not MXFP4's). Any other method is refused by name
before a weight is read, instead of failing later on tensor names the model does not know.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch

log = logging.getLogger(__name__)

SUPPORTED_METHODS = ("mxfp4",)

# The 16 values of an FP4 (E2M1) code, indexed by the 4-bit code.
_FP4 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
        -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def quant_method(config: Any) -> str | None:
    qc = getattr(config, "quantization_config", None)
    if not qc:
        return None
    method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
    return str(method) if method is not None else None


def dequantized_weights(weights: Iterator[tuple[str, torch.Tensor]], config: Any
                        ) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` with any quantized tensors of the config's method replaced by floats; a
    ValueError naming quantization_config.quant_method when met cannot read it."""
    method = quant_method(config)
    if method is not None and method not in SUPPORTED_METHODS:
        raise ValueError(f"quantization_config.quant_method: {method!r} checkpoints are not "
                         f"supported; supported: {', '.join(SUPPORTED_METHODS)} (dequantized "
                         "at load), or a float checkpoint with met's own --quantization")
    if method == "mxfp4":
        log.info("MXFP4 weights: dequantized to bfloat16 at load")
        return _mxfp4_weights(weights)
    return weights


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 → bfloat16 (exact: every FP4 value times a power of two is a bfloat16).
    ``blocks`` uint8 [..., G, 16] (two codes a byte, the low nibble first), ``scales`` uint8
    [..., G] (a biased power-of-two exponent per 32 values); returns [..., G * 32]."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales "
                         f"{tuple(scales.shape)}")
    lut = torch.tensor(_FP4, dtype=torch.float32)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).long()  # [..., G, 16, 2]
    values = lut[codes].flatten(-2)  # [..., G, 32]
    values = torch.ldexp(values, scales.to(torch.int32).unsqueeze(-1) - 127)
    return values.flatten(-2).to(torch.bfloat16)


def _mxfp4_weights(weights: Iterator[tuple[str, torch.Tensor]]
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """Pairs ``X_blocks`` + ``X_scales`` (stored [E, out, in/32, ...]) become ``X`` in the
    float checkpoint's layout [E, in, out]; every other tensor passes through."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        base, sep, part = name.rpartition("_")
        if not sep or part not in ("blocks", "scales"):
            yield name, tensor
            continue
        pair = pending.setdefault(base, {})
        pair[part] = tensor
        if len(pair) == 2:
            del pending[base]
            yield base, dequantize_mxfp4(pair["blocks"], pair["scales"]).transpose(-1, -2)
    if pending:
        raise ValueError(f"checkpoint has MXFP4 tensors without their pair: "
                         f"{', '.join(sorted(pending))}")
