"""CPU decode attention: the native kernel vs the per-request SDPA loop it replaces.

    python benchmarks/decode_attention.py [--num-reqs 64] [--heads 9] [--kv-heads 3]
        [--head-dim 64] [--min-ctx 140] [--max-ctx 204] [--dtype bfloat16]
        [--layout blocks|shuffled-blocks] [--kv-cache-dtype auto|int8] [--layers 1]
        [--threads N] [--fresh-build]

One call = one layer of one decode step: every request has one query token and attends over
its whole context, read from a paged cache [Hkv, S, D] through its slot list. "blocks" lays
each request's context out in consecutive 16-slot blocks (a fresh engine's allocation);
"shuffled-blocks" scatters the blocks over the cache (a long-running engine's). Per call
the kernel reads each request's keys and values once (~8 MB here), so the cache is sized
well past L2 and its lines are evicted between calls, as they would be across layers.
--kv-cache-dtype int8 stores the cache as int8 rows with a scale each (met.kernels.kv_cache);
max_err is then against the float32 reference on the dequantized rows. --layers N gives each
of N layers its own cache and times one call per layer in turn (N = 30 is the embedded
model's decode step: ~250 MB of keys and values at 64 requests, read from memory rather than
L3); kernel_us is then per layer.

--fresh-build compiles the kernel into an empty extensions directory, so the first-call time
is the real compile time rather than the load of a cached build. --clock thread times with
the calling thread's CPU time instead of wall time: with --threads 1 both the kernel and the
loop run entirely on that thread, so this is the number to trust on a machine shared with
other busy processes. Run from the repository root with met installed (or PYTHONPATH=.).
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time

import torch

BLOCK = 16


def make_problem(args: argparse.Namespace, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, args.dtype)
    lens = torch.randint(args.min_ctx, args.max_ctx + 1, (args.num_reqs,), generator=g)
    blocks_per_req = [(int(n) + BLOCK - 1) // BLOCK for n in lens]
    num_blocks = sum(blocks_per_req) * 2  # half the cache unused, like a running engine
    order = (
        torch.randperm(num_blocks, generator=g)
        if args.layout == "shuffled-blocks"
        else torch.arange(num_blocks)
    )
    slots, used = [], 0
    for n, nb in zip(lens.tolist(), blocks_per_req, strict=True):
        blocks = order[used : used + nb]
        used += nb
        slots.append((blocks[:, None] * BLOCK + torch.arange(BLOCK)).flatten()[:n])
    offsets = torch.zeros(args.num_reqs + 1, dtype=torch.long)
    offsets[1:] = lens.cumsum(0)
    shape = (args.kv_heads, num_blocks * BLOCK, args.head_dim)
    k = torch.randn(shape, generator=g).to(dtype)
    v = torch.randn(shape, generator=g).to(dtype)
    q = torch.randn(args.num_reqs, args.heads, args.head_dim, generator=g).to(dtype)
    return q, k, v, torch.cat(slots), offsets


def time_per_call(fn, flush: torch.Tensor, iters: int, repeats: int, clock) -> float:
    """Best-of-repeats mean seconds per call, evicting the cache from L2 before every call."""
    best = float("inf")
    for _ in range(repeats):
        total = 0.0
        for _ in range(iters):
            flush.add_(1)  # 32 MB write: the next call finds the KV cache out of L1/L2
            t = clock()
            fn()
            total += clock() - t
        best = min(best, total / iters)
    return best


def _layer_cache(like, seed: int):
    """A cache shaped like ``like`` (float or int8) with its own random rows."""
    from met.kernels.kv_cache import KVCache, quantize_kv

    g = torch.Generator().manual_seed(1000 + seed)
    k = torch.randn(like.k.shape, generator=g)
    v = torch.randn(like.v.shape, generator=g)
    if like.quantized:
        return quantize_kv(k, v)
    return KVCache(k.to(like.k.dtype), v.to(like.v.dtype))


def time_layers(call, layers: list, repeats: int, clock) -> float:
    """Best-of-repeats mean seconds per layer of one call per layer in turn (a decode step:
    each layer's cache was last read a whole step ago)."""
    for c in layers:
        call(c)
    best = float("inf")
    for _ in range(repeats):
        t = clock()
        for c in layers:
            call(c)
        best = min(best, (clock() - t) / len(layers))
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-reqs", type=int, default=64)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--min-ctx", type=int, default=140)
    p.add_argument("--max-ctx", type=int, default=204)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--layout", default="blocks", choices=["blocks", "shuffled-blocks"])
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"])
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--fresh-build", action="store_true")
    p.add_argument("--clock", default="wall", choices=["wall", "thread"])
    args = p.parse_args()
    if args.clock == "thread" and args.threads != 1:
        p.error("--clock thread measures only the calling thread: use it with --threads 1")
    clock = time.perf_counter if args.clock == "wall" else time.thread_time
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.fresh_build:
        os.environ["TORCH_EXTENSIONS_DIR"] = tempfile.mkdtemp(prefix="met-ext-")

    from met.kernels import decode_attention as cda
    from met.kernels.kv_cache import KVCache, gather_kv, quantize_kv

    q, k, v, slots, offsets = make_problem(args)
    scale = args.head_dim**-0.5
    t = time.perf_counter()
    available = cda.decode_attention_available()
    first_call_s = time.perf_counter() - t
    if not available:
        raise SystemExit("native kernel unavailable (see the warning above)")

    kv = KVCache(k, v)
    if args.kv_cache_dtype == "int8":
        kv = quantize_kv(k, v)
        k, v = gather_kv(kv, torch.arange(k.shape[1]), torch.float32)
    kernel = lambda: cda.decode_attention(q, kv, slots, offsets, scale)  # noqa: E731
    loop = lambda: cda.decode_attention_reference(q, kv, slots, offsets, scale)  # noqa: E731
    ref = cda.decode_attention_reference(q.float(), KVCache(k.float(), v.float()), slots,
                                         offsets, scale)
    max_err = (kernel().float() - ref).abs().max().item()

    flush = torch.zeros(8 * 1024 * 1024)
    if args.layers > 1:  # the other layers' caches: same slots, their own random rows
        layers = [kv] + [_layer_cache(kv, seed) for seed in range(1, args.layers)]
        kernel_s = time_layers(lambda c: cda.decode_attention(q, c, slots, offsets, scale),
                               layers, args.repeats, clock)
    else:
        kernel_s = time_per_call(kernel, flush, args.iters, args.repeats, clock)
    loop_s = time_per_call(loop, flush, max(5, args.iters // 10), args.repeats, clock)
    row_bytes = args.head_dim * kv.k.element_size() + (4 if kv.quantized else 0)
    kv_bytes = 2 * int(offsets[-1]) * args.kv_heads * row_bytes
    print(
        json.dumps(
            {
                "bench": "decode_attention",
                "machine": f"{platform.machine()} {os.cpu_count()} cpus",
                "torch": torch.__version__,
                "threads": torch.get_num_threads(),
                "clock": args.clock,
                "shape": {
                    "N": args.num_reqs,
                    "H": args.heads,
                    "Hkv": args.kv_heads,
                    "D": args.head_dim,
                    "ctx": [args.min_ctx, args.max_ctx],
                    "dtype": args.dtype,
                    "layout": args.layout,
                    "kv_cache_dtype": args.kv_cache_dtype,
                    "layers": args.layers,
                },
                "first_call_s": round(first_call_s, 2),
                "fresh_build": args.fresh_build,
                "kernel_us": round(kernel_s * 1e6, 1),
                "sdpa_loop_us": round(loop_s * 1e6, 1),
                "speedup": round(loop_s / kernel_s, 2),
                "kernel_kv_GBps": round(kv_bytes / kernel_s / 1e9, 1),
                "max_abs_err_vs_fp32_reference": max_err,
            }
        )
    )


if __name__ == "__main__":
    main()
