"""Disconnect storm: many streams opened at once and dropped at random points (mid-upload,
before the first byte back, after a few events, or read to the end). Afterwards every
request is gone from the engine, no KV block is held, the server is healthy, and a request
answers exactly as it did before the storm.

``MET_STORM_STREAMS`` sets the number of streams (default 200, a realistic count for a
2-core machine); ``MET_STORM_SEED`` the random drop points.
"""

from __future__ import annotations

import asyncio
import json
import os
import random

import httpx
import pytest
from serve_harness import wait_until

STREAMS = int(os.environ.get("MET_STORM_STREAMS", "200"))
SEED = int(os.environ.get("MET_STORM_SEED", "9"))
PROBE = {"model": "tiny", "prompt": "The keeper of the light", "max_tokens": 24,
         "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(start_server, ckpt):
    return start_server([ckpt, "--dtype", "float32", "--max-model-len", "256",
                         "--served-model-name", "tiny", "--max-num-seqs", "32"])


def _request(host: str, body: dict) -> bytes:
    raw = json.dumps(body).encode()
    return (b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (host.encode(), len(raw), raw))


async def _one(host: str, port: int, rng: random.Random, i: int) -> str:
    """Open a stream, then drop it at a random point; returns where it was dropped."""
    body = {"model": "tiny", "prompt": f"Storm {i} over the keeper's light",
            "max_tokens": rng.choice([8, 64, 200]), "temperature": rng.choice([0, 1]),
            "seed": i, "ignore_eos": True, "stream": True,
            "n": rng.choice([1, 1, 1, 2]), **rng.choice([{}, {"stop": ["zz"]}])}
    request = _request(host, body)
    point = rng.choice(["upload", "before-reply", "after-events", "after-events", "end"])
    reader, writer = await asyncio.open_connection(host, port)
    try:
        if point == "upload":  # leave half-way through the body
            writer.write(request[: len(request) - rng.randint(1, 20)])
            await writer.drain()
            await asyncio.sleep(rng.random() * 0.05)
            return point
        writer.write(request)
        await writer.drain()
        if point == "before-reply":
            await asyncio.sleep(rng.random() * 0.2)
            return point
        wanted = rng.randint(1, 12) if point == "after-events" else None
        seen = 0
        while wanted is None or seen < wanted:
            line = await asyncio.wait_for(reader.readline(), 120)
            if not line or line.startswith(b"data: [DONE]"):
                break
            seen += line.startswith(b"data: ")
        return point
    finally:
        writer.transport.abort()  # a hard drop: no FIN handshake courtesy


@pytest.mark.slow
def test_storm_of_dropped_streams_leaves_nothing_behind(server):
    expected = httpx.post(server.url + "/v1/completions", json=PROBE, timeout=60).json()
    host, port = server.url.removeprefix("http://").split(":")
    rng = random.Random(SEED)
    rngs = [random.Random(rng.random()) for _ in range(STREAMS)]

    async def storm():
        return await asyncio.gather(*(_one(host, int(port), rngs[i], i)
                                      for i in range(STREAMS)))

    points = asyncio.run(storm())
    assert len(points) == STREAMS and len(set(points)) == 4  # every kind of drop happened

    def idle() -> bool:
        m = server.metrics()
        pick = lambda name: sum(v for k, v in m.items() if k.partition("{")[0] == name)  # noqa: E731
        return (pick("met_requests_running") == 0 and pick("met_requests_waiting") == 0
                and pick("met_kv_blocks_used") == 0)

    assert wait_until(idle, timeout=120), server.metrics()
    assert server.metric("met_requests_total", finish_reason="abort") > 0
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    after = httpx.post(server.url + "/v1/completions", json=PROBE, timeout=60).json()
    assert after["choices"][0]["text"] == expected["choices"][0]["text"]
    assert after["usage"]["completion_tokens"] == PROBE["max_tokens"]
    assert idle()
