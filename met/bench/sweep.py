"""The concurrency ladder: at each rung, ``concurrency`` clients each send ``reps`` streamed
requests back to back (a closed loop), and the rung's statistics are taken over all of them.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from typing import Any, TextIO

import httpx
from prometheus_client.parser import text_string_to_metric_families

from met.bench.loadgen import RequestResult, Target, stream_request
from met.bench.progress import Progress
from met.bench.prompts import WORKLOADS, PromptShape, measure_shape, prompt_set
from met.bench.stats import RungStats, rung_stats

SWEEP_KIND = "met-bench-sweep"


@dataclass(frozen=True)
class SweepSettings:
    """What a sweep sends. Validated here so a bad flag fails before any request."""

    concurrency: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    isl: int = 128  # prompt tokens (approximately; the measured mean is reported)
    osl: int = 128  # output tokens per request (max_tokens, with ignore_eos)
    reps: int = 1  # requests per client per rung
    warmup: int = 1  # unmeasured requests before the ladder
    seed: int = 0  # prompts are the same for the same seed
    timeout: float = 600.0  # per request, seconds
    temperature: float = 0.0  # 0: greedy; else the requests sample (with top_p / top_k)
    top_p: float = 1.0
    top_k: int = 0  # 0: off (not sent)
    workload: str = "random"  # what the prompts are (met.bench.prompts.WORKLOADS)

    def __post_init__(self) -> None:
        if self.workload not in WORKLOADS:
            raise ValueError(f"--workload: must be one of {', '.join(WORKLOADS)}, got "
                             f"{self.workload!r}")
        if not self.concurrency or any(c < 1 for c in self.concurrency):
            raise ValueError(f"--concurrency: a comma list of integers >= 1, "
                             f"got {self.concurrency!r}")
        for name in ("isl", "osl", "reps"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name}: must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise ValueError(f"--warmup: must be >= 0, got {self.warmup}")
        if self.timeout <= 0:
            raise ValueError(f"--timeout: must be > 0, got {self.timeout}")
        if self.temperature < 0:
            raise ValueError(f"--temperature: must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p: must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"--top-k: must be >= 0, got {self.top_k}")

    def sampling(self) -> dict[str, Any]:
        """The request fields for the sampling settings (greedy sends temperature 0 only)."""
        fields: dict[str, Any] = {"temperature": self.temperature}
        if self.temperature > 0 and self.top_p < 1:
            fields["top_p"] = self.top_p
        if self.temperature > 0 and self.top_k > 0:
            fields["top_k"] = self.top_k
        return fields


@dataclass
class SweepResult:
    """A whole sweep, as written by ``--out`` and read by ``compare``."""

    label: str
    url: str
    model: str
    endpoint: str
    settings: SweepSettings
    rungs: list[RungStats] = field(default_factory=list)
    prompt_shape: PromptShape | None = None
    created_at: str = field(default_factory=lambda: datetime.now(UTC).isoformat(
        timespec="seconds"))

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": SWEEP_KIND, "label": self.label, "url": self.url, "model": self.model,
            "endpoint": self.endpoint, "created_at": self.created_at,
            "settings": asdict(self.settings),
            "prompt_shape": asdict(self.prompt_shape) if self.prompt_shape else None,
            "rungs": [r.to_dict() for r in self.rungs],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SweepResult:
        if data.get("kind") != SWEEP_KIND:
            raise ValueError(f"not a `met bench sweep` result (kind={data.get('kind')!r})")
        s = dict(data["settings"])
        s["concurrency"] = tuple(s["concurrency"])
        shape = data.get("prompt_shape")
        return cls(label=data["label"], url=data["url"], model=data["model"],
                   endpoint=data["endpoint"], settings=SweepSettings(**s),
                   rungs=[RungStats.from_dict(r) for r in data["rungs"]],
                   prompt_shape=PromptShape(**shape) if shape else None,
                   created_at=data.get("created_at", ""))


async def run_batch(client: httpx.AsyncClient, target: Target, bodies: list[dict[str, Any]],
                    concurrency: int, timeout: float,
                    progress: Progress | None = None) -> tuple[list[RequestResult], float]:
    """Send ``bodies`` with at most ``concurrency`` in flight; results in body order and the
    wall time from the first send to the last finish."""
    results: list[RequestResult | None] = [None] * len(bodies)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(bodies)):
        queue.put_nowait(i)

    async def worker() -> None:
        while True:
            try:
                i = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            results[i] = r = await stream_request(client, target, bodies[i], timeout)
            if progress is not None:
                progress.update(r.ok)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(bodies)))))
    return [r for r in results if r is not None], time.perf_counter() - start


_SPEC_COUNTERS = {"met_spec_decode_num_draft_tokens": "drafted",
                  "met_spec_decode_num_accepted_tokens": "accepted",
                  "met_spec_decode_num_verifies": "verifies"}


async def spec_counters(client: httpx.AsyncClient,
                        target: Target) -> dict[str, dict[str, float]] | None:
    """A met server's speculative decoding totals per method from /metrics; None where the
    server has none (speculation off, or another engine)."""
    try:
        r = await client.get(f"{target.root}/metrics", headers=target.headers())
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    out: dict[str, dict[str, float]] = {}
    try:
        for family in text_string_to_metric_families(r.text):
            for sample in family.samples:
                key = _SPEC_COUNTERS.get(sample.name)
                if key is not None:
                    out.setdefault(sample.labels.get("method", "?"), {})[key] = sample.value
    except ValueError:  # not Prometheus text (another engine's page)
        return None
    return out or None


def spec_delta(before: dict | None, after: dict | None) -> dict[str, dict[str, float]] | None:
    """What a rung drafted and accepted per method, with its acceptance rate and mean
    accepted length (tokens a verifying request gained per step)."""
    if not after:
        return None
    out = {}
    for method, now in after.items():
        was = (before or {}).get(method, {})
        d = {k: now.get(k, 0.0) - was.get(k, 0.0) for k in ("drafted", "accepted", "verifies")}
        d["acceptance_rate"] = d["accepted"] / d["drafted"] if d["drafted"] else 0.0
        d["mean_accepted_length"] = 1 + d["accepted"] / d["verifies"] if d["verifies"] else 0.0
        out[method] = d
    return out


def new_client(max_concurrency: int) -> httpx.AsyncClient:
    """An async client with room for every stream of the largest rung."""
    limits = httpx.Limits(max_connections=max_concurrency + 8,
                          max_keepalive_connections=max_concurrency + 8)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(600.0, connect=30.0))


async def run_sweep(target: Target, settings: SweepSettings, label: str | None = None,
                    progress_stream: TextIO | None = None) -> SweepResult:
    """Run the ladder against ``target``; one RungStats per concurrency, in the given order."""
    result = SweepResult(label=label or f"{target.model}@{target.root}", url=target.root,
                         model=target.model, endpoint=target.endpoint, settings=settings)
    async with new_client(max(settings.concurrency)) as client:
        shape = await measure_shape(client, target, settings.isl,
                                    workload=settings.workload)
        result.prompt_shape = shape
        if settings.warmup:
            prompts = prompt_set(shape, settings.isl, settings.warmup, seed=settings.seed + 997,
                                 workload=settings.workload)
            bodies = [target.body(p, settings.osl, **settings.sampling()) for p in prompts]
            with Progress(len(bodies), "warmup", progress_stream) as bar:
                await run_batch(client, target, bodies, max(settings.concurrency),
                                settings.timeout, bar)
        for rung, c in enumerate(settings.concurrency):
            n = c * settings.reps
            prompts = prompt_set(shape, settings.isl, n, seed=settings.seed * 7919 + rung + 1,
                                 workload=settings.workload)
            bodies = [target.body(p, settings.osl, **settings.sampling()) for p in prompts]
            before = await spec_counters(client, target)
            with Progress(n, f"concurrency {c:>3}", progress_stream) as bar:
                results, wall = await run_batch(client, target, bodies, c, settings.timeout,
                                                bar)
            spec = spec_delta(before, await spec_counters(client, target))
            result.rungs.append(replace(rung_stats(c, results, wall), spec=spec))
    return result
