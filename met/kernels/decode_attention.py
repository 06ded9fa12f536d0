"""Decode attention on CPU: one query token per request, all requests in one native call.

The reference backend (`met.layers.attention.paged_attention`) calls SDPA once per request per
layer, after gathering the request's keys and values out of the paged cache. At decode batch
sizes the per-call overhead of that loop (two ``index_select`` gathers plus SDPA, ~40 µs)
dominates the step. This module does the same maths in one C++ call: it reads keys and values
straight from the cache through each request's slot list (no gather copy) and runs every
(request, kv head) pair as an independent task under ``at::parallel_for``. The engine's
caches (contiguous rows, head_dim a multiple of 32) take a register-blocked path: each key
and value row goes from the cache straight into registers and serves all the query heads of
its group (GQA) at once; other layouts go through a float32 tile. A context longer than 512
keys is split into 512-key chunks that run as separate tasks (so one long request still uses
every thread) and are merged, in chunk order, flash-decoding style.

Batch invariance: a task computes its (request, kv head, chunk) alone, in a fixed order,
with a fixed float32 reduction tree, and the chunks are fixed by the request's own length, so
a request's output never depends on how many requests share the call, where it sits in the
batch, or how the tasks are spread over threads.

Numerics: bf16 inputs are widened exactly to float32 and everything accumulates in float32;
softmax subtracts the row max and uses a Cephes-style exp polynomial (~1 ulp). Against the
per-request SDPA loop in float32 the outputs agree to ~1e-6; bf16 outputs are the float32
result rounded once. Results are bitwise-reproducible on one machine; a CPU with another ISA
level runs another clone of the kernel (AVX-512 / AVX2 / SSE2, picked at load time) and may
differ in the last bits (FMA contraction).

Speed (benchmarks/decode_attention.py, 64 requests x 9/3 heads x 64 dims, 140-204 context,
bf16, L2 flushed): ~0.47 ms per layer on one thread, ~0.25 ms on two (0.63 / 0.35 ms before
the register-blocked path), vs ~2.4 ms for the loop; docs/benchmarks.md has the table. The
~8.4 MB of keys and values come from L3 at ~18 GB/s on one thread, against a measured
single-core L3 read roof of ~25 GB/s (~0.34 ms). Neither vdpbf16ps nor AMX tiles for the
scores made it faster.

int8 caches (met.kernels.kv_cache): rows are widened from int8 in registers; a key's row scale
multiplies its dot product (with the softmax scale) and a value's row scale its weight after
the softmax, so the arithmetic is the float path's on the dequantized rows, in another order.
Only contiguous rows with head_dim % 64 == 0 read int8 (other caches go to the reference).

The kernel is compiled on first use (met.kernels.native) and cached per process. Without a
working compiler the loader logs one warning and this module falls back to
`decode_attention_reference`, a per-request SDPA loop with the same semantics.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from met.kernels.kv_cache import KVCache, gather_kv
from met.kernels.native import native_op

_KEY = "decode_attention"


@functools.cache
def _native_kernel():
    """The compiled op (built on the first call in this process), or None when the build
    failed (met.kernels.native logged why, once). Cached: the op lookup costs ~10 µs, a third
    of the kernel at one request, and a decode step makes one call per layer."""
    return native_op(_KEY, "decode_attention")


def decode_attention_available() -> bool:
    """True once the native kernel is compiled and loaded (compiles it on first call)."""
    return _native_kernel() is not None


def decode_attention_reference(
    q: torch.Tensor,
    kv: KVCache,
    slots: torch.Tensor,
    offsets: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Pure-PyTorch `decode_attention`: per-request SDPA over gathered (for an int8 cache,
    dequantized) keys and values."""
    n, h, d = q.shape
    gqa = h != kv.k.shape[0]
    out = torch.empty_like(q)
    bounds = offsets.tolist()
    for i in range(n):
        keys, values = gather_kv(kv, slots[bounds[i] : bounds[i + 1]], q.dtype)
        o = F.scaled_dot_product_attention(
            q[i][None, :, None, :],  # [1, H, 1, D]
            keys.unsqueeze(0),
            values.unsqueeze(0),
            scale=scale,
            enable_gqa=gqa,
        )
        out[i] = o.view(h, d)
    return out


def decode_attention(
    q: torch.Tensor,
    kv: KVCache,
    slots: torch.Tensor,
    offsets: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of one query token per request over that request's cached context.

    q [N, H, D]; kv: the layer's cache, keys and values [Hkv, S, D] in q's dtype or int8
    with float32 scales [Hkv, S] (H a multiple of Hkv); slots: long, the concatenated context
    slots of all requests; offsets: long [N + 1], request i attending over
    ``slots[offsets[i]:offsets[i + 1]]`` (at least one slot). No mask: the query is the
    request's last token and sees its whole context. Returns [N, H, D] in q's dtype. A
    request's result depends only on its own inputs (batch-invariant).
    """
    native = q.device.type == "cpu" and native_applies(kv, q.dtype, q.shape[-1])
    op = _native_kernel() if native else None
    if op is None:
        return decode_attention_reference(q, kv, slots, offsets, scale)
    return op(q, kv.k, kv.v, slots, offsets, float(scale), kv.k_scale, kv.v_scale)


def native_applies(kv: KVCache, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether queries of ``dtype`` and ``head_dim`` over ``kv`` take the native kernel
    (else the reference)."""
    if not kv.native or kv.k.device.type != "cpu" or dtype not in (torch.float32,
                                                                     torch.bfloat16):
        return False
    if kv.k.dtype not in (dtype, torch.int8):
        return False  # an fp8 cache, or a cache dtype other than the queries'
    # The kernel reads int8 rows only through its register-blocked path.
    return not kv.quantized or (head_dim % 64 == 0 and kv.k.stride(2) == 1)


def native_op_name() -> str | None:
    """The native op's qualified name (for a caller in C++, met.layers.layer_stack), or None
    where it did not build."""
    op = _native_kernel()
    return None if op is None else op.name()
