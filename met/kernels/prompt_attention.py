"""Prompt attention on CPU AMX-BF16 tiles: the causal attention of a step's prompt rows.

Under w4a8 with AMX-BF16 (`CausalLM.prompt_rows_first`), prompt positions run through kernels
of their own, and the runner puts prompt chunks first in the batch (`ForwardBatch.prompt_rows`).
Their attention used to go row by row through the decode kernel (each row a one-token query
over its prefix: its keys widened to float32 again for every row). This kernel instead takes
sixteen rows of a chunk and one query head at a time: scores Q Kᵀ on TDPBF16PS tiles, the
softmax in float32 on the vector units, and P V on tiles again with each weight split into
two bfloat16 parts (hi + lo, ~16 significant bits). A chunk's keys and values are staged into
tile layouts once for all its rows.

Batch invariance: a tile's rows are computed independently, keys go in fixed tiles counted
from the context's first key, and keys past a row's position get weight zero, which adds
exactly nothing. A row's output depends only on its query and its context: the same bits
alone or batched, in any chunking, with or without a prefix-cache hit. The kernel serves every
prompt row of a model once it applies (bfloat16 cache, head_dim a multiple of 32, no sliding
window), so a prompt row never switches kernels with its batch.

Numerics: against float64 attention on the same bfloat16 inputs the error is the bfloat16
rounding of the output (tests/layers/test_prompt_attention.py).

Speed (2 threads, SmolLM2-135M's 9/3 heads × 64 dims, one layer): a 1,500-token prompt
~6 ms vs ~20 ms through the decode kernel row by row; 64 prompts of 110 tokens ~3 ms vs
~8.5 ms.
"""

from __future__ import annotations

import functools

import torch

from met.kernels.capability import probe
from met.kernels.kv_cache import KVCache
from met.kernels.native import load_native_ops, native_op

_KEY = "prompt_attention"


@functools.cache
def prompt_attention_available() -> bool:
    """True when this CPU has AMX-BF16 and the kernel builds (compiles on first call)."""
    return probe().amx_bf16 and load_native_ops(_KEY) is not None


def prompt_attention_applies(q: torch.Tensor, kv: KVCache) -> bool:
    """Whether `prompt_attention` can take these queries over this cache: bfloat16 queries
    and cache on CPU, head_dim a multiple of 32, and the kernel available."""
    return (kv.native and q.device.type == "cpu" and q.dtype == torch.bfloat16
            and not kv.quantized
            and kv.k.dtype == torch.bfloat16 and q.shape[-1] % 32 == 0
            and q.shape[1] % kv.k.shape[0] == 0 and kv.k.stride(2) == 1
            and kv.v.stride(2) == 1 and prompt_attention_available())


def prompt_attention(q: torch.Tensor, kv: KVCache, slots: torch.Tensor, chunks: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Causal attention of prompt rows q [P, H, D] over their cached contexts.

    chunks: long [n, 4], one row per prompt chunk: its first row in q, its number of rows,
    its context length (the chunk's rows are the context's last positions) and where its
    context's slots start in ``slots`` (long, every chunk's context slots one after another).
    The chunks must cover q's rows. Returns [P, H, D] bfloat16."""
    op = native_op(_KEY, "prompt_attention")
    return op(q, kv.k, kv.v, slots, chunks, float(scale))
