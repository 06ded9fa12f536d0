"""Overload: a burst far beyond --max-queued-requests gets 503 + Retry-After for the excess
while every accepted request completes correctly; per-key rate limits answer 429 with
Retry-After in OpenAI's shape."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from serve_harness import wait_until

from met.api.errors import ApiError
from met.api.ratelimit import RateLimiter
from met.serving.errors import InvalidRequest

SEATS, QUEUE, BURST = 2, 2, 48
# Long enough that no accepted request can finish while the burst is still arriving.
LONG = {"model": "tiny", "prompt": "The keeper", "max_tokens": 200, "temperature": 0,
        "ignore_eos": True}


@pytest.fixture(scope="module")
def server(start_server, ckpt):
    return start_server([ckpt, "--dtype", "float32", "--max-model-len", "256",
                         "--served-model-name", "tiny", "--max-num-seqs", str(SEATS),
                         "--max-queued-requests", str(QUEUE)])


async def _one(client: httpx.AsyncClient, body: dict) -> tuple[int, dict, str]:
    """(status, headers, text) where text is the generated text or the error body."""
    if not body.get("stream"):
        r = await client.post("/v1/completions", json=body)
        if r.status_code != 200:
            return r.status_code, dict(r.headers), r.text
        return 200, dict(r.headers), r.json()["choices"][0]["text"]
    async with client.stream("POST", "/v1/completions", json=body) as r:
        raw = (await r.aread()).decode()
        if r.status_code != 200:
            return r.status_code, dict(r.headers), raw
        events = [b[6:] for b in raw.split("\n\n") if b.startswith("data: ")]
        assert events[-1] == "[DONE]"
        text = "".join(c["text"] for e in events[:-1] for c in json.loads(e)["choices"])
        return 200, dict(r.headers), text


def test_burst_beyond_the_queue_gets_503_and_accepted_requests_complete(server):
    expected = httpx.post(server.url + "/v1/completions", json=LONG, timeout=120)
    expected_text = expected.json()["choices"][0]["text"]

    async def burst():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            return await asyncio.gather(*(
                _one(client, {**LONG, "stream": i % 2 == 0}) for i in range(BURST)))

    results = asyncio.run(burst())
    accepted = [text for status, _, text in results if status == 200]
    rejected = [(h, text) for status, h, text in results if status == 503]
    assert len(accepted) + len(rejected) == BURST  # nothing else: no 5xx, no crash
    # The seats and the queue were taken by the first arrivals; nothing finished meanwhile.
    assert len(accepted) == SEATS + QUEUE
    assert accepted == [expected_text] * len(accepted)
    for headers, text in rejected:
        assert headers["retry-after"] == "1"
        err = json.loads(text)["error"]
        assert err["code"] == "queue_full" and err["type"] == "server_error"
    assert wait_until(lambda: server.metric("met_kv_blocks_used") == 0)
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


# ---------------------------------------------------------------- rate limits

KEYS = ("key-a", "key-b")


@pytest.fixture(scope="module")
def limited(start_server, ckpt):
    return start_server([ckpt, "--dtype", "float32", "--max-model-len", "256",
                         "--served-model-name", "tiny", "--api-key", KEYS[0],
                         "--api-key", KEYS[1], "--rate-limit-rpm", "3",
                         "--rate-limit-tpm", "120"])


def _post(server, key: str, **body) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", timeout=60,
                      headers={"Authorization": f"Bearer {key}"},
                      json={"model": "tiny", "prompt": [1, 2, 3, 4], "max_tokens": 4, **body})


def test_requests_per_minute_per_key(limited):
    for _ in range(3):
        assert _post(limited, KEYS[0]).status_code == 200
    r = _post(limited, KEYS[0])
    assert r.status_code == 429
    assert int(r.headers["retry-after"]) >= 1
    err = r.json()["error"]
    assert err == {"message": err["message"], "type": "rate_limit_error", "param": None,
                   "code": "rate_limit_exceeded"}
    assert "3 requests" in err["message"]
    assert _post(limited, KEYS[1]).status_code == 200  # the other key has its own bucket


def test_tokens_per_minute_count_prompt_plus_max_tokens(limited):
    key = KEYS[1]
    assert _post(limited, key, max_tokens=100).status_code == 200  # 4 + 100 = 104 tokens
    r = _post(limited, key, max_tokens=100)  # the bucket refills 2 tokens a second
    assert r.status_code == 429 and "120 tokens" in r.json()["error"]["message"]
    assert int(r.headers["retry-after"]) >= 30
    r = _post(limited, key, max_tokens=200)  # alone over the limit: waiting cannot help
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert "--rate-limit-tpm" in r.json()["error"]["message"]


def test_buckets_refill_over_time():
    now = [0.0]
    limiter = RateLimiter(rpm=3, tpm=60, clock=lambda: now[0])
    for _ in range(3):
        limiter.admit("k", 10)
    with pytest.raises(ApiError) as e:
        limiter.admit("k", 10)
    assert e.value.status == 429 and e.value.headers["Retry-After"] == "20"  # 1 per 20 s
    now[0] = 20.0
    limiter.admit("k", 10)  # one request back; 30 + 20 tokens refilled
    with pytest.raises(ApiError) as e:
        limiter.admit("k", 45)
    assert e.value.status == 429
    with pytest.raises(InvalidRequest):
        limiter.admit("k", 61)
    limiter.admit("other", 60)  # keys never share a bucket
