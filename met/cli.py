"""Command line: `met generate` (more subcommands join as they land)."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from met.loader.resolve import hf_cache_dirs


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="checkpoint dir, .gguf file or HF-cache model id "
                        "(default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--model", dest="model_flag", default=None, help="same as the positional MODEL")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-memory", type=_parse_bytes, default=None,
                   help="KV pool size, e.g. 512MiB, 2GiB or bytes")
    p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching",
                   action="store_false")
    p.add_argument("--cache-dir", default=None,
                   help=f"HF cache to search (else {', '.join(map(str, hf_cache_dirs(None)))})")


def _parse_bytes(text: str) -> int:
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9}
    low = text.strip().lower()
    for suffix, mult in units.items():
        if low.endswith(suffix):
            return int(float(low[: -len(suffix)]) * mult)
    try:
        return int(low)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 512MiB or 2GiB)") from None


def _build_llm(args: argparse.Namespace):
    from met import LLM

    return LLM(
        args.model_flag or args.model, dtype=args.dtype, device=args.device,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory, enable_prefix_caching=args.enable_prefix_caching,
        cache_dir=args.cache_dir,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from met import SamplingParams

    llm = _build_llm(args)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    start = time.perf_counter()
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
    else:
        out = llm.generate([args.prompt], params)[0]
    elapsed = time.perf_counter() - start
    print(out.outputs[0].text)
    n = len(out.outputs[0].token_ids)
    print(f"[{n} tokens in {elapsed:.2f}s, finish_reason={out.outputs[0].finish_reason}]",
          file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="met", description="met: LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete one prompt and print the text")
    _add_engine_args(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--chat", action="store_true",
                     help="wrap the prompt as a user message with the model's chat template")
    gen.set_defaults(func=cmd_generate)

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"met: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
