"""Fixtures for the reliability tests.

``start_server(args)`` and ``ckpt`` come from tests/conftest.py;
``in_process_server(config=..., engine_config=...)`` runs the app under uvicorn in a
thread of the test process, so a test can monkeypatch the engine or the detokenizer and read
the server's logs with caplog.
"""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest
import uvicorn
from serve_harness import wait_until

from met.api.app import build_app
from met.api.context import ServerConfig
from met.config import EngineConfig
from met.engine.async_engine import AsyncEngine
from met.engine.core import EngineCore


class InProcessServer:
    """The app under uvicorn on a free loopback port, in a thread of this process."""

    def __init__(self, config: ServerConfig, engine_config: EngineConfig):
        self.engine = AsyncEngine(lambda: EngineCore(engine_config))
        self.app = build_app(config, self.engine)
        self.server = uvicorn.Server(uvicorn.Config(
            self.app, host="127.0.0.1", port=0, log_config=None, lifespan="on"))
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.url = ""

    def _run(self) -> None:
        asyncio.run(self.server.serve())

    def start(self) -> InProcessServer:
        self._thread.start()
        assert wait_until(lambda: self.server.started, timeout=60), "uvicorn did not start"
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        assert wait_until(lambda: httpx.get(self.url + "/health").status_code == 200,
                          timeout=120), "the model did not load"
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(60)


@pytest.fixture
def in_process_server(ckpt):
    """Factory: ``in_process_server(config=None, **engine_kwargs)`` → a started server on
    the tiny model; all are stopped when the test ends."""
    started: list[InProcessServer] = []

    def start(config: ServerConfig | None = None, **engine_kwargs) -> InProcessServer:
        engine_config = EngineConfig(**{"model": ckpt, "dtype": "float32",
                                        "max_model_len": 256, **engine_kwargs})
        server = InProcessServer(config or ServerConfig(served_model_names=("tiny",)),
                                 engine_config)
        started.append(server)
        return server.start()

    yield start
    for server in started:
        server.stop()
