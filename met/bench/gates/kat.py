"""kat-equality: fixed prompts, greedy and seeded sampling, must come back byte-identical
whether sent one at a time, all at once, or all at once in reverse order."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from met.bench.floors import get
from met.bench.gates.base import GateContext, GateOutcome
from met.bench.loadgen import RequestResult, stream_request
from met.bench.progress import Progress
from met.bench.records import Check

KAT_PROMPTS = (
    "The capital of France is",
    "Write a short poem about the sea:",
    "def fibonacci(n):",
    "Three reasons to learn a second language are",
    "Once upon a time, in a small village by the river,",
    "The chemical formula of water is",
    "List the planets of the solar system:",
    "In 1969, the first person to walk on the moon",
)
PASSES = ("one_at_a_time", "all_at_once", "all_at_once_reversed")


@dataclass(frozen=True)
class KatConfig:
    prompts: int
    max_tokens: int
    temperature: float  # of the seeded half


def configure(section: dict[str, Any], path: Path | None) -> KatConfig:
    g = "kat-equality"
    cfg = KatConfig(prompts=get(section, "prompts", 8, path, g),
                    max_tokens=get(section, "max_tokens", 32, path, g),
                    temperature=float(get(section, "temperature", 0.8, path, g)))
    if not 2 <= cfg.prompts <= len(KAT_PROMPTS):
        raise ValueError(f"{path}: [{g}] prompts must be in 2..{len(KAT_PROMPTS)}")
    if cfg.max_tokens < 1:
        raise ValueError(f"{path}: [{g}] max_tokens must be >= 1")
    return cfg


def bodies(ctx: GateContext, cfg: KatConfig) -> list[dict[str, Any]]:
    """Even prompts greedy, odd ones sampled with their own seed."""
    out = []
    for i, prompt in enumerate(KAT_PROMPTS[: cfg.prompts]):
        extra: dict[str, Any] = {"temperature": 0.0} if i % 2 == 0 else {
            "temperature": cfg.temperature, "top_p": 0.95, "seed": 1234 + i}
        out.append(ctx.target.body(prompt, cfg.max_tokens, **extra))
    return out


async def _pass(ctx: GateContext, name: str, reqs: list[dict[str, Any]],
                bar: Progress) -> list[RequestResult]:
    async def one(i: int) -> RequestResult:
        r = await stream_request(ctx.client, ctx.target, reqs[i])
        bar.update(r.ok)
        return r

    order = list(range(len(reqs)))
    if name == "one_at_a_time":
        return [await one(i) for i in order]
    if name == "all_at_once_reversed":
        order.reverse()
    tasks = {i: asyncio.ensure_future(one(i)) for i in order}  # submitted in `order`
    return [await tasks[i] for i in range(len(reqs))]


def _first_difference(a: str, b: str) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


async def run(ctx: GateContext, cfg: KatConfig) -> GateOutcome:
    reqs = bodies(ctx, cfg)
    texts: dict[str, list[str | None]] = {}
    errors: list[str] = []
    with Progress(len(reqs) * len(PASSES), "kat-equality", ctx.progress) as bar:
        for name in PASSES:
            results = await _pass(ctx, name, reqs, bar)
            texts[name] = [r.text if r.ok else None for r in results]
            errors += [f"{name} prompt {i}: {r.error}" for i, r in enumerate(results)
                       if not r.ok]
    mismatches = []
    base = texts[PASSES[0]]
    for name in PASSES[1:]:
        for i, (a, b) in enumerate(zip(base, texts[name], strict=True)):
            if a is not None and b is not None and a != b:
                at = _first_difference(a, b)
                mismatches.append({"prompt": i, "pass": name, "first_difference_at": at,
                                   PASSES[0]: a[max(0, at - 20): at + 40],
                                   name: b[max(0, at - 20): at + 40]})
    empty = sum(1 for t in base if t == "")
    metrics = {"prompts": cfg.prompts, "max_tokens": cfg.max_tokens,
               "texts": {str(i): t for i, t in enumerate(base)}, "mismatches": mismatches,
               "errors": errors}
    checks = [Check.of("errors", len(errors), "==", 0),
              Check.of("mismatched_outputs", len(mismatches), "==", 0),
              Check.of("empty_outputs", empty, "==", 0)]
    return GateOutcome(metrics=metrics, checks=checks)
