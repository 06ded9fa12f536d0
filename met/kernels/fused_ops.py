"""Fused element-wise ops of a decoder layer on CPU (csrc/fused_ops.cpp), bf16 or float32.

At decode batch sizes a layer's RMSNorms, rope, SiLU · up and KV-cache writes are dozens of
tiny ATen calls whose Python dispatch costs more than their arithmetic; at large batches they
are as many passes over the activations. These ops do each chain in one call:

- ``rms_norm(x, w, eps)`` and ``add_rms_norm(x, delta, w, eps) -> (x + delta, norm)``;
- ``silu_mul(gate_up)``: SiLU of the first half times the second half;
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

from met.kernels.kv_cache import KVCache
from met.kernels.native import load_native_ops, native_op

_KEY = "fused_ops"


def _ops():
    return load_native_ops(_KEY)


def available(x: torch.Tensor, allow_float32: bool = False) -> bool:
    """True when the fused ops can run on activations like ``x``: bfloat16, or float32 with
    ``allow_float32`` (compiles on first call)."""
    dtypes = (torch.bfloat16, torch.float32) if allow_float32 else (torch.bfloat16,)
    return x.device.type == "cpu" and x.dtype in dtypes and _ops() is not None


@functools.cache
def _op(name: str):
    """The op (cached: ~150 calls a decode step)."""
    return native_op(_KEY, name)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _op("rms_norm")(x, weight, eps)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    return _op("add_rms_norm")(x, delta, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    return _op("silu_mul")(gate_up)


def rope_qkv_to_cache(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, kv: KVCache, slots: torch.Tensor, num_heads: int,
                      num_kv_heads: int) -> torch.Tensor:
    return _op("rope_qkv_to_cache")(qkv, positions, cos, sin, kv.k, kv.v, slots, num_heads,
                                    num_kv_heads, kv.k_scale, kv.v_scale)

