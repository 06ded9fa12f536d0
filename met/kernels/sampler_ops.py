"""Sampler ops over float32 logits on CPU (csrc/sampler_ops.cpp).

- ``argmax(logits)``: each float32 row's argmax, as torch.argmax(dim=-1) gives it (the
  greedy pick; torch's CPU argmax reads [64, 49152] logits ~8x slower);
- ``top_p_threshold(probs, top_p)``: per float32 row the smallest probability nucleus
  sampling keeps (a weighted quickselect, O(V): a sort or a widening torch.topk is far
  slower on a 49k vocabulary when the nucleus is wide), and ``top_p_cut_(probs, top_p)``,
  which also zeroes the values below it in place.

Each row is computed alone, so results do not depend on the batch. Where the kernels do not
run (another device or dtype, no compiler) the functions fall back or return None.
"""

from __future__ import annotations

import functools

import torch

from met.kernels.native import native_op

_KEY = "sampler_ops"


@functools.cache
def _op(name: str):
    """The op (cached: it is looked up every step)."""
    return native_op(_KEY, name)


def _top_p_op(name: str, probs: torch.Tensor):
    """The native top-p op `name` for float32 CPU rows [T, V > 0], or None."""
    native = (probs.device.type == "cpu" and probs.dtype == torch.float32 and probs.dim() == 2
              and probs.shape[1] > 0)
    return _op(name) if native else None


def top_p_threshold(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor | None:
    """Per row of float32 CPU ``probs`` [T, V], the smallest probability top-p sampling
    keeps: min{v : mass of the tokens above v < top_p} (``top_p`` float64 [T]); None where
    the kernels do not run (another device or dtype, no compiler)."""
    op = _top_p_op("top_p_threshold", probs)
    return None if op is None else op(probs.contiguous(), top_p.to(torch.float64).contiguous())


def top_p_cut_(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor | None:
    """Top-p's cut in place: each row's probabilities below its `top_p_threshold` set to 0
    (the thresholds returned); None, ``probs`` untouched, where the kernels do not run (also
    for a non-contiguous ``probs``, which the op cannot edit in place)."""
    op = _top_p_op("top_p_cut_", probs) if probs.is_contiguous() else None
    return None if op is None else op(probs, top_p.to(torch.float64).contiguous())


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(logits, dim=-1) for float32 [T, V] CPU logits, natively when the
    kernels are built (first maximum on ties, a NaN counting as the maximum)."""
    native = logits.device.type == "cpu" and logits.dtype == torch.float32
    op = _op("argmax") if native and logits.dim() == 2 and logits.shape[1] > 0 else None
    return logits.argmax(dim=-1) if op is None else op(logits.contiguous())
