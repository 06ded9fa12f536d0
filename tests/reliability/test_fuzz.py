"""Hostile input: schemathesis against the live server's /openapi.json, and
hypothesis-generated request bodies for the generation routes. Whatever comes in: no 5xx,
every 4xx carries an OpenAI-shaped error body, every request answers within a timeout and
every stream ends with [DONE].

Case counts: ``MET_FUZZ_EXAMPLES`` (per schemathesis operation, default 30) and
``MET_FUZZ_BODIES`` (per generation route, default 60); raise them for a longer hunt.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.generation import GenerationMode
from serve_harness import wait_until

SCHEMA_EXAMPLES = int(os.environ.get("MET_FUZZ_EXAMPLES", "30"))
BODY_EXAMPLES = int(os.environ.get("MET_FUZZ_BODIES", "60"))
ANSWER_TIMEOUT_S = 60.0  # "no hang": every request answers (or its stream ends) by then
SERVER_ARGS = ["--dtype", "float32", "--max-model-len", "128", "--served-model-name", "tiny",
               "--max-tokens-limit", "8", "--max-n", "4", "--request-timeout", "30"]


@pytest.fixture(scope="module")
def server(start_server, ckpt):
    return start_server([ckpt, *SERVER_ARGS])


def check_response(status: int, content_type: str, body: bytes, path: str = "") -> None:
    """The properties every response must have, whatever the request was (Anthropic's and
    the Responses API's routes in their own shapes)."""
    assert status < 500, f"server error {status}: {body[:500]!r}"
    if path.startswith("/v1/messages") or path.startswith("/v1/responses"):
        check_named_event_api(status, content_type, body, path.startswith("/v1/messages"))
    elif status >= 400:
        assert content_type.startswith("application/json"), (status, content_type)
        err = json.loads(body)["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        assert isinstance(err["message"], str) and err["message"], err
        assert err["type"] in ("invalid_request_error", "rate_limit_error"), err
        assert err["param"] is None or isinstance(err["param"], str), err
    elif content_type.startswith("text/event-stream"):
        events = [b[6:] for b in body.decode().split("\n\n") if b.startswith("data: ")]
        assert events and events[-1] == "[DONE]", body[-300:]
        for e in events[:-1]:
            obj = json.loads(e)
            assert "error" not in obj, obj  # a valid request that failed mid-stream
    elif content_type.startswith("application/json"):
        json.loads(body)


def check_named_event_api(status: int, content_type: str, body: bytes, anthropic: bool) -> None:
    """Anthropic's errors are ``{"type": "error", "error": {"type", "message"}}``; both
    APIs stream named events that end in a terminal event, never an error event."""
    if status >= 400:
        assert content_type.startswith("application/json"), (status, content_type)
        obj = json.loads(body)
        err = obj["error"]
        if anthropic:
            assert obj["type"] == "error" and set(err) == {"type", "message"}, obj
            assert err["type"] in ("invalid_request_error", "not_found_error",
                                   "request_too_large", "rate_limit_error"), err
        else:
            assert set(err) == {"message", "type", "param", "code"}, err
        assert isinstance(err["message"], str) and err["message"], err
    elif content_type.startswith("text/event-stream"):
        names = [b.split("\n")[0].removeprefix("event: ")
                 for b in body.decode().strip().split("\n\n")]
        assert "error" not in names, body[-500:]
        ends = ("message_stop",) if anthropic else ("response.completed", "response.incomplete")
        assert names and names[-1] in ends, body[-300:]
    elif content_type.startswith("application/json"):
        json.loads(body)


# ---------------------------------------------------------------- schemathesis

def _schema(server, coverage: bool):
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    schema.config.generation.update(
        modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
        max_examples=SCHEMA_EXAMPLES)
    # The coverage phase adds hundreds of boundary cases per operation (every field at and
    # past its limits): thorough, about a minute here, so only in the slow run.
    schema.config.phases.update(
        phases=["examples", "fuzzing", "coverage"] if coverage else ["examples", "fuzzing"])
    return schema


@pytest.fixture(scope="module")
def api_schema(server):
    return _schema(server, coverage=False)


@pytest.fixture(scope="module")
def api_schema_with_coverage(server):
    return _schema(server, coverage=True)


def _call_and_check(case) -> None:
    response = case.call(timeout=ANSWER_TIMEOUT_S)
    content_type = response.headers.get("content-type") or [""]  # schemathesis: lists
    check_response(response.status_code, content_type[0], response.content,
                   case.operation.path)


quick_schema = schemathesis.pytest.from_fixture("api_schema")
full_schema = schemathesis.pytest.from_fixture("api_schema_with_coverage")


@quick_schema.parametrize()
@settings(max_examples=SCHEMA_EXAMPLES, deadline=None,
          suppress_health_check=list(HealthCheck))
def test_openapi_operations_never_5xx_and_4xx_are_openai_shaped(case):
    _call_and_check(case)


@pytest.mark.slow
@full_schema.parametrize()
@settings(max_examples=SCHEMA_EXAMPLES, deadline=None,
          suppress_health_check=list(HealthCheck))
def test_openapi_boundary_cases_never_5xx_and_4xx_are_openai_shaped(case):
    _call_and_check(case)


# ---------------------------------------------------------------- hypothesis bodies

_text = st.text(max_size=40)
_any_json = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | _text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_text, inner, max_size=4),
    max_leaves=12)


