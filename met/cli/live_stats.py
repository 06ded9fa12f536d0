"""What the serve dashboard shows, sampled in-process from the server's own objects.

Everything is read, never written: the engine thread's published `EngineStats`, the
metrics registry's counters and recent latencies, and the live generations. The sampler
runs on the dashboard's thread, so a container that changes under it is retried next tick.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from met.engine.async_engine import EngineState

# Finish reasons that count as failures on the dashboard (the rest are "finished", except
# aborts: a client that went away or pressed stop).
_FAILED = ("error", "timeout")


@dataclass(frozen=True)
class LiveRequest:
    id: str
    client: str
    state: str  # "waiting" (no token yet) or "decoding"
    prompt_tokens: int
    tokens: int
    tok_s: float
    age_s: float


@dataclass(frozen=True)
class Snapshot:
    state: str  # loading / ready / faulted / stopped / draining
    model: str
    root: str
    dtype: str
    quantization: str
    device: str
    kernels: dict[str, str]
    url: str
    auth: str
    uptime_s: float
    running: int = 0
    waiting: int = 0
    finished: int = 0
    failed: int = 0
    aborted: int = 0
    prompt_tps: float = 0.0
    decode_tps: float = 0.0
    decode_history: tuple[float, ...] = ()
    prompt_history: tuple[float, ...] = ()
    ttft: tuple[float, float] | None = None  # (p50, p99) seconds
    tpot: tuple[float, float] | None = None
    kv_used: int = 0
    kv_total: int = 0
    prefix_hit_rate: float | None = None
    preemptions: int = 0
    live: tuple[LiveRequest, ...] = field(default=())


class ClientTracker:
    """ASGI middleware that remembers each in-flight HTTP request's scope, so the dashboard
    can name the client behind a request id (the id is set inside, on the same scope)."""

    def __init__(self, app: Any, scopes: dict[int, dict]):
        self.app = app
        self.scopes = scopes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        self.scopes[id(scope)] = scope
        try:
            await self.app(scope, receive, send)
        finally:
            self.scopes.pop(id(scope), None)


def clients_by_request_id(scopes: dict[int, dict]) -> dict[str, str]:
    out = {}
    for scope in list(scopes.values()):
        rid = (scope.get("state") or {}).get("request_id")
        client = scope.get("client")
        if rid and client:
            out[rid] = f"{client[0]}:{client[1]}"
    return out


def percentiles(values: list[float]) -> tuple[float, float] | None:
    """(p50, p99) by nearest rank; None without samples."""
    if not values:
        return None
    s = sorted(values)

    def rank(q: float) -> float:
        return s[min(len(s), max(1, math.ceil(q * len(s)))) - 1]

    return rank(0.50), rank(0.99)


def _counters(registry: Any) -> dict[str, dict[str, float]]:
    """{metric sample name: {finish_reason or "": value}} for met's counters."""
    out: dict[str, dict[str, float]] = {}
    for metric in registry.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total"):
                out.setdefault(sample.name, {})[sample.labels.get("finish_reason", "")] = \
                    sample.value
    return out


