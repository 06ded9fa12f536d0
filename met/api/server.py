"""`met serve`: uvicorn around the app, with a graceful drain on SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import gc
import ipaddress
import logging
import signal
import socket
import threading
from collections.abc import Callable, Generator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import replace
from types import FrameType

import uvicorn
from fastapi import FastAPI

from met.api.app import build_app
from met.api.context import ServerConfig
from met.api.model_pool import ModelPool, PoolConfig
from met.config import EngineConfig
from met.engine.async_engine import AsyncEngine
from met.engine.core import EngineCore

log = logging.getLogger("met.api")


# After the drain deadline has failed the requests left, how long their responses get to
# send the error and close before uvicorn cancels what remains.
_CLOSE_GRACE_S = 5.0


class _DrainingServer(uvicorn.Server):
    """The first SIGINT/SIGTERM stops accepting connections and lets in-flight requests
    finish for up to ``drain_timeout`` seconds; then every request still running is ended
    with an error (an error event on a stream, a 500 otherwise) so no client hangs. A second
    SIGINT forces the exit. Unlike plain uvicorn it does not re-raise the signal afterwards,
    so a drained exit is status 0."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine | ModelPool,
                 drain_timeout: float):
        super().__init__(config)
        self.engine = engine
        self.drain_timeout = drain_timeout

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        deadline = asyncio.create_task(self._fail_after_deadline())
        try:
            await super().shutdown(sockets)
        finally:
            deadline.cancel()

    async def _fail_after_deadline(self) -> None:
        await asyncio.sleep(self.drain_timeout)
        n = self.engine.fail_all(f"the server is shutting down (--shutdown-timeout "
                                 f"{self.drain_timeout:g} s passed)")
        if n:
            log.warning("met: shutdown timeout: ended %d in-flight request(s) with an error", n)

    @contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        sigs = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in sigs}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit:
            log.info("met: %s received — draining in-flight requests (Ctrl-C again to force)",
                     signal.Signals(sig).name)
        super().handle_exit(sig, frame)


def binds_all_interfaces(host: str) -> bool:
    """Whether ``host`` is a wildcard address (0.0.0.0, ::, or an empty host)."""
    if host in ("", "*"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return False  # a host name: whatever it resolves to, not every interface


def _server_core(engine_config: EngineConfig) -> EngineCore:
    """The server's engine, with what loading left frozen out of Python's cycle collector:
    ~330K objects (tokenizer tables, GGUF metadata) that a full collection walked in ~150 ms
    while every stream waited (measured on the embedded model, 2-core Zen 3). None of them
    turns to garbage while the process serves; later objects are collected as before."""
    core = EngineCore(engine_config)
    gc.collect()
    gc.freeze()
    return core


def port_taken(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be listened on, or None. Bound as uvicorn binds
    (SO_REUSEADDR), so only a listener counts as taken, not a socket in TIME_WAIT."""
    if not port:
        return None
    host = host.strip("[]")  # "[::]" as in a URL
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            return e.strerror or str(e)
    return None


def serve(engine_config: EngineConfig, config: ServerConfig,
          attach: Callable[[uvicorn.Server, FastAPI], AbstractContextManager] | None = None,
          models: dict[str, str] | None = None, pool_config: PoolConfig | None = None
          ) -> int:
    """Run the server until a signal drains it; 1 if the model failed to load. ``attach``
    (the CLI's terminal dashboard) is entered around the run with the server and its app.
    ``models`` (name → path, --models-dir): serve them all, loaded on demand, instead of
    ``engine_config.model``; every model gets ``engine_config`` with its own path."""
    failed = threading.Event()
    server: _DrainingServer | None = None

    def on_fatal() -> None:
        failed.set()
        if server is not None:
            server.should_exit = True

    engine: AsyncEngine | ModelPool
    if models is not None:
        # No gc.freeze here (unlike one model): an unloaded model's objects must stay
        # collectable.
        engine = ModelPool(models, config, pool_config or PoolConfig(),
                           lambda path: EngineCore(replace(engine_config, model=path)))
        app = build_app(config, None, pool=engine)
    else:
        engine = AsyncEngine(lambda: _server_core(engine_config))
        app = build_app(config, engine, on_fatal)
    server = _DrainingServer(uvicorn.Config(
        app, host=config.host, port=config.port, log_config=None,
        access_log=config.log_requests, lifespan="on",
        timeout_graceful_shutdown=config.shutdown_timeout + _CLOSE_GRACE_S,
    ), engine, config.shutdown_timeout)
    if binds_all_interfaces(config.host):
        log.warning("met: binding %s exposes the server on every network interface%s; use "
                    "--host 127.0.0.1 to serve this machine only", config.host,
                    "" if config.api_keys else " WITHOUT an API key (--api-key)")
    taken = port_taken(config.host, config.port)
    if taken is not None:  # before the model loads: a user should not wait to learn this
        log.error("met: cannot listen on %s:%s (%s); pick another --port or stop what "
                  "holds it", config.host, config.port, taken)
        return 1
    port = str(config.port) if config.port else "<a free port>"
    if models is not None:
        log.info("met: serving %d models on http://%s:%s, each loaded when a request names it "
                 "(dtype %s): %s", len(models), config.host, port, engine_config.dtype,
                 ", ".join(models))
    else:
        log.info("met: serving %r on http://%s:%s — loading %s (dtype %s) in the background; "
                 "/health answers 503 until it is ready", config.model_name, config.host,
                 port, engine_config.model or "the embedded model", engine_config.dtype)
    with attach(server, app) if attach is not None else nullcontext():
        server.run()
    return 1 if failed.is_set() else 0