@dataclass(frozen=True)
class Field:
    """A field's valid values, and the hostile ones (out of range, or any JSON at all)."""

    valid: st.SearchStrategy
    hostile: st.SearchStrategy

    @property
    def mixed(self) -> st.SearchStrategy:
        return st.one_of(self.valid, self.valid, self.valid, self.hostile)


def _maybe(valid: st.SearchStrategy, edge: st.SearchStrategy | None = None) -> Field:
    return Field(valid, _any_json if edge is None else edge | _any_json)


# The sampling fields both routes share: a valid range, then hostile edges.
SAMPLING = {
    "model": _maybe(st.just("tiny"), st.sampled_from(["gpt-4", ""])),
    "max_tokens": _maybe(st.integers(1, 8), st.integers(-2**40, 2**40)),
    "temperature": _maybe(st.floats(0, 2), st.floats(-1e9, 1e9) | st.sampled_from(
        [float("nan"), float("inf"), -0.0])),
    "top_p": _maybe(st.floats(0.01, 1), st.floats(-1, 2)),
    "top_k": _maybe(st.integers(-1, 50), st.integers(-2**63, 2**63)),
    "min_p": _maybe(st.floats(0, 1), st.floats(-2, 3)),
    "n": _maybe(st.integers(1, 3), st.integers(-1, 1000)),
    "seed": _maybe(st.integers(0, 2**32), st.integers(-2**70, 2**70)),
    "stop": _maybe(st.one_of(st.text(min_size=1, max_size=5),
                             st.lists(st.text(min_size=1, max_size=5), max_size=4)),
                   st.lists(_text, max_size=40)),
    "stream": _maybe(st.booleans()),
    "stream_options": _maybe(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "logit_bias": _maybe(st.dictionaries(st.integers(0, 500).map(str), st.floats(-100, 100),
                                         max_size=4),
                         st.dictionaries(st.integers(-5, 2**40).map(str) | _text,
                                         st.floats(), max_size=4)),
    "presence_penalty": _maybe(st.floats(-2, 2), st.floats()),
    "frequency_penalty": _maybe(st.floats(-2, 2), st.floats()),
    "repetition_penalty": _maybe(st.floats(0.1, 10), st.floats()),
    "min_tokens": _maybe(st.integers(0, 8), st.integers(-5, 2**40)),
    "ignore_eos": _maybe(st.booleans()),
    "stop_token_ids": _maybe(st.lists(st.integers(0, 500), max_size=3),
                             st.lists(st.integers(-3, 2**40), max_size=3)),
    "bad_words": _maybe(st.lists(st.one_of(st.text(min_size=1, max_size=8),
                                           st.lists(st.integers(0, 500), min_size=1,
                                                    max_size=3)), max_size=3),
                        st.lists(st.lists(st.integers(-1, 2**40), max_size=3), max_size=3)),
    "allowed_token_ids": _maybe(st.lists(st.integers(0, 500), min_size=1, max_size=4),
                                st.lists(st.integers(-1, 2**40), max_size=4)),
    "dry_multiplier": _maybe(st.floats(0, 2), st.floats()),
    "repetition_detection": _maybe(st.fixed_dictionaries(
        {}, optional={"min_pattern_size": st.integers(-3, 40),
                      "max_pattern_size": st.integers(-3, 40),
                      "min_count": st.integers(-3, 40)})),
    "skip_special_tokens": _maybe(st.booleans()),
}

_content_part = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": _text}),
    st.fixed_dictionaries({"type": st.just("image_url"),
                           "image_url": st.fixed_dictionaries({"url": _text})}),
    _any_json)
_valid_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system"]), "content": _text})
_hostile_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["tool", "bogus", ""]) | _any_json,
     "content": st.none() | st.lists(_content_part, max_size=3) | _any_json},
    optional={"name": _any_json})

CHAT_REQUIRED = {"messages": _maybe(
    st.lists(_valid_message, min_size=1, max_size=3),
    st.lists(st.one_of(_valid_message, _hostile_message), max_size=3))}
_name = st.from_regex(r"[a-z][a-z0-9_]{0,8}", fullmatch=True)
_json_schema = st.fixed_dictionaries(
    {"type": st.just("object"),
     "properties": st.dictionaries(_name, st.fixed_dictionaries(
         {"type": st.sampled_from(["string", "integer", "boolean", "number"])}), max_size=3)})
_tool = st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": _name}, optional={"description": _text, "parameters": _json_schema})})
_hostile_tool = st.fixed_dictionaries(
    {"type": st.just("function") | _any_json,
     "function": st.fixed_dictionaries({"name": _name | _any_json},
                                       optional={"parameters": _any_json}) | _any_json})
