"""Routed experts on the CPU: met's grouped `apply_experts` vs the per-expert loop it
replaced, and the two grouped-matmul paths (torch's _grouped_mm, a padded bmm) against each
other, and the GGUF path (experts kept as Q8_0 blocks, the native quantized matmul per
expert group).

    python benchmarks/moe_experts.py [--tokens 1,8,64,512] [--dtype float32] [--threads N]
        [--clock wall|thread]

Two shapes: "tiny" (the tests' qwen3_moe: hidden 64, expert intermediate 32, 4 experts,
top-2) and "qwen3-30b-a3b/4" (Qwen3-30B-A3B with hidden, expert width and expert count
divided by 4: hidden 512, intermediate 192, 32 experts, top-8). One call = one MoE layer over
T tokens with random routing. Prints one JSON line per (shape, T): median milliseconds of
each path and the largest |difference| from the loop.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from met.kernels import gguf_blocks
from met.kernels import grouped_mm as gmm
from met.layers import moe
from met.layers.moe import ExpertStack, apply_experts, attach_expert_blocks

SHAPES = {"tiny": (64, 32, 4, 2), "qwen3-30b-a3b/4": (512, 192, 32, 8)}


def loop_experts(x, weights, experts, stack, act):
    """The replaced implementation: one dense matmul chain per expert that got tokens."""
    out = torch.zeros_like(x)
    for e in torch.unique(experts).tolist():
        token_idx, slot = torch.where(experts == e)
        h = x[token_idx]
        h = act(F.linear(h, stack.gate_proj[e])) * F.linear(h, stack.up_proj[e])
        out.index_add_(0, token_idx, F.linear(h, stack.down_proj[e]) * weights[token_idx, slot,
                                                                                  None])
    return out


def with_bmm(x, weights, experts, stack, act):
    """apply_experts with the padded-bmm grouped matmul forced."""
    saved = moe.grouped_mm
    moe.grouped_mm = gmm.padded_bmm
    try:
        return apply_experts(x, weights, experts, stack, act)
    finally:
        moe.grouped_mm = saved


def median_ms(fn, clock, min_s: float = 0.3) -> float:
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while time.perf_counter() - start < min_s or len(times) < 5:
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return statistics.median(times) * 1e3


def quantized_copy(stack: ExpertStack, kind: int) -> ExpertStack:
    """The stack with every expert as GGUF blocks of ``kind`` (what a GGUF file loads as
    under --quantization gguf)."""
    copy = ExpertStack(stack.gate_proj.shape[2], stack.gate_proj.shape[1], stack.num_experts,
                       stack.gate_proj.dtype)
    for name in ("gate", "up", "down"):
        src, dst = getattr(stack, f"{name}_proj"), getattr(copy, f"{name}_proj")
        for e in range(stack.num_experts):
            attach_expert_blocks(dst, e, gguf_blocks.from_float(src[e], kind), name)
    copy.keep_blocks()
    return copy


def measure(x, weights, experts, stack, q8_stack, clock) -> dict[str, float]:
    """Each path's median time and largest |difference| from the loop (gguf_q8_0: from the
    loop, so it includes the Q8_0 rounding)."""
    ref = loop_experts(x, weights, experts, stack, F.silu)
    record: dict[str, float] = {}
    for path, impl, on in (("loop", loop_experts, stack), ("grouped", apply_experts, stack),
                           ("padded_bmm", with_bmm, stack),
                           ("gguf_q8_0", apply_experts, q8_stack)):
        def call(impl=impl, on=on):
            return impl(x, weights, experts, on, F.silu)
        record[f"{path}_ms"] = round(median_ms(call, clock), 4)
        record[f"{path}_max_err"] = float((call() - ref).abs().max())
    return record


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,8,64,512")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--clock", default="wall", choices=["wall", "thread"],
                    help="thread: the calling thread's CPU time (trust it with --threads 1 "
                         "on a shared machine)")
    args = ap.parse_args()
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    for name, (hidden, inter, num_experts, top_k) in SHAPES.items():
        stack = ExpertStack(hidden, inter, num_experts, dtype)
        with torch.no_grad():
            for p in stack.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
        q8_stack = quantized_copy(stack, gguf_blocks.kind_of("Q8_0"))
        for t in (int(v) for v in args.tokens.split(",")):
            x = torch.randn(t, hidden, generator=gen).to(dtype)
            probs = torch.randn(t, num_experts, generator=gen).softmax(-1)
            weights, experts = torch.topk(probs, top_k)
            weights = weights.to(dtype)
            record = {"shape": name, "tokens": t, "dtype": args.dtype,
                      "threads": torch.get_num_threads(), "clock": args.clock}
            record |= measure(x, weights, experts, stack, q8_stack, clock)
            print(json.dumps(record), flush=True)


if __name__ == "__main__":
    with torch.inference_mode():
        main()
