"""Tables for the terminal, sweep JSON files, and `met bench compare`'s rung-by-rung ratios."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from met.bench.stats import RungStats
from met.bench.sweep import SweepResult


def _fmt(x: float | int | None, digits: int = 1) -> str:
    if x is None:
        return "-"
    if isinstance(x, int):
        return str(x)
    return f"{x:.{digits}f}"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain right-aligned text table."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(headers)]
    line = "  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(out)


_SWEEP_HEADERS = ("conc", "reqs", "err", "out tok/s", "TTFT p50", "p90", "p99", "TPOT p50",
                  "p90", "E2E p50", "min out", "prompt")


def sweep_table(result: SweepResult) -> str:
    """The end-of-sweep table (latencies in ms)."""
    rows = [[str(r.concurrency), str(r.requests), str(r.errors), _fmt(r.output_tok_s),
             _fmt(r.ttft_p50_ms), _fmt(r.ttft_p90_ms), _fmt(r.ttft_p99_ms),
             _fmt(r.tpot_p50_ms, 2), _fmt(r.tpot_p90_ms, 2), _fmt(r.e2e_p50_ms),
             _fmt(r.min_output_tokens), _fmt(r.mean_prompt_tokens, 0)] for r in result.rungs]
    head = (f"{result.label}: {result.endpoint}, {result.settings.workload} prompts, "
            f"isl≈{result.settings.isl}, "
            f"osl {result.settings.osl}, reps {result.settings.reps} (latencies in ms)")
    notes = [f"rung {r.concurrency}: first error: {r.first_error}" for r in result.rungs
             if r.first_error]
    for r in result.rungs:
        for method, d in (r.spec or {}).items():
            notes.append(f"rung {r.concurrency}: speculation {method}: drafted "
                         f"{d['drafted']:.0f}, accepted {d['accepted']:.0f} "
                         f"({100 * d['acceptance_rate']:.0f}%), mean accepted length "
                         f"{d['mean_accepted_length']:.2f}")
    if any(not r.usage_reported for r in result.rungs if r.requests > r.errors):
        notes.append("the server sent no usage: output tokens are counted as chunks")
    return "\n".join([head, table(_SWEEP_HEADERS, rows), *notes])


def write_json(path: str | os.PathLike[str], data: dict) -> None:
    """Write ``data`` atomically (a reader never sees half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    os.replace(tmp, path)


def load_sweep(path: str | os.PathLike[str]) -> SweepResult:
    """A sweep written by ``--out``; ValueError naming the file if it is not one."""
    try:
        return SweepResult.from_dict(json.loads(Path(path).read_text()))
    except (KeyError, TypeError, json.JSONDecodeError, ValueError) as e:
        raise ValueError(f"{path}: not a `met bench sweep --out` file ({e})") from None


@dataclass(frozen=True)
class RatioRow:
    """One rung of one file against the baseline (the first file)."""

    concurrency: int
    label: str
    tok_s: float
    base_tok_s: float
    tok_s_ratio: float | None  # this / baseline: > 1 is faster
    ttft_ratio: float | None  # this / baseline: < 1 is faster
    tpot_ratio: float | None


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def compare_rows(results: Sequence[SweepResult]) -> list[RatioRow]:
    """Every later file against the first, at each concurrency both measured."""
    if len(results) < 2:
        raise ValueError("compare: give at least two sweep files (the first is the baseline)")
    base = {r.concurrency: r for r in results[0].rungs}
    rows = []
    for other in results[1:]:
        for r in other.rungs:
            b: RungStats | None = base.get(r.concurrency)
            if b is None:
                continue
            rows.append(RatioRow(
                concurrency=r.concurrency, label=other.label, tok_s=r.output_tok_s,
                base_tok_s=b.output_tok_s, tok_s_ratio=_ratio(r.output_tok_s, b.output_tok_s),
                ttft_ratio=_ratio(r.ttft_p50_ms, b.ttft_p50_ms),
                tpot_ratio=_ratio(r.tpot_p50_ms, b.tpot_p50_ms)))
    return rows


def compare_table(results: Sequence[SweepResult]) -> str:
    """`met bench compare`: rung-by-rung ratios against the first file."""
    rows = compare_rows(results)
    base = results[0].label
    body = [[str(r.concurrency), r.label, _fmt(r.base_tok_s), _fmt(r.tok_s),
             _fmt(r.tok_s_ratio, 2) + "x" if r.tok_s_ratio is not None else "-",
             _fmt(r.ttft_ratio, 2) + "x" if r.ttft_ratio is not None else "-",
             _fmt(r.tpot_ratio, 2) + "x" if r.tpot_ratio is not None else "-"] for r in rows]
    headers = ("conc", "vs baseline", "baseline tok/s", "tok/s", "tok/s ratio",
               "TTFT p50 ratio", "TPOT p50 ratio")
    return (f"baseline: {base} (tok/s ratio > 1: faster than the baseline; "
            f"latency ratio < 1: lower latency)\n" + table(headers, body))
