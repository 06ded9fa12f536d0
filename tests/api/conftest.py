"""Fixtures for the server tests: ``start_server(args)`` runs `met serve` as a subprocess."""

from __future__ import annotations

import httpx
import openai
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


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    """The tiny Llama the API tests serve (a module may override it)."""
    return str(tiny_checkpoint("llama"))


@pytest.fixture(scope="module")
def server(start_server, ckpt):
    """A server on the tiny model for the module (a module may override it)."""
    return start_server([ckpt, "--dtype", "float32", "--max-model-len", "256",
                         "--served-model-name", "tiny"])


@pytest.fixture(scope="module")
def client(server):
    """The official OpenAI SDK pointed at the module's server."""
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server):
    """A raw HTTP client for what the SDK hides (status codes, headers, SSE bytes)."""
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c
