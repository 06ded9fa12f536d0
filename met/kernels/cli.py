"""`met kernels build | check | list`: the native kernels of this machine, ahead of use.

``build`` compiles every extension whose ops run here (the install script runs it, so a
server's first request never waits for a compiler); ``check`` also fails when one of them
does not load, e.g. an install that lacks a source or header (CI runs it in a fresh,
non-editable install); ``list`` shows the capability and each extension's state.
"""

from __future__ import annotations

import argparse
import sys

import torch

from met.kernels import native, registry
from met.kernels.capability import probe


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("kernels", help="build, check or list the native CPU kernels")
    p.add_argument("action", choices=["build", "check", "list"])
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    cap = probe()
    print(f"met kernels from {native.CSRC.parent}")
    print(f"machine: {cap.describe()}")
    if args.action == "list":
        for ext in native.EXTENSIONS.values():
            here = "runs here" if ext.runs_on(cap) else "not on this CPU"
            built = "built" if native._built(ext) else "not built"
            print(f"  {ext.key:<18} {here:<16} {built:<10} {ext.what}")
        print("auto picks, bfloat16 on this CPU (force with --linear-backend / "
              "--attention-backend):")
        for quant in (None, "w4a8", "w8a8", "int8", "int4"):
            plan = registry.plan(registry.LinearSpec(quant, torch.bfloat16, "cpu"), cap=cap)
            skipped = "; ".join(f"{n}: {why}" for n, why in plan.rejected)
            print(f"  quantization {quant or 'none':<5} -> linear {plan.linear.name:<12} "
                  f"attention {plan.attention.name}" + (f"  (not: {skipped})" if skipped
                                                          else ""))
        return 0
    loaded = native.prepare(progress=print)
    failed = [k for k, ok in loaded.items() if not ok]
    for key, ok in loaded.items():
        print(f"  {key:<18} {'loaded' if ok else 'FAILED'}  ({native.namespace(key)})")
    if failed:
        print(f"met kernels: {', '.join(failed)} did not build or load; met would run plain "
              f"PyTorch there (see the warnings above)", file=sys.stderr)
        return 1
    if not loaded:
        print("met kernels: no native kernels run on this CPU (plain PyTorch paths)")
    return 0
