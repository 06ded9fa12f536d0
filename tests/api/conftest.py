"""Fixtures for the server tests: ``start_server(args)`` runs `met serve` as a subprocess."""

from __future__ import annotations

import pytest
from serve_harness import ServerProcess


@pytest.fixture(scope="module")
def start_server():
    """Factory: ``start_server(args, env=None)`` → a ready ServerProcess (stopped at the
    end of the module)."""
    started: list[ServerProcess] = []

    def start(args: list[str], env: dict[str, str] | None = None) -> ServerProcess:
        server = ServerProcess(args, env)
        started.append(server)
        return server.wait_ready()

    yield start
    for server in started:
        server.stop()
