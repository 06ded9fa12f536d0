"""`met serve`: uvicorn around the app, with a graceful drain on SIGINT/SIGTERM."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Generator
from contextlib import contextmanager
from types import FrameType

import uvicorn

from met.api.app import build_app
from met.api.context import ServerConfig
from met.config import EngineConfig
from met.engine.async_engine import AsyncEngine
from met.engine.core import EngineCore

log = logging.getLogger("met.api")


class _DrainingServer(uvicorn.Server):
    """The first SIGINT/SIGTERM stops accepting connections and lets in-flight requests
    finish (uvicorn's graceful shutdown); a second SIGINT forces the exit. Unlike plain
    uvicorn it does not re-raise the signal afterwards, so a drained exit is status 0."""

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


def serve(engine_config: EngineConfig, config: ServerConfig) -> int:
    """Run the server until a signal drains it; 1 if the model failed to load."""
    engine = AsyncEngine(lambda: EngineCore(engine_config))
    failed = threading.Event()
    server: _DrainingServer | None = None

    def on_fatal() -> None:
        failed.set()
        if server is not None:
            server.should_exit = True

    app = build_app(config, engine, on_fatal)
    server = _DrainingServer(uvicorn.Config(
        app, host=config.host, port=config.port, log_config=None,
        access_log=config.log_requests, lifespan="on", timeout_graceful_shutdown=None,
    ))
    port = str(config.port) if config.port else "<a free port>"
    log.info("met: serving %r on http://%s:%s — loading %s (dtype %s) in the background; "
             "/health answers 503 until it is ready", config.model_name, config.host, port,
             engine_config.model or "the embedded model", engine_config.dtype)
    server.run()
    return 1 if failed.is_set() else 0
