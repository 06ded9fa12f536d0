"""`met serve` limits and lifecycle: API keys, the queue limit, request timeout, body size,
and a graceful drain on SIGTERM. One server (tiny model) for the module; the drain test
stops it, so it runs last."""

from __future__ import annotations

import json
import signal

import httpx
import openai
import pytest
from serve_harness import wait_until

KEYS = ("key-one", "key-two")
TIMEOUT_S = 1
# With --max-num-seqs 1 the choices of one request run one after another: 8 x 480 tokens
# take seconds on any machine, so such a request always outlives the timeout.
SLOW = {"n": 8, "max_tokens": 480, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(start_server, tiny_checkpoint):
    return start_server([
        str(tiny_checkpoint("llama")), "--dtype", "float32", "--max-model-len", "512",
        "--served-model-name", "tiny", "--api-key", KEYS[0], "--api-key", KEYS[1],
        "--max-num-seqs", "1", "--max-queued-requests", "1",
        "--request-timeout", str(TIMEOUT_S), "--max-request-body", "64KiB", "--log-requests",
    ])


def auth(key: str = KEYS[0]) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


def test_missing_or_wrong_key_is_401_and_health_metrics_stay_open(server):
    r = httpx.post(server.url + "/v1/chat/completions", json=CHAT)
    assert r.status_code == 401
    err = r.json()["error"]
    assert err["code"] == "invalid_api_key" and "Bearer" in err["message"]
    assert r.headers["x-request-id"]
    r = httpx.post(server.url + "/v1/chat/completions", json=CHAT, headers=auth("nope"))
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/v1/models").status_code == 401
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200


def test_every_configured_key_works_with_the_sdk(server):
    for key in KEYS:
        client = openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=0)
        r = client.chat.completions.create(**CHAT)
        assert r.choices[0].message.content is not None
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base_url, api_key="wrong",
                      max_retries=0).models.list()


def _first_event(lines) -> dict:
    return json.loads(next(line for line in lines if line.startswith("data: "))[6:])


def test_full_queue_answers_503_with_retry_after(server):
    long = {**CHAT, "max_tokens": 480, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, headers=auth(), timeout=60) as http:
        # Keep the line iterators referenced: a dropped one closes its response.
        with http.stream("POST", "/v1/chat/completions", json=long) as running:
            running_lines = running.iter_lines()
            _first_event(running_lines)  # running: the only seat (--max-num-seqs 1)
            with http.stream("POST", "/v1/chat/completions", json=long) as queued:
                queued_lines = queued.iter_lines()
                _first_event(queued_lines)  # waiting: the queue (1) is now full
                r = httpx.post(server.url + "/v1/chat/completions", json=CHAT,
                               headers=auth(), timeout=60)
                assert r.status_code == 503
                assert r.headers["retry-after"] == "1"
                assert r.json()["error"]["code"] == "queue_full"
                assert "--max-queued-requests" in r.json()["error"]["message"]
    assert wait_until(lambda: server.metric("met_kv_blocks_used") == 0)
    ok = httpx.post(server.url + "/v1/chat/completions", json=CHAT, headers=auth(), timeout=60)
    assert ok.status_code == 200


def test_request_past_its_timeout_finishes_with_timeout(server):
    client = openai.OpenAI(base_url=server.base_url, api_key=KEYS[1], max_retries=0)
    timeouts_before = server.metric("met_requests_total", finish_reason="timeout")
    body = dict(model="tiny", prompt="The keeper", temperature=0, n=SLOW["n"],
                max_tokens=SLOW["max_tokens"], extra_body={"ignore_eos": True})
    r = client.completions.create(**body)
    reasons = [c.finish_reason for c in r.choices]
    assert "timeout" in reasons and set(reasons) <= {"length", "timeout"}
    assert r.usage.completion_tokens < SLOW["n"] * SLOW["max_tokens"]
    assert r.usage.completion_tokens == 0 or any(c.text for c in r.choices)  # what it had
    chunks = list(client.completions.create(**body, stream=True))
    finished = {c.index: c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason}
    assert len(finished) == SLOW["n"] and "timeout" in finished.values()
    assert wait_until(lambda: server.metric("met_kv_blocks_used") == 0)
    assert server.metric("met_requests_total", finish_reason="timeout") > timeouts_before


def test_body_over_the_limit_is_413(server):
    big = json.dumps({"prompt": "x" * (100 << 10)}).encode()
    r = httpx.post(server.url + "/v1/completions", content=big, headers=auth())
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunked():  # no content-length: the limit is enforced while reading
        for i in range(0, len(big), 8192):
            yield big[i:i + 8192]

    try:
        r = httpx.post(server.url + "/v1/completions", content=chunked(), headers=auth())
        assert r.status_code == 413
    except httpx.TransportError:
        pass  # the server may close the connection before the upload ends
    assert httpx.get(server.url + "/health").status_code == 200


def test_sigterm_drains_in_flight_streams_then_exits_cleanly(server):
    body = {**CHAT, **SLOW, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=auth(),
                      timeout=60) as r:
        lines = r.iter_lines()
        _first_event(lines)
        server.proc.send_signal(signal.SIGTERM)
        events = [line[6:] for line in lines if line.startswith("data: ")]
    assert len(events) > 2  # the stream went on after the signal
    assert events[-1] == "[DONE]"
    finished = {c["index"]: c["finish_reason"] for e in events[:-1]
                for c in json.loads(e)["choices"] if c["finish_reason"]}
    assert len(finished) == SLOW["n"]  # every choice ended properly, none was dropped
    assert server.proc.wait(30) == 0
    assert "draining" in server.log()
