"""POST /sleep, /wake_up, /reset_prefix_cache and GET /is_sleeping (vLLM's operator routes):
sleep frees the KV pool (level 2 the weights too), keeps the process, refuses generation
with a 503 naming the state, and after /wake_up greedy outputs are what they were."""

from __future__ import annotations

import asyncio
import gc
import weakref

import pytest

from met.cache.block_pool import BlockPool
from tests.api.in_process import run_with_app, settled

GREEDY = {"model": "tiny", "prompt": list(range(20, 60)), "max_tokens": 12,
          "temperature": 0.0, "ignore_eos": True}


def _engine(client):
    return client._transport.app.state.ctx.engine  # in-process: the app behind the client


async def _text(client) -> str:
    r = await client.post("/v1/completions", json=GREEDY)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_memory_refuses_work_and_wake_gives_the_same_output(ckpt, level):
    async def work(client):
        before = await _text(client)
        engine = _engine(client)
        model = weakref.ref(engine.core.loaded.model)
        r = await client.post("/sleep", params={"level": level})
        assert r.status_code == 200, r.text
        assert r.json()["level"] == level
        health = await client.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "sleeping"
        assert (await client.get("/is_sleeping")).json()["is_sleeping"] is True
        r = await client.post("/v1/completions", json=GREEDY)
        assert r.status_code == 503
        assert r.json()["error"]["code"] == "engine_sleeping"
        assert "sleeping" in r.json()["error"]["message"] and r.headers["Retry-After"]
        r = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status_code == 503
        if level == 1:
            assert engine.core.runner.kv_caches == []  # the pool is gone, the weights stay
            assert model() is not None
        else:
            gc.collect()
            assert engine.core is None and model() is None  # the weights were freed
        # Sleeping twice is no error; the second changes nothing.
        assert (await client.post("/sleep")).json()["already_sleeping"] is True
        r = await client.post("/wake_up")
        assert r.status_code == 200 and r.json()["already_awake"] is False
        assert (await client.get("/health")).status_code == 200
        assert (await client.get("/is_sleeping")).json()["is_sleeping"] is False
        after = await _text(client)
        assert after == before
        assert (await client.post("/wake_up")).json()["already_awake"] is True
        assert await settled(client) == (0, 0)  # no KV block leaked across sleep and wake

    run_with_app(ckpt, None, work)


def test_sleep_is_refused_while_requests_run(ckpt):
    async def work(client):
        engine = _engine(client)
        long = asyncio.create_task(client.post("/v1/completions", json={
            **GREEDY, "max_tokens": 200}))
        for _ in range(400):
            if engine.num_in_flight:
                break
            await asyncio.sleep(0.01)
        r = await client.post("/sleep")
        assert r.status_code == 409 and r.json()["error"]["code"] == "engine_busy", r.text
        assert (await client.get("/health")).status_code == 200
        assert (await long).status_code == 200  # the running request was not cut short
        assert (await client.post("/sleep")).status_code == 200
        assert (await client.post("/wake_up")).status_code == 200

    run_with_app(ckpt, None, work)


def test_sleep_level_must_be_1_or_2(ckpt):
    async def work(client):
        for bad in ({"params": {"level": "3"}}, {"json": {"level": 0}},
                    {"json": {"level": "deep"}}, {"json": {"levle": 1}}):
            r = await client.post("/sleep", **bad)
            assert r.status_code == 400, (bad, r.text)
            assert r.json()["error"]["param"] == "level"
        assert (await client.get("/health")).status_code == 200

    run_with_app(ckpt, None, work)


def test_reset_prefix_cache_makes_the_next_identical_prompt_uncached(ckpt):
    async def work(client):
        async def cached() -> int:
            r = await client.post("/v1/completions", json=GREEDY)
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        assert await cached() == 0
        assert await cached() == 32  # two full blocks of 16 before the last prompt token
        r = await client.post("/reset_prefix_cache")
        assert r.status_code == 200 and r.json()["blocks_reset"] >= 2
        assert await cached() == 0
        assert await settled(client) == (0, 0)

    run_with_app(ckpt, None, work)


def test_dropping_cached_prefixes_keeps_the_blocks_requests_hold():
    pool = BlockPool(4)
    held, free = pool.allocate(2)
    pool.cache(held, b"held")
    pool.cache(free, b"free")
    pool.release([free])
    assert pool.drop_unreferenced_hashes() == 1
    assert pool.lookup(b"free") is None
    assert pool.lookup(b"held") == held and pool.ref_count[held] == 1
