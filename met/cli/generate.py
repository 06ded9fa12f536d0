"""`met generate`: one completion, printed."""

from __future__ import annotations

import argparse
import sys
import time

from met.cli.args import add_engine_args, add_sampling_args, build_llm, sampling_params


def add_parser(sub: argparse._SubParsersAction) -> None:
    gen = sub.add_parser("generate", help="complete one prompt and print the text")
    add_engine_args(gen)
    gen.add_argument("--prompt", required=True)
    add_sampling_args(gen)
    gen.add_argument("--chat", action="store_true",
                     help="wrap the prompt as a user message with the model's chat template")
    gen.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    params = sampling_params(args)  # before loading the model, so a bad value fails at once
    llm = build_llm(args)
    start = time.perf_counter()
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
    else:
        out = llm.generate([args.prompt], params)[0]
    elapsed = time.perf_counter() - start
    print(out.outputs[0].text)
    n = len(out.outputs[0].token_ids)
    stop = out.outputs[0].stop_reason
    print(f"[{n} tokens in {elapsed:.2f}s, finish_reason={out.outputs[0].finish_reason}"
          f"{'' if stop is None else f', stop_reason={stop}'}]", file=sys.stderr)
    return 0
