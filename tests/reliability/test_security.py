"""Security: API keys on every route but /health and /metrics, compared in constant time;
a warning when binding every interface; no prompt or output in the logs unless
--log-requests; image URLs are refused, never fetched."""

from __future__ import annotations

import logging
import socket

import httpx
import pytest

from met.api import auth
from met.api import server as server_module
from met.api.context import ServerConfig
from met.config import EngineConfig

KEY = "sk-reliability-key"
SECRET = "zebra canary lighthouse"  # a prompt no log line may contain


@pytest.fixture(scope="module")
def keyed_server(start_server, ckpt):
    return start_server([ckpt, "--dtype", "float32", "--max-model-len", "128",
                         "--served-model-name", "tiny", "--api-key", KEY])


def _example_body(path: str) -> dict | None:
    return {"/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}],
                                     "max_tokens": 2},
            "/v1/completions": {"prompt": "hi", "max_tokens": 2},
            "/tokenize": {"prompt": "hi"}, "/detokenize": {"tokens": [1, 2]},
            "/v1/messages": {"model": "tiny", "max_tokens": 2,
                             "messages": [{"role": "user", "content": "hi"}]},
            "/v1/messages/count_tokens": {"model": "tiny",
                                          "messages": [{"role": "user", "content": "hi"}]},
            "/v1/responses": {"input": "hi", "max_output_tokens": 2},
            "/v1/embeddings": {"input": "hi"},
            **dict.fromkeys(("/v1/rerank", "/rerank", "/v2/rerank"),
                            {"query": "hi", "documents": ["ho"]}),
            **dict.fromkeys(("/v1/score", "/score"), {"text_1": "hi", "text_2": "ho"}),
            }.get(path)


def _stored_response(url: str) -> str:
    """The id of a fresh stored /v1/responses result (for GET / DELETE on it)."""
    r = httpx.post(url + "/v1/responses", json=_example_body("/v1/responses"), timeout=60,
                   headers={"Authorization": f"Bearer {KEY}"})
    return r.json()["id"]


def test_every_route_but_health_and_metrics_needs_the_key(keyed_server):
    url = keyed_server.url
    spec = httpx.get(url + "/openapi.json", headers={"Authorization": f"Bearer {KEY}"}).json()
    routes = [(method.upper(), path) for path, ops in spec["paths"].items() for method in ops]
    paths = {p for _, p in routes}
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/tokenize",
            "/detokenize", "/sleep", "/wake_up", "/is_sleeping", "/reset_prefix_cache"} <= paths
    for method, path in routes + [("GET", "/openapi.json"), ("GET", "/v1/nope")]:
        concrete = path.replace("{model}", "tiny").replace("{model_id}", "tiny")
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = httpx.request(method, url + concrete, json=_example_body(path),
                              headers=headers, timeout=30)
            if path in ("/health", "/metrics"):
                assert r.status_code == 200, (method, path)
                continue
            assert r.status_code == 401, (method, path, headers, r.status_code)
            err = r.json()["error"]
            if path.startswith("/v1/messages"):  # Anthropic's routes answer in its shape
                assert r.json()["type"] == "error" and err["type"] == "authentication_error"
            else:
                assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error"
            assert KEY not in r.text
    for method, path in routes:
        body = _example_body(path)
        concrete = path.replace("{model}", "tiny").replace("{model_id}", "tiny")
        if "{response_id}" in path:
            concrete = path.replace("{response_id}", _stored_response(url))
        r = httpx.request(method, url + concrete, json=body, timeout=60,
                          headers={"Authorization": f"Bearer {KEY}"})
        if path.endswith("_lora_adapter"):  # past the key; off without --allow-runtime-lora
            assert r.status_code == 403 and "--allow-runtime-lora" in r.text, r.text[:300]
            continue
        if path.startswith("/models/"):  # past the key; a one-model server has no pool
            assert r.status_code == 404 and "--models-dir" in r.text, r.text[:300]
            continue
        if path in ("/sleep", "/wake_up"):
            continue  # below, in order: a sleeping server would answer the others 503
        assert r.status_code == 200, (method, path, r.text[:300])
    for path in ("/sleep", "/wake_up"):
        r = httpx.post(url + path, timeout=60, headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200, (path, r.text[:300])


def test_keys_are_compared_in_constant_time(monkeypatch):
    """Every configured key goes through hmac.compare_digest, whichever matches."""
    seen: list[bytes] = []
    real = auth.hmac.compare_digest

    def spy(a, b):
        seen.append(b)
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    keys = ("first-key", "second-key", "third-key")
    assert auth.key_matches("first-key", keys)
    assert seen == [k.encode() for k in keys]  # no early exit on the first match
    seen.clear()
    assert not auth.key_matches("nope", keys)
    assert seen == [k.encode() for k in keys]


@pytest.mark.parametrize("host,warns", [("0.0.0.0", True), ("::", True), ("[::]", True),
                                        ("", True), ("127.0.0.1", False), ("::1", False),
                                        ("localhost", False)])
def test_binding_every_interface_logs_a_warning(monkeypatch, caplog, host, warns):
    monkeypatch.setattr(server_module._DrainingServer, "run", lambda self: None)
    caplog.set_level(logging.INFO, logger="met.api")
    config = ServerConfig(served_model_names=("tiny",), host=host)
    server_module.serve(EngineConfig(model="unused"), config)
    warnings = [r for r in caplog.records
                if r.levelno == logging.WARNING and "every network interface" in r.message]
    assert bool(warnings) == warns
    assert ServerConfig(served_model_names=("x",)).host == "127.0.0.1"  # the default


def _chat_and_stream(url: str) -> str:
    """A chat (plain and streamed) and a completion about SECRET; the generated text."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": SECRET}],
            "max_tokens": 6, "temperature": 0}
    out = httpx.post(url + "/v1/chat/completions", json=body, timeout=60).json()
    httpx.post(url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60)
    httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": SECRET,
                                              "max_tokens": 6}, timeout=60)
    return out["choices"][0]["message"]["content"]


@pytest.mark.parametrize("log_requests", [False, True])
def test_prompts_reach_the_logs_only_with_log_requests(in_process_server, caplog,
                                                       log_requests):
    caplog.set_level(logging.DEBUG)
    server = in_process_server(ServerConfig(served_model_names=("tiny",),
                                            log_requests=log_requests))
    output = _chat_and_stream(server.url)
    logs = caplog.text
    assert "met.api" in logs  # the server did log (its startup, at least)
    assert (SECRET in logs) == log_requests
    if len(output.strip()) >= 8:  # long enough not to appear by chance
        assert output not in logs


def test_image_url_is_refused_and_never_fetched(keyed_server):
    with socket.socket() as listener:  # where the "image" lives: nothing may connect
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.settimeout(0.5)
        image = f"http://127.0.0.1:{listener.getsockname()[1]}/cat.png"
        body = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "what is this?"},
            {"type": "image_url", "image_url": {"url": image}}]}]}
        r = httpx.post(keyed_server.url + "/v1/chat/completions", json=body, timeout=30,
                       headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["param"] == "messages.0.content.1.type"
        assert "image_url" in err["message"] and "text" in err["message"]
        with pytest.raises(TimeoutError):
            listener.accept()
