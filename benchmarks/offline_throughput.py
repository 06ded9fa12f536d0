"""Offline throughput: met's LLM.generate vs transformers' generate, same model, same prompts.

    python benchmarks/offline_throughput.py [--model PATH] [--num-prompts 64] [--isl 128]
        [--osl 128] [--dtype float32] [--quantization none] [--kv-cache-dtype auto|int8]
        [--hf-dtype DTYPE] [--hf-batch-size 64] [--skip-hf] [--repeats N]
        [--temperature T] [--top-p P] [--top-k K]

transformers runs in --hf-dtype (default: --dtype; float32 for auto), so met's fast path can
be set against transformers' exact float32, e.g. ``--dtype bfloat16 --quantization w4a8
--hf-dtype float32 --num-prompts 1 --hf-batch-size 1`` for one stream.

Prompts are random token ids of exactly --isl tokens (no padding needed on either side);
every request generates exactly --osl tokens (ignore_eos / min_new_tokens), greedily unless
--temperature is set (then both engines sample, with --top-p / --top-k). Prints one
JSON line per engine and the speed-up; with --repeats N both models stay loaded, the engines
alternate N times (a shared host's speed drifts by tens of percent within minutes: a single
pair of runs decides nothing near a bar), and a last line gives the medians and the range of
the per-pair speed-ups.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch


def _prompts(n: int, isl: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # Skip the low ids, where special tokens usually live.
    return torch.randint(100, vocab, (n, isl), generator=g).tolist()


def run_met(args, llm, prompts) -> dict:
    from met import SamplingParams

    params = SamplingParams(max_tokens=args.osl, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0][:8]}], SamplingParams(max_tokens=2))  # warm-up
    llm.reset_prefix_cache()
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    elapsed = time.perf_counter() - start
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"engine": "met", "dtype": args.dtype, "quantization": args.quantization,
            "seconds": elapsed, "output_tokens": n_out,
            "output_tok_s": n_out / elapsed,
            "total_tok_s": (n_out + len(prompts) * args.isl) / elapsed}


def load_hf(args):
    from transformers import AutoModelForCausalLM

    from met.loader.resolve import resolve_model

    src = resolve_model(args.model)
    hf_dtype = args.hf_dtype or args.dtype
    kwargs = {"dtype": torch.float32 if hf_dtype in ("auto", "float32") else torch.bfloat16}
    if src.kind == "gguf":
        model = AutoModelForCausalLM.from_pretrained(str(src.path.parent),
                                                     gguf_file=src.path.name, **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(src.path), **kwargs)
    return model.eval()


def run_hf(args, model, prompts) -> dict:
    n_out = 0
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), args.hf_batch_size):
            batch = torch.tensor(prompts[i : i + args.hf_batch_size])
            out = model.generate(batch, attention_mask=torch.ones_like(batch),
                                 max_new_tokens=args.osl, min_new_tokens=args.osl,
                                 pad_token_id=0, **_hf_sampling(args))
            n_out += (out.shape[1] - batch.shape[1]) * batch.shape[0]
    elapsed = time.perf_counter() - start
    return {"engine": "transformers", "dtype": str(model.dtype).removeprefix("torch."),
            "hf_batch_size": args.hf_batch_size, "seconds": elapsed, "output_tokens": n_out,
            "output_tok_s": n_out / elapsed,
            "total_tok_s": (n_out + len(prompts) * args.isl) / elapsed}


def _hf_sampling(args) -> dict:
    """transformers' generate arguments for --temperature / --top-p / --top-k."""
    if args.temperature == 0:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": args.temperature, "top_p": args.top_p,
            "top_k": args.top_k if args.top_k > 0 else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct GGUF")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--isl", type=int, default=128)
    p.add_argument("--osl", type=int, default=128)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--hf-batch-size", type=int, default=64)
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--quantization", default="none",
                   choices=["auto", "none", "int8", "int4", "w8a8", "w4a8"])
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"])
    p.add_argument("--hf-dtype", default=None, choices=["float32", "bfloat16"],
                   help="transformers' dtype (default: --dtype)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0: greedy (default); else both engines sample with it")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0: off")
    p.add_argument("--repeats", type=int, default=1,
                   help="timed runs of each engine, alternating met / transformers, then a "
                        "summary line with medians and the per-pair speed-up range")
    args = p.parse_args()

    from met import LLM

    llm = LLM(args.model, dtype=args.dtype, quantization=args.quantization,
              kv_cache_dtype=args.kv_cache_dtype, max_model_len=args.isl + args.osl + 16,
              max_num_seqs=args.num_prompts, max_num_batched_tokens=args.max_num_batched_tokens)
    prompts = _prompts(args.num_prompts, args.isl, llm.engine.loaded.hf_config.vocab_size)
    machine = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
               "torch": torch.__version__, "threads": torch.get_num_threads()}
    print(json.dumps({"machine": machine, "args": vars(args)}))
    hf_model = None if args.skip_hf else load_hf(args)
    met_runs, hf_runs = [], []
    for run in range(args.repeats):  # met and transformers alternate: both see each window
        met_runs.append(run_met(args, llm, prompts))
        print(json.dumps({**met_runs[-1], "run": run} if args.repeats > 1 else met_runs[-1]))
        if hf_model is not None:
            hf_runs.append(run_hf(args, hf_model, prompts))
            print(json.dumps({**hf_runs[-1], "run": run} if args.repeats > 1 else hf_runs[-1]))
            print(json.dumps({"speedup_output_tok_s": met_runs[-1]["output_tok_s"]
                              / hf_runs[-1]["output_tok_s"]}))
    if args.repeats > 1:
        summary = {"met_output_tok_s_median": _median([r["output_tok_s"] for r in met_runs])}
        if hf_runs:
            ratios = [m["output_tok_s"] / h["output_tok_s"]
                      for m, h in zip(met_runs, hf_runs, strict=True)]
            summary.update(hf_output_tok_s_median=_median([r["output_tok_s"] for r in hf_runs]),
                           speedup_median=_median(ratios), speedup_min=min(ratios),
                           speedup_max=max(ratios))
        print(json.dumps(summary))


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2

if __name__ == "__main__":
    main()