STRUCTURED = {
    "tools": _maybe(st.lists(_tool, min_size=1, max_size=2),
                    st.lists(_hostile_tool, max_size=2)),
    "tool_choice": _maybe(st.sampled_from(["auto", "none", "required"]),
                          st.fixed_dictionaries({"type": st.just("function"),
                                                 "function": st.fixed_dictionaries(
                                                     {"name": _name})})),
    "response_format": _maybe(
        st.just({"type": "text"}) | st.just({"type": "json_object"})
        | st.fixed_dictionaries({"type": st.just("json_schema"), "json_schema":
                                 st.fixed_dictionaries({"name": _name,
                                                        "schema": _json_schema})}),
        st.fixed_dictionaries({"type": st.sampled_from(["json_schema", "bogus"]),
                               "json_schema": st.fixed_dictionaries(
                                   {"name": _name, "schema": _any_json})})),
    "structured_outputs": _maybe(
        st.fixed_dictionaries({"regex": st.sampled_from(["[a-z]{1,4}", "(yes|no)", "\\d+"])})
        | st.fixed_dictionaries({"choice": st.lists(st.text(min_size=1, max_size=6),
                                                    min_size=1, max_size=3)})
        | st.fixed_dictionaries({"json": _json_schema}),
        st.fixed_dictionaries({}, optional={"regex": _text, "choice": _any_json,
                                            "json": _any_json, "grammar": _text,
                                            "json_object": _any_json})),
    "guided_regex": _maybe(st.sampled_from(["[a-z]+", "x|y"]), _text),
}

CHAT_FIELDS = {
    **SAMPLING,
    **STRUCTURED,
    "max_completion_tokens": _maybe(st.integers(1, 8), st.integers(-2, 2**40)),
    "logprobs": _maybe(st.booleans()),
    "top_logprobs": _maybe(st.integers(0, 20), st.integers(-1, 1000)),
    "add_generation_prompt": _maybe(st.booleans()),
    "chat_template_kwargs": _maybe(st.dictionaries(st.sampled_from(["enable_thinking", "x"]),
                                                   st.booleans(), max_size=2),
                                   st.dictionaries(_text, _any_json, max_size=2)),
}
_ids = st.lists(st.integers(0, 500), min_size=1, max_size=20)
COMPLETION_REQUIRED = {"prompt": _maybe(
    st.one_of(st.text(min_size=1, max_size=40), st.lists(st.text(min_size=1), min_size=1,
                                                         max_size=2),
              _ids, st.lists(_ids, min_size=1, max_size=2)),
    st.one_of(st.lists(st.integers(-2, 2**40), max_size=5), st.just([]), st.just("")))}
COMPLETION_FIELDS = {
    **SAMPLING,
    "echo": _maybe(st.booleans()),
    "logprobs": _maybe(st.integers(0, 5), st.integers(-1, 1000)),
    "prompt_logprobs": _maybe(st.integers(0, 5), st.integers(-1, 1000)),
    "response_format": STRUCTURED["response_format"],
    "structured_outputs": STRUCTURED["structured_outputs"],
    "guided_regex": STRUCTURED["guided_regex"],
}


@st.composite
def _bodies(draw, required: dict[str, Field], fields: dict[str, Field], hostile: bool):
    pick = (lambda f: f.mixed) if hostile else (lambda f: f.valid)
    if hostile and draw(st.integers(0, 9)) == 0:
        return draw(_any_json)  # not even the right shape
    body = {k: draw(pick(f)) for k, f in required.items()
            if not hostile or draw(st.integers(0, 9)) > 0}
    for name in draw(st.lists(st.sampled_from(sorted(fields)), max_size=4, unique=True)):
        body[name] = draw(pick(fields[name]))
    return body


def body_strategy(required: dict[str, Field], fields: dict[str, Field]) -> st.SearchStrategy:
    """Bodies with the required fields and up to four others: half of them all valid (the
    success paths, streams included), half with hostile values mixed in (every 4xx)."""
    return st.one_of(_bodies(required, fields, False), _bodies(required, fields, True))


@dataclass(frozen=True)
class FuzzRoute:
    path: str
    bodies: st.SearchStrategy


# One entry per generation route: a new route (Anthropic's /v1/messages) is one more line.
ROUTES = [
    FuzzRoute("/v1/chat/completions", body_strategy(CHAT_REQUIRED, CHAT_FIELDS)),
    FuzzRoute("/v1/completions", body_strategy(COMPLETION_REQUIRED, COMPLETION_FIELDS)),
]


@pytest.mark.parametrize("route", ROUTES, ids=[r.path for r in ROUTES])
def test_generated_bodies_never_5xx_or_hang(server, route: FuzzRoute):
    with httpx.Client(base_url=server.url, timeout=ANSWER_TIMEOUT_S) as http:

        @settings(max_examples=BODY_EXAMPLES, deadline=None,
                  suppress_health_check=list(HealthCheck))
        @given(body=route.bodies)
        def run(body) -> None:
            r = http.post(route.path, content=json.dumps(body, allow_nan=True),
                          headers={"content-type": "application/json"})
            check_response(r.status_code, r.headers.get("content-type", ""), r.content)

        run()
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert wait_until(lambda: server.metric("met_kv_blocks_used") == 0)
