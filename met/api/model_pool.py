"""Several models in one server (`met serve --models-dir`): one engine per loaded model.

Each model has its own AsyncEngine and ServerContext (so its KV pool and prefix cache are its
own by construction); the pool loads a model when a request names it, unloads the least
recently used idle one when ``--max-loaded-models`` are loaded, and unloads a model idle for
``--idle-unload-seconds``. A request holds a lease on its model from routing to the last byte
of its response (model_router.py): a model with a lease is never unloaded. When every loaded
model is busy, a load waits for one to become idle; the client waits at most
``--model-load-timeout`` seconds (then a 503 that says why), and the load, once started,
still finishes. Loads run one at a time (two weights being read at once would only compete
for the same memory and disk).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace

from prometheus_client import CollectorRegistry, Counter, Gauge

from met.api.context import ServerConfig, ServerContext
from met.api.errors import ApiError
from met.api.ratelimit import RateLimiter
from met.engine.async_engine import AsyncEngine, EngineState
from met.engine.core import EngineCore
from met.serving.errors import InvalidRequest
from met.serving.response_store import ResponseStore

log = logging.getLogger("met.api")

LOADED, LOADING, UNLOADING, UNLOADED, FAILED = (
    "loaded", "loading", "unloading", "unloaded", "failed")
MODEL_STATES = (LOADED, LOADING, UNLOADING, UNLOADED, FAILED)


@dataclass(frozen=True)
class PoolConfig:
    """The router's flags."""

    max_loaded_models: int = 4  # --max-loaded-models
    idle_unload_seconds: float | None = None  # --idle-unload-seconds (None: never)
    load_timeout: float = 300.0  # --model-load-timeout: how long a request waits for a load

    def __post_init__(self) -> None:
        if self.max_loaded_models < 1:
            raise ValueError(f"--max-loaded-models: must be >= 1, got {self.max_loaded_models}")
        if self.idle_unload_seconds is not None and not self.idle_unload_seconds > 0:
            raise ValueError(f"--idle-unload-seconds: must be > 0 seconds, got "
                             f"{self.idle_unload_seconds}")
        if not self.load_timeout > 0:
            raise ValueError(f"--model-load-timeout: must be > 0 seconds, got "
                             f"{self.load_timeout}")


@dataclass(eq=False)
class ModelEntry:
    """One model the pool can serve, and where it stands."""

    name: str
    path: str  # what the loader gets (a checkpoint dir, a .gguf file or an HF-cache id)
    state: str = UNLOADED
    ctx: ServerContext | None = None  # while loaded (or loading)
    error: str | None = None  # why the last load failed
    leases: int = 0  # requests routed to it (waiting for its load, or being served)
    last_used: float = field(default_factory=time.monotonic)
    load_task: asyncio.Task | None = None

    def busy(self) -> bool:
        return self.leases > 0 or (self.ctx is not None and self.ctx.has_pending_requests())


