"""`met bench sweep | compare | run | list | verify | tables` (wired into met/cli.py)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from pathlib import Path

import httpx


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(t) for t in text.replace(" ", "").split(",") if t)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a comma list of integers: {text!r} (try 1,2,4,8)") from None
    if not values:
        raise argparse.ArgumentTypeError("an empty list (try 1,2,4,8)")
    return values


def _quiet_http_logs() -> None:
    # httpx logs every request at INFO: thousands of lines that would bury the progress bar.
    logging.getLogger("httpx").setLevel(logging.WARNING)


def cmd_sweep(args: argparse.Namespace) -> int:
    _quiet_http_logs()
    from met.bench.loadgen import Target, first_model
    from met.bench.report import sweep_table, write_json
    from met.bench.sweep import SweepSettings, new_client, run_sweep

    settings = SweepSettings(concurrency=args.concurrency, isl=args.isl, osl=args.osl,
                             reps=args.reps, warmup=args.warmup, seed=args.seed,
                             timeout=args.timeout, temperature=args.temperature,
                             top_p=args.top_p, top_k=args.top_k, workload=args.workload)

    async def go():
        model = args.model
        if model is None:
            async with new_client(1) as client:
                model = await first_model(client, args.url, args.api_key)
        target = Target(args.url, model, args.endpoint, args.api_key, not args.no_ignore_eos)
        return await run_sweep(target, settings, args.label)

    try:
        result = asyncio.run(go())
    except (httpx.HTTPError, RuntimeError) as e:
        print(f"met bench sweep: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(sweep_table(result))
    if args.out:
        write_json(args.out, result.to_dict())
        print(f"wrote {args.out}", file=sys.stderr)
    if args.plot:
        from met.bench.plot import plot_sweeps

        plot_sweeps([result], args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 1 if any(r.errors for r in result.rungs) else 0


def cmd_compare(args: argparse.Namespace) -> int:
    from met.bench.report import compare_table, load_sweep, sweep_table

    results = [load_sweep(p) for p in args.files]
    for r in results:
        print(sweep_table(r), end="\n\n")
    print(compare_table(results))
    if args.plot:
        from met.bench.plot import plot_sweeps

        plot_sweeps(results, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    _quiet_http_logs()
    from met.bench.runner import GateRun, run_gate

    run = GateRun(gate=args.gate, model=args.model, device=args.device,
                  floors=Path(args.floors) if args.floors else None,
                  records_dir=Path(args.records_dir) if args.records_dir else None,
                  sign=args.sign)
    try:
        path, data = run_gate(run)
    except RuntimeError as e:  # the server did not start
        print(f"met bench run: error: {e}", file=sys.stderr)
        return 1
    for c in data["checks"]:
        print(f"  {'ok  ' if c['ok'] else 'FAIL'} {c['name']}: {c['measured']!r} "
              f"(floor {c['op']} {c['floor']!r})")
    print(f"{data['gate']}: {data['verdict']} — {data['reason']}")
    print(f"record: {path}" + (" (signed)" if args.sign else ""))
    return 0 if data["verdict"] == "PASS" else 1


def cmd_list(args: argparse.Namespace) -> int:
    from met.bench.floors import machine_class
    from met.bench.gates import GATES
    from met.bench.records import repo_root

    for g in GATES.values():
        print(f"{g.name:<20} {g.description}")
    floors = sorted((repo_root() / "benchmarks" / "floors").glob("*.toml"))
    print(f"\nthis machine: {machine_class()}; floors files:")
    for f in floors:
        print(f"  {f}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from met.bench.signing import verify_file

    result = verify_file(Path(args.record), Path(args.public_key) if args.public_key else None)
    print(f"{args.record}: {'OK' if result.ok else 'FAILED'} — {result.reason}")
    if result.ok:
        data = json.loads(Path(args.record).read_text())
        print(f"{data.get('gate')}: {data.get('verdict')} at {data.get('git', {}).get('sha')}")
    return 0 if result.ok else 1


def cmd_tables(args: argparse.Namespace) -> int:
    from met.bench.records import repo_root
    from met.bench.tables import update

    root = repo_root()
    files = [Path(f) for f in args.files] or [root / "README.md", root / "docs" / "benchmarks.md"]
    records = Path(args.records_dir) if args.records_dir else root / ".benchmarks"
    try:
        results = update(files, records, check=args.check)
    except (OSError, KeyError, ValueError) as e:
        print(f"met bench tables: error: {e}", file=sys.stderr)
        return 1
    for r in results:
        state = ("out of date" if args.check else "updated") if r.changed else "up to date"
        print(f"{r.path}: {state} ({', '.join(r.tables) or 'no marked tables'})")
    if args.check and any(r.changed for r in results):
        print("met bench tables: run `met bench tables` to regenerate", file=sys.stderr)
        return 1
    return 0


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    """Add `bench` and its subcommands to the top-level parser's subparsers."""
    bench = sub.add_parser("bench", help="serving benchmarks, gates, records, comparisons")
    bsub = bench.add_subparsers(dest="bench_command", required=True)

    sw = bsub.add_parser("sweep", help="concurrency ladder against an OpenAI-compatible server")
    sw.add_argument("--url", default="http://127.0.0.1:8888",
                    help="server root (met, vLLM, llama-server …)")
    sw.add_argument("--model", default=None, help="model name to send (default: the first "
                                                  "one /v1/models lists)")
    sw.add_argument("--endpoint", default="completions", choices=["completions", "chat"])
    sw.add_argument("--concurrency", type=_int_list, default=(1, 2, 4, 8, 16, 32))
    sw.add_argument("--isl", type=int, default=128, help="prompt tokens (approximate)")
    sw.add_argument("--workload", default="random", choices=["random", "code-edit", "chat"],
                    help="prompts: random words (no repetition); code-edit (rewrite the code "
                         "in the prompt: prompt lookup's case); chat (open questions)")
    sw.add_argument("--osl", type=int, default=128, help="output tokens per request")
    sw.add_argument("--reps", type=int, default=1, help="requests per client per rung")
    sw.add_argument("--warmup", type=int, default=1, help="unmeasured requests first")
    sw.add_argument("--seed", type=int, default=0, help="prompt seed")
    sw.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    sw.add_argument("--temperature", type=float, default=0.0,
                    help="0: greedy (default); else every request samples with it")
    sw.add_argument("--top-p", type=float, default=1.0, help="sent when < 1 and sampling")
    sw.add_argument("--top-k", type=int, default=0, help="sent when > 0 and sampling")
    sw.add_argument("--api-key", default=None)
    sw.add_argument("--no-ignore-eos", action="store_true",
                    help="do not send ignore_eos (for servers that reject it)")
    sw.add_argument("--label", default=None, help="name in tables and plots")
    sw.add_argument("--out", default=None, help="write the result as JSON")
    sw.add_argument("--plot", default=None, help="write tok/s and TTFT plots (PNG)")
    sw.set_defaults(func=cmd_sweep)

    cp = bsub.add_parser("compare", help="rung-by-rung ratios of sweep files (first = baseline)")
    cp.add_argument("files", nargs="+")
    cp.add_argument("--plot", default=None, help="one line per file (PNG)")
    cp.set_defaults(func=cmd_compare)

    rn = bsub.add_parser("run", help="run a gate on its own `met serve` and write a record")
    rn.add_argument("gate", help="see `met bench list`")
    rn.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    rn.add_argument("--device", default="cpu")
    rn.add_argument("--floors", default=None,
                    help="TOML (default benchmarks/floors/<model>.<machine>.toml)")
    rn.add_argument("--records-dir", default=None, help="default: <repo>/.benchmarks")
    rn.add_argument("--sign", action="store_true",
                    help="Ed25519-sign the record (key in $MET_IDENTITY_DIR or ~/.met/identity)")
    rn.set_defaults(func=cmd_run)

    ls = bsub.add_parser("list", help="the gates and the floors files")
    ls.set_defaults(func=cmd_list)

    vf = bsub.add_parser("verify", help="check a record's signature")
    vf.add_argument("record")
    vf.add_argument("--public-key", default=None,
                    help="signer's PEM (default: this machine's identity)")
    vf.set_defaults(func=cmd_verify)

    tb = bsub.add_parser("tables", help="regenerate the marked benchmark tables of the docs "
                                        "from the records")
    tb.add_argument("files", nargs="*",
                    help="markdown files with <!-- bench:NAME --> markers (default: README.md "
                         "and docs/benchmarks.md)")
    tb.add_argument("--records-dir", default=None, help="default: <repo>/.benchmarks")
    tb.add_argument("--check", action="store_true",
                    help="change nothing; exit 1 if a file is out of date")
    tb.set_defaults(func=cmd_tables)
