"""response_format / structured_outputs over HTTP: the OpenAI SDK parses what comes back,
bad specs are 400s that name the field, and streams carry the same constrained text."""

from __future__ import annotations

import json
import re
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

# No free-form strings: a random model never closes one on its own; enums, booleans and
# bounded integers always finish.
SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "flags": {"type": "array", "items": {"type": "boolean"}, "minItems": 1,
                  "maxItems": 3},
    },
    "required": ["color", "count", "flags"],
    "additionalProperties": False,
}


class Reading(BaseModel):
    unit: Literal["C", "F"]
    value: int = Field(ge=-50, le=150)
    ok: bool


def _chat(client, **kw):
    return client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Give me a record."}],
        max_tokens=120, **kw)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_chat_json_schema_validates(client, temperature):
    resp = _chat(client, temperature=temperature, seed=7, response_format={
        "type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA,
                                               "strict": True}})
    choice = resp.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_sdk_parse_with_pydantic_model(client):
    resp = client.chat.completions.parse(
        model="tiny", messages=[{"role": "user", "content": "Temperature?"}],
        max_tokens=80, temperature=0.0, response_format=Reading)
    parsed = resp.choices[0].message.parsed
    assert isinstance(parsed, Reading)


def test_stream_carries_the_same_constrained_text(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}}
    whole = _chat(client, temperature=0.0, response_format=fmt).choices[0].message.content
    stream = _chat(client, temperature=0.0, response_format=fmt, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == whole
    jsonschema.validate(json.loads(text), SCHEMA)


def test_completions_choice_regex_and_n(client):
    resp = client.completions.create(
        model="tiny", prompt="Pick:", max_tokens=20, n=4, temperature=1.0, seed=1,
        extra_body={"structured_outputs": {"choice": ["alpha", "beta", "gamma"]}})
    assert {c.text for c in resp.choices} <= {"alpha", "beta", "gamma"}
    assert all(c.finish_reason == "stop" for c in resp.choices)
    resp = client.completions.create(
        model="tiny", prompt="Code:", max_tokens=20, temperature=0.0,
        extra_body={"guided_regex": "[A-Z]{3}-[0-9]{2}"})
    assert re.fullmatch(r"[A-Z]{3}-[0-9]{2}", resp.choices[0].text)


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": 5}}}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "root ::= nothing_here"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
])
def test_bad_specs_are_400_naming_the_field(http, body, param):
    r = http.post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "x"}], **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert err["message"].startswith(param), err


def test_sdk_raises_bad_request_for_an_invalid_schema(client):
    with pytest.raises(openai.BadRequestError, match="invalid json"):
        _chat(client, response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "required": 3}}})


def test_dead_end_is_an_error_not_a_hang(http):
    """The grammar needs 'zzz' but allowed_token_ids forbids it: the request fails with a
    400 naming the dead end (its own constraints conflict; a stream gets an error event),
    the server keeps serving."""
    body = {"model": "tiny", "prompt": "x", "max_tokens": 5,
            "structured_outputs": {"choice": ["zzz"]}, "allowed_token_ids": [5]}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 400 and "dead end" in r.json()["error"]["message"], r.text
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
        events = [line for line in s.iter_lines() if line.startswith("data: ")]
    assert any("dead end" in e and '"error"' in e for e in events), events
    assert events[-1] == "data: [DONE]"
    ok = http.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 3})
    assert ok.status_code == 200