class _PoolMetrics:
    """The pool's own series (the loaded models' come from their contexts)."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.loaded = Gauge("met_models_loaded", "Models loaded now (--models-dir)",
                            registry=r)
        self.state = Gauge("met_model_state", "Each model (value 1) and its state: "
                           + ", ".join(MODEL_STATES), ["model_name", "state"], registry=r)
        self.loads = Counter("met_model_loads", "Model loads finished, by outcome",
                             ["model_name", "outcome"], registry=r)
        self.unloads = Counter("met_model_unloads", "Model unloads, by reason (lru, idle, "
                               "request, shutdown)", ["model_name", "reason"], registry=r)


class ModelPool:
    """name → model; loads and unloads them on the HTTP loop (the engines run in their own
    threads). ``core_factory(path)`` builds a model's EngineCore in its engine thread."""

    def __init__(self, models: dict[str, str], config: ServerConfig, pool: PoolConfig,
                 core_factory: Callable[[str], EngineCore]):
        if not models:
            raise ValueError("--models-dir: no model to serve")
        self.config = config
        self.pool = pool
        self._core_factory = core_factory
        self.entries = {name: ModelEntry(name, path) for name, path in models.items()}
        self.created = int(time.time())
        self.metrics = _PoolMetrics()
        # Shared by every model: a key's rate limit and its stored responses are the server's.
        self.rate_limiter = RateLimiter(config.rate_limit_rpm, config.rate_limit_tpm)
        self.response_store = ResponseStore(config.responses_store_max,
                                            config.responses_store_ttl)
        self._load_lock = asyncio.Lock()
        self._changed = asyncio.Condition()  # a lease ended or a model unloaded
        self._reaper: asyncio.Task | None = None
        self._closing = False
        for e in self.entries.values():
            self._publish_state(e)

    # ------------------------------------------------------------------ lookups

    def names(self) -> list[str]:
        return list(self.entries)

    def entry(self, name: object, param: str = "model") -> ModelEntry:
        """The entry ``name`` names, or a 404 naming ``param`` and listing what exists."""
        if not isinstance(name, str) or name not in self.entries:
            served = ", ".join(repr(n) for n in self.entries)
            raise InvalidRequest(f"{param}: the model {name!r} does not exist (this server "
                                 f"serves {served})", param, "model_not_found", 404)
        return self.entries[name]

    def loaded(self) -> list[ModelEntry]:
        return [e for e in self.entries.values() if e.state == LOADED]

    def contexts(self) -> list[ServerContext]:
        """The contexts of the models loaded now."""
        return [e.ctx for e in self.loaded() if e.ctx is not None]

    # ------------------------------------------------------------------ lifetime

    def start(self) -> None:
        """Start the idle reaper (call on the server's loop)."""
        if self.pool.idle_unload_seconds is not None:
            self._reaper = asyncio.create_task(self._reap(self.pool.idle_unload_seconds))

    async def shutdown(self) -> None:
        """Stop the reaper and every engine (loads in progress finish first)."""
        self._closing = True
        if self._reaper is not None:
            self._reaper.cancel()
        for e in self.entries.values():
            if e.load_task is not None:
                await asyncio.gather(e.load_task, return_exceptions=True)
        for e in self.entries.values():
            if e.state == LOADED:
                await self._unload(e, "shutdown")

    def fail_all(self, message: str) -> int:
        """End every in-flight request of every model with ``message`` (the drain deadline)."""
        return sum(ctx.engine.fail_all(message) for ctx in self.contexts())

    # ------------------------------------------------------------------ requests

    @asynccontextmanager
    async def use(self, name: str) -> AsyncIterator[ServerContext]:
        """The loaded model ``name``'s context (loading it first, waiting at most
        --model-load-timeout), leased until the block ends."""
        entry = self.entry(name)
        entry.leases += 1  # before the load: what a request waits for is never evicted
        try:
            ctx = await self._ready(entry, self.pool.load_timeout)
            yield ctx
        finally:
            entry.leases -= 1
            entry.last_used = time.monotonic()
            async with self._changed:
                self._changed.notify_all()

    async def _ready(self, entry: ModelEntry, timeout: float) -> ServerContext:
        if entry.state == FAILED and entry.load_task is None:
            raise ApiError(503, f"model: {entry.name!r} failed to load: {entry.error} "
                           "(POST /models/load retries)", "model", "model_load_failed")
        if entry.state != LOADED or entry.ctx is None:
            task = self.start_load(entry)
            try:
                await asyncio.wait_for(asyncio.shield(task), timeout)
            except TimeoutError:
                raise ApiError(503, f"model: {entry.name!r} is not loaded after "
                               f"{timeout:g} s (--model-load-timeout){self._why_slow()}; it "
                               "keeps loading, retry shortly", "model", "model_load_timeout",
                               {"Retry-After": "5"}) from None
            if entry.state != LOADED or entry.ctx is None:
                raise ApiError(503, f"model: {entry.name!r} failed to load: {entry.error}",
                               "model", "model_load_failed")
        return entry.ctx

    def _why_slow(self) -> str:
        if len(self.loaded()) >= self.pool.max_loaded_models and all(
                e.busy() for e in self.loaded()):
            return (f", waiting for one of the {self.pool.max_loaded_models} loaded models "
                    "(--max-loaded-models) to finish its requests")
        return ""

    # ------------------------------------------------------------------ load / unload

    def start_load(self, entry: ModelEntry) -> asyncio.Task:
        """The task loading ``entry`` (the running one, or a new one)."""
        if entry.load_task is None:
            if self._closing:
                raise ApiError(503, "the server is shutting down", None, "shutting_down")
            entry.state, entry.error = LOADING, None
            self._publish_state(entry)
            entry.load_task = asyncio.create_task(self._load(entry))
        return entry.load_task

    async def _load(self, entry: ModelEntry) -> None:
        engine: AsyncEngine | None = None
        try:
            async with self._load_lock:
                await self._make_room(entry)
                engine = AsyncEngine(lambda: self._core_factory(entry.path))
                ctx = ServerContext(replace(self.config, served_model_names=(entry.name,)),
                                    engine, self.rate_limiter, self.response_store)
                log.info("met: loading model %r from %s", entry.name, entry.path)
                engine.start()
                await engine.wait_ready()
                if engine.state != EngineState.READY:
                    raise RuntimeError(engine.fault_reason or "unknown error")
                ctx.on_engine_ready()
                entry.ctx, entry.state, entry.last_used = ctx, LOADED, time.monotonic()
                self.metrics.loads.labels(model_name=entry.name, outcome="loaded").inc()
                log.info("met: model %r loaded in %.1fs", entry.name, engine.load_seconds or 0)
        except (Exception, asyncio.CancelledError) as e:
            entry.ctx, entry.state, entry.error = None, FAILED, str(e) or type(e).__name__
            self.metrics.loads.labels(model_name=entry.name, outcome="failed").inc()
            log.error("met: model %r failed to load: %s", entry.name, entry.error)
            if engine is not None:
                await engine.shutdown()  # its thread ends even when the load failed
            if isinstance(e, asyncio.CancelledError):
                raise
        finally:
            entry.load_task = None
            self._publish_state(entry)

    async def _make_room(self, entry: ModelEntry) -> None:
        """Unload the least recently used idle model while the pool is full; when every
        loaded model is busy, wait until one is not."""
        while len(self.loaded()) >= self.pool.max_loaded_models:
            idle = [e for e in self.loaded() if e is not entry and not e.busy()]
            if idle:
                await self._unload(min(idle, key=lambda e: e.last_used), "lru")
                continue
            async with self._changed:
                # Woken by a lease ending; the timeout catches a generation that finished
                # without one (no lease is taken outside the router, but cheap to be safe).
                try:
                    await asyncio.wait_for(self._changed.wait(), 1.0)
                except TimeoutError:
                    pass

    async def unload(self, name: str) -> bool:
        """POST /models/unload: False when it was not loaded; 409 while it has requests."""
        entry = self.entry(name)
        if entry.load_task is not None:
            raise ApiError(409, f"model: {name!r} is loading; unload it once it has loaded",
                           "model", "model_busy")
        if entry.state != LOADED:
            return False
        if entry.busy():
            raise ApiError(409, f"model: {name!r} has requests in flight; unload it once they "
                           "finish", "model", "model_busy")
        await self._unload(entry, "request")
        return True

    async def _unload(self, entry: ModelEntry, reason: str) -> None:
        """Stop the engine (its thread ends), then drop every reference to it, so its KV
        pool and weights are freed here, not whenever a collection comes."""
        ctx, entry.ctx = entry.ctx, None
        entry.state = UNLOADING
        self._publish_state(entry)
        if ctx is not None:
            await ctx.engine.shutdown()
            del ctx
        gc.collect()
        _empty_device_cache()
        entry.state = UNLOADED
        self._publish_state(entry)
        self.metrics.unloads.labels(model_name=entry.name, reason=reason).inc()
        log.info("met: model %r unloaded (%s)", entry.name, reason)
        async with self._changed:
            self._changed.notify_all()

    async def _reap(self, idle_s: float) -> None:
        """Unload each model idle for ``idle_s`` seconds (checked a few times per period)."""
        while True:
            await asyncio.sleep(min(1.0, idle_s / 4))
            now = time.monotonic()
            for e in self.loaded():
                if not e.busy() and now - e.last_used >= idle_s:
                    await self._unload(e, "idle")

    def _publish_state(self, entry: ModelEntry) -> None:
        for state in MODEL_STATES:
            self.metrics.state.labels(model_name=entry.name, state=state).set(
                1 if state == entry.state else 0)
        self.metrics.loaded.set(len(self.loaded()))


def _empty_device_cache() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