class StatsSampler:
    """Turns the server's counters into rates and a Snapshot; call ``sample()`` per tick."""

    HISTORY = 60  # sparkline samples (one per second)
    WINDOW_S = 2.0  # rates are averaged over this long

    def __init__(self, ctx: Any, scopes: dict[int, dict], url: str = "",
                 clock=time.monotonic):
        self.ctx = ctx
        self.scopes = scopes
        self.url = url
        self.clock = clock
        self.started = clock()
        self.draining = False
        self._totals: deque[tuple[float, float, float]] = deque()  # (t, prompt, generated)
        self._max_prompt = self._max_generated = 0.0
        self._decode_hist: deque[float] = deque(maxlen=self.HISTORY)
        self._prompt_hist: deque[float] = deque(maxlen=self.HISTORY)
        self._last_hist = self.started
        self._last: Snapshot | None = None

    def sample(self) -> Snapshot:
        try:
            snap = self._sample()
        except RuntimeError:  # a dict or deque changed size while we read it: next tick
            if self._last is None:
                raise
            return self._last
        self._last = snap
        return snap

    def _sample(self) -> Snapshot:
        now = self.clock()
        ctx, engine = self.ctx, self.ctx.engine
        config, model = ctx.config, ctx.model
        stats = engine.stats
        counters = _counters(ctx.metrics.registry)
        by_reason = counters.get("met_requests_total", {})
        gens = ctx.live_generations()
        live_prompt = sum(len(g.prompts[c.prompt_index].token_ids) for g in gens
                          for c in g.choices if c.index % g.n == 0 and c.first_token_at)
        prompt_total = max(self._max_prompt, _one(counters, "met_prompt_tokens_total")
                           + live_prompt)
        gen_total = max(self._max_generated, _one(counters, "met_generation_tokens_total")
                        + sum(g.completion_tokens for g in gens))
        self._max_prompt, self._max_generated = prompt_total, gen_total
        prompt_tps, decode_tps = self._rates(now, prompt_total, gen_total)
        queries = _one(counters, "met_prefix_cache_queries_total")
        core = engine.core
        state = engine.state
        if self.draining and state == EngineState.READY:
            state = "draining"
        return Snapshot(
            state=state, model=config.model_name,
            root=model.root if model else "", dtype=model.dtype if model else "",
            quantization=model.quantization if model else "",
            device=str(core.config.device) if core is not None else "",
            kernels=dict(stats.kernels), url=self.url,
            auth=(f"on ({len(config.api_keys)} API key{'s' * (len(config.api_keys) > 1)})"
                  if config.api_keys else "off"),
            uptime_s=now - self.started,
            running=stats.num_running, waiting=stats.num_waiting,
            finished=int(sum(v for r, v in by_reason.items()
                             if r not in _FAILED and r != "abort")),
            failed=int(sum(by_reason.get(r, 0) for r in _FAILED)),
            aborted=int(by_reason.get("abort", 0)),
            prompt_tps=prompt_tps, decode_tps=decode_tps,
            decode_history=tuple(self._decode_hist), prompt_history=tuple(self._prompt_hist),
            ttft=percentiles(list(ctx.metrics.recent_ttft)),
            tpot=percentiles(list(ctx.metrics.recent_tpot)),
            kv_used=stats.kv.num_blocks_in_use if stats.kv else 0,
            kv_total=stats.kv.num_blocks_total if stats.kv else 0,
            prefix_hit_rate=(_one(counters, "met_prefix_cache_hits_total") / queries
                             if queries else None),
            preemptions=stats.num_preemptions,
            live=self._live(gens, now),
        )

    def _rates(self, now: float, prompt: float, generated: float) -> tuple[float, float]:
        self._totals.append((now, prompt, generated))
        while len(self._totals) > 2 and now - self._totals[1][0] >= self.WINDOW_S:
            self._totals.popleft()
        t0, p0, g0 = self._totals[0]
        dt = now - t0
        rates = ((prompt - p0) / dt, (generated - g0) / dt) if dt > 0 else (0.0, 0.0)
        if now - self._last_hist >= 1.0:
            self._last_hist = now
            self._prompt_hist.append(rates[0])
            self._decode_hist.append(rates[1])
        return rates

    def _live(self, gens: list, now: float) -> tuple[LiveRequest, ...]:
        clients = clients_by_request_id(self.scopes)
        rows = []
        for g in sorted(gens, key=lambda g: g.arrival):
            started = [c for c in g.choices if c.first_token_at is not None]
            tok_s = 0.0
            for c in started:
                if c.num_tokens > 1 and c.last_token_at and c.last_token_at > c.first_token_at:
                    tok_s += (c.num_tokens - 1) / (c.last_token_at - c.first_token_at)
            rows.append(LiveRequest(
                id=g.request_id, client=clients.get(g.request_id, "-"),
                state="decoding" if started else "waiting", prompt_tokens=g.prompt_tokens,
                tokens=g.completion_tokens, tok_s=tok_s, age_s=now - g.arrival))
        return tuple(rows)


def _one(counters: dict[str, dict[str, float]], name: str) -> float:
    return sum(counters.get(name, {}).values())
