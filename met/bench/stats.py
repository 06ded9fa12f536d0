"""Per-rung statistics of a sweep: throughput, latency percentiles, errors."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields

from met.bench.loadgen import RequestResult


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation (numpy's default); None if
    there are no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile: q must be in 0..100, got {q}")
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _ms(x: float | None) -> float | None:
    return None if x is None else x * 1000.0


@dataclass(frozen=True)
class RungStats:
    """One rung of the ladder. Latencies in milliseconds; throughput over the rung's wall
    time (first request sent to last one finished)."""

    concurrency: int
    requests: int
    errors: int
    duration_s: float
    output_tokens: int
    output_tok_s: float
    request_per_s: float
    ttft_p50_ms: float | None
    ttft_p90_ms: float | None
    ttft_p99_ms: float | None
    tpot_p50_ms: float | None
    tpot_p90_ms: float | None
    e2e_p50_ms: float | None
    min_output_tokens: int | None
    mean_prompt_tokens: float | None
    usage_reported: bool
    first_error: str | None = None
    # met's speculative decoding in this rung, per method: drafted, accepted, verifies,
    # acceptance_rate, mean_accepted_length (from /metrics); None where it was off.
    spec: dict[str, dict[str, float]] | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> RungStats:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def rung_stats(concurrency: int, results: Sequence[RequestResult],
               duration_s: float) -> RungStats:
    """Aggregate the requests of one rung (failed ones count only as errors)."""
    ok = [r for r in results if r.ok]
    errors = [r for r in results if not r.ok]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    tpots = [t for t in (r.tpot for r in ok) if t is not None]
    e2es = [r.e2e for r in ok if r.e2e is not None]
    out_tokens = sum(r.output_tokens for r in ok)
    prompts = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    dur = max(duration_s, 1e-9)
    return RungStats(
        concurrency=concurrency, requests=len(results), errors=len(errors),
        duration_s=duration_s, output_tokens=out_tokens, output_tok_s=out_tokens / dur,
        request_per_s=len(ok) / dur,
        ttft_p50_ms=_ms(percentile(ttfts, 50)), ttft_p90_ms=_ms(percentile(ttfts, 90)),
        ttft_p99_ms=_ms(percentile(ttfts, 99)),
        tpot_p50_ms=_ms(percentile(tpots, 50)), tpot_p90_ms=_ms(percentile(tpots, 90)),
        e2e_p50_ms=_ms(percentile(e2es, 50)),
        min_output_tokens=min((r.output_tokens for r in ok), default=None),
        mean_prompt_tokens=sum(prompts) / len(prompts) if prompts else None,
        usage_reported=bool(ok) and all(r.usage_reported for r in ok),
        first_error=errors[0].error if errors else None,
    )
