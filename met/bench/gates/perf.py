"""Speed gates: concurrency-sweep, decode-floor, ttft-cold, ttft-warm, first-request."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from met.bench.floors import get
from met.bench.gates.base import GateContext, GateOutcome, per_key_floats, require
from met.bench.loadgen import RequestResult, stream_request
from met.bench.progress import Progress
from met.bench.prompts import measure_shape, prompt_set, words
from met.bench.records import Check
from met.bench.sweep import SweepSettings, run_sweep

# ---------------------------------------------------------------- concurrency-sweep


@dataclass(frozen=True)
class SweepGateConfig:
    settings: SweepSettings
    min_tok_s: dict[int, float]  # per concurrency
    max_ttft_p50_ms: dict[int, float]


def configure_sweep(section: dict[str, Any], path: Path | None) -> SweepGateConfig:
    g = "concurrency-sweep"
    conc = get(section, "concurrency", [1, 4, 16, 64], path, g)
    settings = SweepSettings(
        concurrency=tuple(int(c) for c in conc), isl=get(section, "isl", 110, path, g),
        osl=get(section, "osl", 128, path, g), reps=get(section, "reps", 1, path, g),
        warmup=get(section, "warmup", 2, path, g), seed=get(section, "seed", 0, path, g))
    floors = per_key_floats(section, "min_output_tok_s", path, g)
    missing = [c for c in settings.concurrency if c not in floors]
    if missing:
        raise ValueError(f"{path}: [{g}] min_output_tok_s has no floor for concurrency "
                         f"{missing}")
    return SweepGateConfig(settings, floors,
                           per_key_floats(section, "max_ttft_p50_ms", path, g))


async def run_sweep_gate(ctx: GateContext, cfg: SweepGateConfig) -> GateOutcome:
    result = await run_sweep(ctx.target, cfg.settings, label="met", progress_stream=ctx.progress)
    checks = []
    for r in result.rungs:
        c = r.concurrency
        checks.append(Check.of(f"c{c}.errors", r.errors, "==", 0))
        checks.append(Check.of(f"c{c}.min_output_tokens", r.min_output_tokens, "==",
                               cfg.settings.osl))
        checks.append(Check.of(f"c{c}.output_tok_s", round(r.output_tok_s, 2), ">=",
                               cfg.min_tok_s[c]))
        if c in cfg.max_ttft_p50_ms:
            ttft = None if r.ttft_p50_ms is None else round(r.ttft_p50_ms, 1)
            checks.append(Check.of(f"c{c}.ttft_p50_ms", ttft, "<=", cfg.max_ttft_p50_ms[c]))
    return GateOutcome(metrics={"sweep": result.to_dict()}, checks=checks)


# ---------------------------------------------------------------- decode-floor


@dataclass(frozen=True)
class DecodeConfig:
    isl: int
    osl: int
    runs: int
    min_tok_s: float


def configure_decode(section: dict[str, Any], path: Path | None) -> DecodeConfig:
    g = "decode-floor"
    cfg = DecodeConfig(isl=get(section, "isl", 32, path, g), osl=get(section, "osl", 128, path, g),
                       runs=get(section, "runs", 3, path, g),
                       min_tok_s=float(require(section, "min_tok_s", path, g)))
    if cfg.osl < 2 or cfg.runs < 1:
        raise ValueError(f"{path}: [{g}] osl must be >= 2 and runs >= 1")
    return cfg


async def run_decode(ctx: GateContext, cfg: DecodeConfig) -> GateOutcome:
    shape = await measure_shape(ctx.client, ctx.target, cfg.isl)
    prompt = prompt_set(shape, cfg.isl, 1, seed=424242)[0]  # the same fixed prompt each run
    body = ctx.target.body(prompt, cfg.osl)
    results: list[RequestResult] = []
    with Progress(cfg.runs, "decode-floor", ctx.progress) as bar:
        for _ in range(cfg.runs):
            r = await stream_request(ctx.client, ctx.target, body)
            results.append(r)
            bar.update(r.ok)
    speeds = [r.decode_tok_s for r in results if r.ok and r.decode_tok_s]
    median = round(statistics.median(speeds), 2) if speeds else None
    errors = [r.error for r in results if not r.ok]
    return GateOutcome(
        metrics={"decode_tok_s_runs": [round(s, 2) for s in speeds], "decode_tok_s": median,
                 "output_tokens": [r.output_tokens for r in results],
                 "prompt_tokens": results[0].prompt_tokens, "errors": errors},
        checks=[Check.of("errors", len(errors), "==", 0),
                Check.of("decode_tok_s_median", median, ">=", cfg.min_tok_s)])


# ---------------------------------------------------------------- ttft-cold / ttft-warm


@dataclass(frozen=True)
class TtftConfig:
    gate: str
    lengths: tuple[int, ...]
    runs: int
    max_ttft_ms: dict[int, float]


def _configure_ttft(gate: str, section: dict[str, Any], path: Path | None) -> TtftConfig:
    lengths = tuple(int(n) for n in get(section, "lengths", [256, 1024, 4096], path, gate))
    cfg = TtftConfig(gate, lengths, get(section, "runs", 3, path, gate),
                     per_key_floats(section, "max_ttft_ms", path, gate))
    missing = [n for n in lengths if n not in cfg.max_ttft_ms]
    if missing:
        raise ValueError(f"{path}: [{gate}] max_ttft_ms has no ceiling for lengths {missing}")
    return cfg


def configure_ttft_cold(section: dict[str, Any], path: Path | None) -> TtftConfig:
    return _configure_ttft("ttft-cold", section, path)


def configure_ttft_warm(section: dict[str, Any], path: Path | None) -> TtftConfig:
    return _configure_ttft("ttft-warm", section, path)


def _fits(ctx: GateContext, length: int) -> bool:
    # Room for the prompt-length estimate's error and the one output token.
    return ctx.max_model_len is None or length <= int(ctx.max_model_len * 0.9) - 8


async def run_ttft(ctx: GateContext, cfg: TtftConfig) -> GateOutcome:
    """Cold: a fresh prompt per run (no cached prefix). Warm: one prompt sent once to fill
    the prefix cache, then timed ``runs`` times (all but its last block comes from cache)."""
    warm = cfg.gate == "ttft-warm"
    lengths = [n for n in cfg.lengths if _fits(ctx, n)]
    skipped = [n for n in cfg.lengths if n not in lengths]
    metrics: dict[str, Any] = {"skipped_lengths_over_max_model_len": skipped, "lengths": {}}
    checks: list[Check] = []
    shape = await measure_shape(ctx.client, ctx.target, max(lengths or [64]))
    with Progress(len(lengths) * cfg.runs, cfg.gate, ctx.progress) as bar:
        for li, n in enumerate(lengths):
            prompts = prompt_set(shape, n, cfg.runs, seed=31337 + li * 101 + (7 if warm else 0))
            if warm:
                prompts = [prompts[0]] * cfg.runs
                await stream_request(ctx.client, ctx.target, ctx.target.body(prompts[0], 1))
            results = []
            for p in prompts:
                r = await stream_request(ctx.client, ctx.target, ctx.target.body(p, 1))
                results.append(r)
                bar.update(r.ok)
            ttfts = [r.ttft * 1000 for r in results if r.ok and r.ttft is not None]
            median = round(statistics.median(ttfts), 1) if ttfts else None
            cached = [r.cached_tokens for r in results if r.ok]
            metrics["lengths"][str(n)] = {
                "ttft_ms_runs": [round(t, 1) for t in ttfts], "ttft_ms_median": median,
                "prompt_tokens": [r.prompt_tokens for r in results],
                "cached_tokens": cached, "errors": [r.error for r in results if not r.ok]}
            checks.append(Check.of(f"len{n}.errors", sum(not r.ok for r in results), "==", 0))
            checks.append(Check.of(f"len{n}.ttft_ms_median", median, "<=", cfg.max_ttft_ms[n]))
            if warm:
                # The warm number means nothing unless the prefix really came from cache.
                low = min((c or 0) for c in cached) if cached else 0
                checks.append(Check.of(f"len{n}.cached_tokens_min", low, ">=", n // 2))
    metrics["config"] = asdict(cfg) | {"max_ttft_ms": {str(k): v for k, v in
                                                      cfg.max_ttft_ms.items()}}
    return GateOutcome(metrics=metrics, checks=checks)


# ---------------------------------------------------------------- first-request


@dataclass(frozen=True)
class FirstRequestConfig:
    isl: int
    runs: int  # warm requests after the first
    max_ratio: float  # first TTFT / median warm TTFT


def configure_first_request(section: dict[str, Any], path: Path | None) -> FirstRequestConfig:
    g = "first-request"
    cfg = FirstRequestConfig(int(get(section, "isl", 110, path, g)),
                             int(get(section, "runs", 5, path, g)),
                             float(require(section, "max_ratio", path, g)))
    if cfg.runs < 1:
        raise ValueError(f"{path}: [{g}] runs must be >= 1")
    return cfg


async def run_first_request(ctx: GateContext, cfg: FirstRequestConfig) -> GateOutcome:
    """The first request the server ever serves, then ``runs`` more like it (fresh prompts
    of the same length, one token each): what a late kernel build would cost shows as a
    first TTFT far above the rest."""
    # No measure_shape here: its probes would be the first requests. ``isl`` words.
    prompts = [words(cfg.isl, 4242 + i) for i in range(cfg.runs + 1)]
    results: list[RequestResult] = []
    for p in prompts:
        results.append(await stream_request(ctx.client, ctx.target, ctx.target.body(p, 1)))
    first, rest = results[0], results[1:]
    warm = [r.ttft * 1000 for r in rest if r.ok and r.ttft is not None]
    first_ms = None if first.ttft is None else round(first.ttft * 1000, 1)
    warm_ms = round(statistics.median(warm), 1) if warm else None
    ratio = (round(first_ms / warm_ms, 3) if first_ms is not None and warm_ms else None)
    metrics = {"isl_words": cfg.isl, "prompt_tokens": first.prompt_tokens,
               "first_ttft_ms": first_ms, "warm_ttft_ms_runs": [round(t, 1) for t in warm],
               "warm_ttft_ms_median": warm_ms, "ratio": ratio}
    checks = [Check.of("errors", sum(not r.ok for r in results), "==", 0),
              Check.of("first_over_warm_ttft", ratio, "<=", cfg.max_ratio)]
    return GateOutcome(metrics=metrics, checks=checks)
