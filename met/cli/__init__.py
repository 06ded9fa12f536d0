"""Command line: `met serve | chat | generate | doctor | bench | kernels` (`python -m met` too).

One module per command; the faces a person meets at a terminal (the serve dashboard and
startup banner, the chat, the doctor) live here too, since they only read what the layers
below publish."""

from __future__ import annotations

import argparse
import logging
import sys

from met.bench.cli import add_bench_parser
from met.cli import chat, doctor, generate, serve
from met.kernels.cli import add_parser as add_kernels_parser


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="met", description="met: LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    generate.add_parser(sub)
    serve.add_parser(sub)
    chat.add_parser(sub)
    doctor.add_parser(sub)
    add_bench_parser(sub)
    add_kernels_parser(sub)

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"met: error: {e}", file=sys.stderr)
        return 2
