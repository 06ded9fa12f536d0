"""The server app run inside the test process (lifespan and all, over httpx's ASGI
transport), so a test can monkeypatch a fault into it and read what the client gets."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import httpx

from met.api.app import build_app
from met.api.context import ServerConfig
from met.config import EngineConfig
from met.engine.async_engine import AsyncEngine
from met.engine.core import EngineCore

T = TypeVar("T")


def run_with_app(ckpt: str, chat_template: str | None,
                 work: Callable[[httpx.AsyncClient], Awaitable[T]],
                 server_fields: dict | None = None, **engine_fields) -> T:
    """Start the app on the tiny checkpoint ``ckpt`` (EngineConfig ``engine_fields`` on top
    of the defaults), wait until it serves, run ``work`` with a client for it, then shut it
    down; what ``work`` returned."""
    fields = {"dtype": "float32", "max_model_len": 256} | engine_fields
    engine = AsyncEngine(lambda: EngineCore(EngineConfig(model=ckpt, **fields)))
    app = build_app(ServerConfig(served_model_names=("tiny",), chat_template=chat_template,
                                 **(server_fields or {})), engine)

    async def main() -> T:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://met",
                                         timeout=60) as client:
                for _ in range(1200):
                    if (await client.get("/health")).status_code == 200:
                        break
                    await asyncio.sleep(0.05)
                return await work(client)

    return asyncio.run(main())


async def metric(client: httpx.AsyncClient, name: str) -> float:
    """The sum of ``name``'s samples on /metrics."""
    total = 0.0
    for line in (await client.get("/metrics")).text.splitlines():
        key, _, value = line.rpartition(" ")
        if not line.startswith("#") and key.partition("{")[0] == name:
            total += float(value)
    return total


async def settled(client: httpx.AsyncClient, timeout: float = 30.0) -> tuple[float, float]:
    """(running requests, KV blocks in use) once both reach 0 (aborts land a step later),
    or as they are at ``timeout``."""
    for _ in range(int(timeout / 0.05)):
        left = (await metric(client, "met_requests_running"),
                await metric(client, "met_kv_blocks_used"))
        if left == (0, 0):
            break
        await asyncio.sleep(0.05)
    return left
