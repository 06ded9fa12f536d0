"""Fault isolation: a failure inside one request fails that request alone (an error event
when streaming, a 500 body otherwise); a failure of the engine loop itself faults the
server (/health says why, every stream gets an error event, new requests get 503) and
nothing hangs. Servers run in-process so the faults can be monkeypatched in."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from serve_harness import wait_until

from met.engine.core import EngineCore
from met.serving import generate
from met.serving.detokenizer import IncrementalDetokenizer

CLIENT_TIMEOUT = httpx.Timeout(60.0)
BODY = {"model": "tiny", "prompt": "The keeper", "max_tokens": 12, "temperature": 0,
        "ignore_eos": True}


def sse_events(text: str) -> list[str]:
    return [b[len("data: "):] for b in text.split("\n\n") if b.startswith("data: ")]


def stream_result(r: httpx.Response) -> tuple[str, str | None, dict | None]:
    """(text, finish_reason, error) of a completions stream; asserts it ended with [DONE]."""
    events = sse_events(r.text)
    assert events and events[-1] == "[DONE]", r.text[-500:]
    text, finish, error = "", None, None
    for e in events[:-1]:
        obj = json.loads(e)
        if "error" in obj:
            error = obj["error"]
            continue
        for c in obj["choices"]:
            text += c["text"]
            finish = c["finish_reason"] or finish
    return text, finish, error


def assert_openai_error(body: dict, status: int) -> dict:
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == ("server_error" if status >= 500 else "invalid_request_error")
    assert err["message"]
    return err


def assert_failed_by_fault(r: httpx.Response, reason: str) -> bool:
    """A request caught by an engine fault: True when it was in flight (an error event
    after a 200, or a 500), False when it arrived after the fault (a 503)."""
    if r.status_code == 503:  # a slow machine: it came in after the engine had faulted
        err = assert_openai_error(r.json(), 503)
        assert err["code"] == "engine_faulted" and reason in err["message"]
        return False
    if r.headers["content-type"].startswith("text/event-stream"):
        assert r.status_code == 200
        _, finish, error = stream_result(r)
        assert error is not None and "engine" in error["message"]
        assert finish is None  # no choice pretended to finish normally
        assert_openai_error({"error": error}, 500)
        return True
    assert r.status_code == 500
    assert "engine" in assert_openai_error(r.json(), 500)["message"]
    return True


async def post_all(url: str, bodies: list[dict]) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=CLIENT_TIMEOUT) as c:
        return await asyncio.gather(*(c.post("/v1/completions", json=b) for b in bodies))


def test_detokenizer_failure_fails_only_its_request(in_process_server, monkeypatch):
    server = in_process_server()
    expected = httpx.post(server.url + "/v1/completions", json=BODY, timeout=CLIENT_TIMEOUT)
    expected_text = expected.json()["choices"][0]["text"]
    real_push = IncrementalDetokenizer.push
    pushes = {"poisoned": 0}

    def push(self, token_ids):
        # The poisoned requests are the ones that asked to keep special tokens.
        if not self._skip:
            pushes["poisoned"] += 1
            if pushes["poisoned"] % 3 == 0:
                raise RuntimeError("simulated detokenizer bug")
        return real_push(self, token_ids)

    monkeypatch.setattr(generate.IncrementalDetokenizer, "push", push)
    poisoned = {**BODY, "skip_special_tokens": False}
    bodies = [{**BODY, "stream": True}] * 3 + [BODY] * 2 + [
        {**poisoned, "stream": True}, poisoned]
    responses = asyncio.run(post_all(server.url, bodies))

    for r in responses[:3]:
        assert r.status_code == 200
        assert stream_result(r) == (expected_text, "length", None)
    for r in responses[3:5]:
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected_text
    bad_stream, bad_plain = responses[5], responses[6]
    assert bad_stream.status_code == 200  # the stream had started: the error is an event
    _, finish, error = stream_result(bad_stream)
    assert error is not None and "simulated detokenizer bug" in error["message"]
    assert_openai_error({"error": error}, 500)
    assert bad_plain.status_code == 500
    assert assert_openai_error(bad_plain.json(), 500)["code"] == "internal_error"

    engine = server.engine
    assert wait_until(lambda: engine.num_in_flight == 0 and engine.stats.num_running == 0
                      and engine.stats.kv.num_blocks_in_use == 0)
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_a_request_that_cannot_be_started_fails_alone(in_process_server, monkeypatch):
    """An exception while adding one request in the engine (a grammar that will not
    compile, say) fails that request; the engine keeps serving."""
    server = in_process_server()
    core = server.engine.core
    real_add = core.add_request

    def add_request(request_id, prompt_token_ids, params, *args, **kwargs):
        if params.seed == 666:
            raise RuntimeError("simulated grammar compiler crash")
        return real_add(request_id, prompt_token_ids, params, *args, **kwargs)

    monkeypatch.setattr(core, "add_request", add_request)
    bodies = [BODY, {**BODY, "seed": 666}, {**BODY, "seed": 666, "stream": True},
              {**BODY, "stream": True}]
    ok, bad, bad_stream, ok_stream = asyncio.run(post_all(server.url, bodies))
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"
    assert bad.status_code == 500
    assert "simulated grammar compiler crash" in assert_openai_error(bad.json(), 500)["message"]
    assert stream_result(bad_stream)[2] is not None
    assert stream_result(ok_stream)[1] == "length"
    assert httpx.get(server.url + "/health").status_code == 200
    assert wait_until(lambda: server.engine.stats.kv.num_blocks_in_use == 0)


def test_engine_loop_fault_fails_every_request_and_faults_health(in_process_server,
                                                                 monkeypatch):
    server = in_process_server()
    real_step = EngineCore.step
    calls = {"n": 0}

    def step(self):
        calls["n"] += 1
        if calls["n"] > 6:
            raise RuntimeError("simulated CUDA error: device lost")
        return real_step(self)

    monkeypatch.setattr(EngineCore, "step", step)
    long = {**BODY, "max_tokens": 200}
    bodies = [{**long, "stream": True}] * 4 + [long] * 2
    responses = asyncio.run(post_all(server.url, bodies))  # CLIENT_TIMEOUT: never a hang
    assert sum(assert_failed_by_fault(r, "device lost") for r in responses) >= 1

    health = httpx.get(server.url + "/health")
    assert health.status_code == 503
    assert health.json()["status"] == "faulted" and "device lost" in health.json()["reason"]
    for path, body in (("/v1/completions", BODY), ("/v1/completions", {**BODY, "stream": True}),
                       ("/v1/chat/completions", {"model": "tiny", "max_tokens": 2,
                                                 "messages": [{"role": "user", "content": "hi"}]})):
        r = httpx.post(server.url + path, json=body, timeout=10)
        assert r.status_code == 503
        assert assert_openai_error(r.json(), 503)["code"] == "engine_faulted"
    assert server.engine.num_in_flight == 0


@pytest.mark.parametrize("stream", [False, True])
def test_engine_fault_while_requests_wait_in_the_queue(in_process_server, monkeypatch, stream):
    """Requests still waiting for a seat when the loop dies get their error too."""
    server = in_process_server(max_num_seqs=1)
    real_step = EngineCore.step
    calls = {"n": 0}

    def step(self):
        calls["n"] += 1
        if calls["n"] > 3:
            raise RuntimeError("simulated loop crash")
        return real_step(self)

    monkeypatch.setattr(EngineCore, "step", step)
    bodies = [{**BODY, "max_tokens": 100, "stream": stream}] * 5
    responses = asyncio.run(post_all(server.url, bodies))
    assert sum(assert_failed_by_fault(r, "simulated loop crash") for r in responses) >= 1
    assert httpx.get(server.url + "/health").json()["status"] == "faulted"


@pytest.mark.parametrize("stream", [False, True])
def test_constraints_that_leave_no_token_are_the_requests_fault(in_process_server, stream):
    """Found by schemathesis: a grammar that the request's own allowed_token_ids make
    impossible dead-ends mid-generation. That is a 400 (an invalid_request_error event when
    streaming), not a server error, and the engine goes on serving."""
    server = in_process_server()
    body = {**BODY, "guided_regex": "\u00a4\u00dc", "allowed_token_ids": [5],
            "stream": stream}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=CLIENT_TIMEOUT)
    if stream:
        assert r.status_code == 200
        error = stream_result(r)[2]
        assert error is not None and "dead end" in error["message"]
        assert_openai_error({"error": error}, 400)
    else:
        assert r.status_code == 400, r.text
        assert "dead end" in assert_openai_error(r.json(), 400)["message"]
    ok = httpx.post(server.url + "/v1/completions", json=BODY, timeout=CLIENT_TIMEOUT)
    assert ok.status_code == 200


def test_a_request_that_races_the_fault_gets_the_fault_as_its_error():
    """Validated while the engine was healthy, added just after it faulted: the request
    gets the same error as those in flight (not an internal error, not a hang)."""
    from met.engine.async_engine import AsyncEngine, EngineState, OutputStream, RequestFailed
    from met.sampling.params import SamplingParams

    async def main():
        engine = AsyncEngine(lambda: None)  # never started: its state is set by hand
        engine.state, engine.fault_reason = EngineState.FAULTED, "engine loop crashed: boom"
        stream = OutputStream()
        engine.add_request("r1", [1, 2], SamplingParams(max_tokens=2), stream)
        item = await stream.get(timeout=1)
        assert isinstance(item, RequestFailed) and "boom" in item.message
        assert engine.num_in_flight == 0

    asyncio.run(main())
