"""Per-request limits (`met serve --max-n` and friends): each breach is a 400 that names the
field and the flag; a request within them is served. One tiny-model server for the module."""

from __future__ import annotations

import httpx
import pytest

LIMIT_ARGS = ["--max-prompt-tokens", "20", "--max-n", "2", "--max-tokens-limit", "8",
              "--max-stop-strings", "2", "--max-stop-string-length", "5", "--max-tools", "1",
              "--max-tool-schema-bytes", "400", "--max-logit-bias", "2",
              "--max-request-body", "4KiB"]
USER = [{"role": "user", "content": "hello"}]


def tool(name: str, n_props: int = 1) -> dict:
    props = {f"p{i}": {"type": "string", "description": "x" * 20} for i in range(n_props)}
    return {"type": "function", "function": {
        "name": name, "parameters": {"type": "object", "properties": props}}}


@pytest.fixture(scope="module")
def server(start_server, ckpt):
    return start_server([ckpt, "--dtype", "float32", "--max-model-len", "256",
                         "--served-model-name", "tiny", *LIMIT_ARGS])


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


OVER_LIMITS = [
    # (path, body, param, flag)
    ("/v1/completions", {"prompt": list(range(1, 22)), "max_tokens": 2}, "prompt",
     "--max-prompt-tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 40}]},
     "messages", "--max-prompt-tokens"),
    ("/v1/completions", {"prompt": "hi", "n": 3}, "n", "--max-n"),
    ("/v1/chat/completions", {"messages": USER, "n": 3}, "n", "--max-n"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 9}, "max_tokens", "--max-tokens-limit"),
    ("/v1/chat/completions", {"messages": USER, "max_completion_tokens": 9},
     "max_completion_tokens", "--max-tokens-limit"),
    ("/v1/completions", {"prompt": "hi", "stop": ["a", "b", "c"]}, "stop",
     "--max-stop-strings"),
    ("/v1/chat/completions", {"messages": USER, "stop": "toolong"}, "stop",
     "--max-stop-string-length"),
    ("/v1/chat/completions", {"messages": USER, "tools": [tool("a"), tool("b")]}, "tools",
     "--max-tools"),
    ("/v1/chat/completions", {"messages": USER, "tools": [tool("a", 12)]}, "tools.0",
     "--max-tool-schema-bytes"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"1": 1, "2": 1, "3": 1}},
     "logit_bias", "--max-logit-bias"),
]


@pytest.mark.parametrize("path,body,param,flag", OVER_LIMITS,
                         ids=[f"{p}-{flag}" for p, _, _, flag in OVER_LIMITS])
def test_over_a_limit_is_a_400_naming_the_field_and_flag(http, path, body, param, flag):
    r = http.post(path, json={"model": "tiny", **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param
    assert flag in err["message"]


def test_body_over_max_request_body_is_413(http):
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": "x" * 5000})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_requests_at_the_limits_are_served(http):
    r = http.post("/v1/completions", json={
        "model": "tiny", "prompt": list(range(1, 21)), "n": 2, "max_tokens": 8,
        "stop": ["abcde", "x"], "logit_bias": {"1": 1, "2": -1}, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert [c["finish_reason"] for c in r.json()["choices"]] == ["length", "length"]


def test_unspecified_max_tokens_is_capped_by_the_limit(http):
    r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": USER,
                                                "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 8
    assert r.json()["choices"][0]["finish_reason"] == "length"
