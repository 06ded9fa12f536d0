"""The w4a8 kernel (met/kernels/csrc/w4a8.cpp with AVX512-VNNI, else w4a8_avx2.cpp) on one
decoder layer's four projections of the
embedded model (qkv 960×576, o 576×576, gate_up 3072×576, down 576×1536) and on its 8-bit LM
head (49,152×576), at several row counts.

    python benchmarks/w4a8_linear.py [--rows 1,4,16,64,512] [--threads 2] [--reps 9]
        [--amx-min-rows N] [--float32]

Weights are random (the kernel's speed does not depend on their values); activations are
bfloat16 (--float32: float32, what a model runs with on a CPU without native bfloat16). Each
row count times the four projections back to back, five times in a row (cache-hot: one layer's
weights are ~2 MB), then the head (its 28 MB come from memory), best of --reps each. By default
the tiles stay off (--amx-min-rows above every row count), so the VNNI path is what is timed on
any CPU; --amx-min-rows 32 times what the engine runs on an AMX CPU. Prints one JSON line per
row count: layer_ms, layer_gmacs, head_ms, head_gmacs.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from met.kernels.w4a8 import Int4Dynamic, Int8Blocks, available, kernel_isa

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in)
VOCAB, HIDDEN = 49152, 576


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,4,16,64,512")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--amx-min-rows", type=int, default=1 << 30)
    parser.add_argument("--float32", action="store_true", help="float32 activations")
    parser.add_argument("--layers", type=int, default=1,
                        help="distinct copies of the layer, run in turn as a decode step runs "
                             "them, the head after them (30 = the embedded model: the weights "
                             "then come from memory rather than cache, as in the engine)")
    args = parser.parse_args()
    if not available():
        raise SystemExit("w4a8 kernel unavailable: this CPU has no AVX512-VNNI or AVX2 "
                         "(or no compiler)")
    dtype = torch.float32 if args.float32 else torch.bfloat16
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    layers = [Int4Dynamic(torch.randn(n, k) * 0.05, None)
              for _ in range(args.layers) for n, k in SHAPES]
    head = Int8Blocks(torch.randn(VOCAB, HIDDEN) * 0.05, None)
    weight_bytes = sum(t.numel() * t.element_size()  # one layer's four projections
                       for layer in layers[:len(SHAPES)] for t in layer._bound()[1])
    calls = []  # each projection's op bound once, as the engine binds it (bf16_rows)
    for layer in layers:
        kernel, weights, bias, n = layer._bound()
        calls.append(lambda x, k=kernel, w=weights, b=bias, n=n:
                     k(x, *w, b, n, False, args.amx_min_rows, 0))
    head_kernel, head_weights, _, _ = head._bound()
    for rows in (int(r) for r in args.rows.split(",")):
        xs = [torch.randn(rows, k).to(dtype) for _, k in SHAPES]
        xh = torch.randn(rows, HIDDEN).to(dtype)
        layer_s = head_s = float("inf")
        # The layer(s) 5 times in a row (one layer: cache-hot), then the head.
        rounds = 5 if args.layers == 1 else 1
        for _ in range(args.reps):
            start = time.perf_counter()
            for _ in range(rounds):
                for i, call in enumerate(calls):
                    call(xs[i % len(SHAPES)])
            layer_s = min(layer_s, (time.perf_counter() - start) / (rounds * args.layers))
            if args.layers > 1:  # right after the layers, as in a decode step (cache-cold)
                start = time.perf_counter()
                head_kernel(xh, *head_weights, None, VOCAB, True, args.amx_min_rows)
                head_s = min(head_s, time.perf_counter() - start)
        for _ in range(args.reps if args.layers == 1 else 0):
            start = time.perf_counter()
            head_kernel(xh, *head_weights, None, VOCAB, True, args.amx_min_rows)
            head_s = min(head_s, time.perf_counter() - start)
        macs = rows * sum(n * k for n, k in SHAPES)
        print(json.dumps({"rows": rows, "threads": args.threads, "layers": args.layers,
                          "kernel": kernel_isa(),
                          "layer_ms": round(layer_s * 1e3, 4),
                          "layer_gmacs": round(macs / layer_s / 1e9, 1),
                          "layer_weight_GBps": round(weight_bytes / layer_s / 1e9, 1),
                          "head_ms": round(head_s * 1e3, 3),
                          "head_gmacs": round(rows * VOCAB * HIDDEN / head_s / 1e9, 1)}),
              flush=True)


if __name__ == "__main__":
    main()
