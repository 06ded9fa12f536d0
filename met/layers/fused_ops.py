"""Fused element-wise ops of a decoder layer on CPU (csrc/fused_ops.cpp), bfloat16 or float32.

At decode batch sizes a layer's RMSNorms, rope, SiLU · up and KV-cache writes are dozens of
tiny ATen calls whose Python dispatch costs more than their arithmetic; at large batches they
are as many passes over the activations. These ops do each chain in one call:

- ``rms_norm(x, w, eps)`` and ``add_rms_norm(x, delta, w, eps) -> (x + delta, norm)``;
- ``silu_mul(gate_up)``: SiLU of the first half times the second half;
- ``argmax(logits)``: each float32 row's argmax, as torch.argmax(dim=-1) gives it (the
  greedy pick; torch's CPU argmax reads [64, 49152] logits ~8x slower);
- ``top_p_threshold(probs, top_p)``: per float32 row the smallest probability nucleus
  sampling keeps (a weighted quickselect, O(V): a sort or a widening torch.topk costs ~2 ms
  a row on a 49k vocabulary when the nucleus is wide), and ``top_p_cut_(probs, top_p)``,
  which also zeroes the values below it in place;
- ``rope_qkv_to_cache(qkv, positions, cos, sin, kv, slots, H, Hkv) -> q``: rope on the q
  and k heads of the fused projection, rotated keys and the values written to their cache
  slots (an int8 `KVCache` gets each row quantized as `kv_cache.quantize_rows` does it, bit
  for bit), rotated queries returned [T, H, D].

They round like the ATen chains they replace (rope, SiLU · up and the residual add bit for
bit in bfloat16; RMSNorm within one ulp; in float32 SiLU's exp is a polynomial within ~1 ulp)
and compute each row alone, so results do not depend on the batch. ``available(x)`` says
whether they apply: CPU, bfloat16, kernels built. Float32 activations take them only when
the caller allows it: a quantized model's (w4a8 on a CPU without native bfloat16); the
unquantized float32 path, the exact reference, never does.
"""

from __future__ import annotations

import functools

import torch

from met.layers.kv_cache import KVCache
from met.layers.native import load_native_ops, native_op

NAME = "met_fused_ops_v14"


def _ops():
    return load_native_ops(NAME, "fused_ops.cpp")


def available(x: torch.Tensor, allow_float32: bool = False) -> bool:
    """True when the fused ops can run on activations like ``x``: bfloat16, or float32 with
    ``allow_float32`` (compiles on first call)."""
    dtypes = (torch.bfloat16, torch.float32) if allow_float32 else (torch.bfloat16,)
    return x.device.type == "cpu" and x.dtype in dtypes and _ops() is not None


@functools.cache
def _op(name: str):
    """The op (cached: ~150 calls a decode step)."""
    return native_op(NAME, "fused_ops.cpp", name)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _op("rms_norm")(x, weight, eps)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    return _op("add_rms_norm")(x, delta, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    return _op("silu_mul")(gate_up)


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


def rope_qkv_to_cache(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, kv: KVCache, slots: torch.Tensor, num_heads: int,
                      num_kv_heads: int) -> torch.Tensor:
    return _op("rope_qkv_to_cache")(qkv, positions, cos, sin, kv.k, kv.v, slots, num_heads,
                                    num_kv_heads, kv.k_scale, kv.v_scale)
