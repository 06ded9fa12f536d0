"""Fixtures for the server tests: a tiny-model server per module (``start_server`` and
``ckpt`` come from tests/conftest.py), the OpenAI SDK and a raw HTTP client on it."""

from __future__ import annotations

import httpx
import openai
import pytest


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
