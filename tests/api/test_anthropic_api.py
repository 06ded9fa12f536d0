"""Anthropic's Messages API through `met serve`, driven with the official `anthropic` SDK: a
tiny Qwen3 with a Qwen3-style chat template (tools, tool history, <think>), behind an API
key. The same conversation through /v1/chat/completions is the reference for what the
engine should produce."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest
from chat_templates import QWEN3_STYLE_TEMPLATE
from in_process import run_with_app, settled
from serve_harness import wait_until
from tiny_models import load_tokenizer

from met.api.anthropic.errors import error_body as anthropic_error_body
from met.serving import generate
from met.serving.detokenizer import IncrementalDetokenizer

KEY = "sk-anthropic-test-key"
SCHEMA = {"type": "object", "properties": {
    "city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"]}
WEATHER = {"name": "weather", "description": "Weather forecast", "input_schema": SCHEMA}
TIME = {"name": "time", "input_schema": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}
USER = [{"role": "user", "content": "Weather in Paris?"}]
# This SDK has no sampling arguments (newer models take none); the server still reads them.
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return str(tiny_checkpoint("qwen3"))


@pytest.fixture(scope="module")
def server(start_server, ckpt, tmp_path_factory):
    path = tmp_path_factory.mktemp("tmpl") / "qwen3_style.jinja"
    path.write_text(QWEN3_STYLE_TEMPLATE)
    return start_server([ckpt, "--dtype", "float32", "--max-model-len", "512",
                         "--served-model-name", "tiny", "--chat-template", str(path),
                         "--api-key", KEY, "--max-request-body", "64KiB"])


@pytest.fixture(scope="module")
def claude(server):
    """The official Anthropic SDK (it sends the key as x-api-key)."""
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120, headers={"x-api-key": KEY}) as c:
        yield c


def render(ckpt: str, messages: list[dict], **kwargs) -> list[int]:
    """The prompt as transformers renders it with the test template."""
    tok = load_tokenizer(ckpt)
    text = tok.apply_chat_template(messages, chat_template=QWEN3_STYLE_TEMPLATE, tokenize=False,
                                   add_generation_prompt=True, **kwargs)
    return tok(text, add_special_tokens=False)["input_ids"]


def _openai_tool(tool: dict) -> dict:
    fn = {"name": tool["name"], "parameters": tool["input_schema"]}
    if "description" in tool:
        fn["description"] = tool["description"]
    return {"type": "function", "function": fn}


def _blocks(message) -> list[dict]:
    return [b.model_dump(exclude_none=True) for b in message.content]


def test_create_answers_what_chat_completions_answers(claude, oai):
    m = claude.messages.create(model="tiny", max_tokens=12, messages=USER, extra_body=GREEDY,
                               system="Be brief.")
    chat = oai.chat.completions.create(
        model="tiny", max_tokens=12, temperature=0, extra_body={"enable_thinking": False},
        messages=[{"role": "system", "content": "Be brief."}, *USER])
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant"
    assert m.model == "tiny"
    assert [b.type for b in m.content] == ["text"]
    assert m.content[0].text == chat.choices[0].message.content
    assert m.stop_reason == "max_tokens" and m.stop_sequence is None
    u = m.usage
    assert u.output_tokens == 12
    assert u.input_tokens + u.cache_read_input_tokens == chat.usage.prompt_tokens


def test_system_blocks_are_the_system_string(claude):
    as_text = claude.messages.count_tokens(model="tiny", messages=USER, system="A\nB")
    as_blocks = claude.messages.count_tokens(model="tiny", messages=USER, system=[
        {"type": "text", "text": "A"}, {"type": "text", "text": "B"}])
    assert as_text.input_tokens == as_blocks.input_tokens


def test_count_tokens_is_the_rendered_prompt(claude, ckpt):
    r = claude.messages.count_tokens(model="tiny", messages=USER, tools=[WEATHER])
    expected = render(ckpt, USER, tools=[_openai_tool(WEATHER)], enable_thinking=False)
    assert r.input_tokens == len(expected)


def test_stop_sequence_ends_the_message_there(claude):
    full = claude.messages.create(model="tiny", max_tokens=16, messages=USER, extra_body=GREEDY)
    text = full.content[0].text
    stop = text[5:8]
    assert stop.strip(), text
    m = claude.messages.create(model="tiny", max_tokens=16, messages=USER, extra_body=GREEDY,
                               stop_sequences=[stop])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == text[:text.index(stop)]


def test_output_format_holds_the_text_to_a_schema_and_ends_the_turn(claude):
    yes_no = {"format": {"type": "json_schema", "schema": {"enum": ["yes", "no"]}}}
    m = claude.messages.create(model="tiny", max_tokens=40, messages=USER, extra_body=GREEDY,
                               output_config=yes_no)
    assert m.stop_reason == "end_turn" and m.stop_sequence is None
    assert json.loads(m.content[0].text) in ("yes", "no")
    with claude.messages.stream(model="tiny", max_tokens=40, messages=USER, extra_body=GREEDY,
                                output_config=yes_no) as stream:
        final = stream.get_final_message()
    assert _blocks(final) == _blocks(m) and final.stop_reason == "end_turn"


def test_a_final_assistant_message_is_a_prefill_the_model_continues(claude, oai, ckpt):
    history = [*USER, {"role": "assistant", "content": "The answer is"}]
    tok = load_tokenizer(ckpt)
    text = tok.apply_chat_template(history, chat_template=QWEN3_STYLE_TEMPLATE, tokenize=False,
                                   continue_final_message=True)
    assert text.endswith("The answer is")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert claude.messages.count_tokens(model="tiny", messages=history).input_tokens == len(ids)
    m = claude.messages.create(model="tiny", max_tokens=6, messages=history, extra_body=GREEDY)
    continued = oai.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0)
    assert m.content[0].text == continued.choices[0].text


def test_stream_events_come_in_anthropic_order(http):
    body = {"model": "tiny", "max_tokens": 6, "messages": USER, "temperature": 0,
            "stream": True}
    with http.stream("POST", "/v1/messages", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = []
    for block in raw.strip().split("\n\n"):
        name_line, data_line = block.split("\n")
        data = json.loads(data_line.removeprefix("data: "))
        assert name_line == f"event: {data['type']}"
        events.append(data)
    names = [e["type"] for e in events]
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert events[1]["content_block"] == {"type": "text", "text": ""}
    assert events[-2]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert events[-2]["usage"]["output_tokens"] == 6


def test_stream_accumulates_to_the_created_message(claude):
    kwargs = dict(model="tiny", max_tokens=14, messages=USER, extra_body=GREEDY)
    whole = claude.messages.create(**kwargs)
    with claude.messages.stream(**kwargs) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(texts) == whole.content[0].text
    assert _blocks(final) == _blocks(whole)
    assert (final.stop_reason, final.usage.output_tokens) == ("max_tokens", 14)
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == \
        whole.usage.input_tokens + whole.usage.cache_read_input_tokens


def test_tool_choice_any_returns_a_tool_use_block(claude):
    m = claude.messages.create(model="tiny", max_tokens=100, messages=USER, extra_body=GREEDY,
                               tools=[WEATHER, TIME],
                               tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert m.stop_reason == "tool_use"
    uses = [b for b in m.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name in ("weather", "time")
    assert uses[0].id.startswith("toolu_")
    jsonschema.validate(uses[0].input, (WEATHER if uses[0].name == "weather"
                                        else TIME)["input_schema"])


def test_named_tool_choice_and_its_stream(claude):
    kwargs = dict(model="tiny", max_tokens=100, messages=USER, extra_body=GREEDY,
                  tools=[WEATHER, TIME], tool_choice={"type": "tool", "name": "weather",
                                                     "disable_parallel_tool_use": True})
    whole = claude.messages.create(**kwargs)
    with claude.messages.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_message()
    use = whole.content[-1]
    assert use.type == "tool_use" and use.name == "weather"
    jsonschema.validate(use.input, SCHEMA)
    assert final.stop_reason == "tool_use"
    assert [(b.type, getattr(b, "name", None), getattr(b, "input", None))
            for b in final.content] == [(b.type, getattr(b, "name", None),
                                         getattr(b, "input", None)) for b in whole.content]
    partial = "".join(e.delta.partial_json for e in events
                      if e.type == "content_block_delta" and e.delta.type == "input_json_delta")
    assert json.loads(partial) == use.input


def test_tool_choice_none_renders_no_tools(claude):
    with_none = claude.messages.count_tokens(model="tiny", messages=USER, tools=[WEATHER],
                                             tool_choice={"type": "none"})
    without = claude.messages.count_tokens(model="tiny", messages=USER)
    assert with_none.input_tokens == without.input_tokens


def test_tool_use_and_tool_result_round_trip(claude, oai, ckpt):
    """The call the model made goes back with its result; the template renders both as the
    OpenAI-shaped history would, and the next turn is served."""
    first = claude.messages.create(model="tiny", max_tokens=100, messages=USER, extra_body=GREEDY,
                                   tools=[WEATHER], tool_choice={
                                       "type": "any", "disable_parallel_tool_use": True})
    use = next(b for b in first.content if b.type == "tool_use")
    history = [*USER, {"role": "assistant", "content": [b.model_dump(exclude_none=True)
                                                         for b in first.content]},
               {"role": "user", "content": [
                   {"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 21C"},
                   {"type": "text", "text": "And tomorrow?"}]}]
    counted = claude.messages.count_tokens(model="tiny", messages=history, tools=[WEATHER])
    openai_history = [*USER, {"role": "assistant", "content": "", "tool_calls": [
        {"id": use.id, "type": "function",
         "function": {"name": use.name, "arguments": use.input}}]},
        {"role": "tool", "tool_call_id": use.id, "content": "Sunny, 21C"},
        {"role": "user", "content": "And tomorrow?"}]
    assert counted.input_tokens == len(render(ckpt, openai_history,
                                              tools=[_openai_tool(WEATHER)],
                                              enable_thinking=False))
    second = claude.messages.create(model="tiny", max_tokens=8, messages=history,
                                    extra_body=GREEDY, tools=[WEATHER])
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == \
        counted.input_tokens
    # The first turn's prompt is a prefix of the second's: the cache served part of it.
    assert second.usage.cache_read_input_tokens > 0


def test_thinking_comes_back_as_a_thinking_block(claude):
    kwargs = dict(model="tiny", max_tokens=120, messages=USER, extra_body=GREEDY,
                  thinking={"type": "enabled", "budget_tokens": 8})
    whole = claude.messages.create(**kwargs)
    assert [b.type for b in whole.content] == ["thinking", "text"]
    assert whole.content[0].thinking and whole.content[1].text
    with claude.messages.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert _blocks(final) == _blocks(whole)
    kinds = [e.delta.type for e in events if e.type == "content_block_delta"]
    first_text = kinds.index("text_delta")
    assert set(kinds[:first_text]) == {"thinking_delta"}
    assert set(kinds[first_text:]) == {"text_delta"}


def test_thinking_budget_cuts_the_thinking_short(claude):
    """The tiny model never ends its thinking alone: the budget ends it, the answer follows."""
    m = claude.messages.create(model="tiny", max_tokens=150, messages=USER, extra_body=GREEDY,
                               thinking={"type": "enabled", "budget_tokens": 10})
    unbounded = claude.messages.create(model="tiny", max_tokens=150, messages=USER,
                                       extra_body=GREEDY, thinking={"type": "adaptive"})
    assert [b.type for b in unbounded.content] == ["thinking"]
    assert len(m.content[0].thinking) < len(unbounded.content[0].thinking)
    assert m.content[1].type == "text"


def test_without_thinking_there_is_no_thinking_block(claude):
    for thinking in ({"type": "disabled"}, None):
        extra = {} if thinking is None else {"thinking": thinking}
        m = claude.messages.create(model="tiny", max_tokens=8, messages=USER, extra_body=GREEDY,
                                   **extra)
        assert [b.type for b in m.content] == ["text"]


def _error(r: httpx.Response, status: int, kind: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    assert body["error"]["type"] == kind
    return body["error"]["message"]


@pytest.mark.parametrize("body, field", [
    ({"messages": USER}, "max_tokens"),
    ({"max_tokens": 0, "messages": USER}, "max_tokens"),
    ({"max_tokens": 8, "messages": []}, "messages"),
    ({"max_tokens": 8, "messages": USER, "temperature": 5}, "temperature"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "AAAA"}}]}]}, "messages.0.content.0.type"),
    ({"max_tokens": 8, "messages": USER, "thinking": {"type": "enabled",
                                                      "budget_tokens": 8}},
     "thinking.budget_tokens"),
    ({"max_tokens": 8, "messages": USER, "tools": [{"name": "x"}]}, "tools.0.input_schema"),
    ({"max_tokens": 8, "messages": USER, "tools": [{**WEATHER, "name": "bad name"}]},
     "tools.0.name"),
    ({"max_tokens": 8, "messages": USER, "tools": [WEATHER],
      "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
    ({"max_tokens": 8, "messages": USER, "tool_choice": {"type": "any"}}, "tool_choice"),
    ({"max_tokens": 8, "messages": USER, "stop_sequences": [""]}, "stop_sequences"),
    ({"max_tokens": 8, "messages": USER, "output_config": {"format": {
        "type": "json_schema", "schema": {"type": "object", "properties": 5}}}},
     "output_config.format.schema"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "content": "x"}]}]}, "messages.0.content.0.tool_use_id"),
])
def test_bad_input_is_a_400_naming_the_field(http, body, field):
    msg = _error(http.post("/v1/messages", json={"model": "tiny", **body}), 400,
                 "invalid_request_error")
    assert msg.startswith(field + ":"), msg


def test_unknown_routes_under_messages_answer_in_anthropic_shape(http):
    _error(http.post("/v1/messages/batches", json={}), 404, "not_found_error")
    _error(http.get("/v1/messages"), 405, "invalid_request_error")
    r = http.get("/v1/nope")  # elsewhere: OpenAI's shape
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def test_sdk_raises_typed_errors(claude):
    with pytest.raises(anthropic.NotFoundError) as e:
        claude.messages.create(model="claude-opus", max_tokens=8, messages=USER)
    assert e.value.body["error"]["type"] == "not_found_error"
    assert "claude-opus" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model="tiny", max_tokens=100000, messages=USER)
    assert e.value.body["error"]["message"].startswith("max_tokens:")


def test_oversized_body_is_413_request_too_large(http):
    big = [{"role": "user", "content": "x" * (70 << 10)}]
    _error(http.post("/v1/messages", json={"model": "tiny", "max_tokens": 8, "messages": big}),
           413, "request_too_large")


def test_x_api_key_and_bearer_both_authenticate(server):
    body = {"model": "tiny", "max_tokens": 2, "messages": USER}
    for headers in ({"x-api-key": KEY}, {"Authorization": f"Bearer {KEY}"},
                    {"Authorization": "Bearer proxy-token", "x-api-key": KEY}):
        assert httpx.post(server.url + "/v1/messages", json=body, headers=headers,
                          timeout=60).status_code == 200
    chat = {"model": "tiny", "max_tokens": 2, "messages": USER}
    assert httpx.post(server.base_url + "/chat/completions", json=chat, timeout=60,
                      headers={"x-api-key": KEY}).status_code == 200
    for headers in ({}, {"x-api-key": "wrong"}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(server.url + "/v1/messages", json=body, headers=headers, timeout=60)
        _error(r, 401, "authentication_error")
        assert KEY not in r.text
    # OpenAI's routes keep OpenAI's shape.
    r = httpx.post(server.base_url + "/chat/completions", json=chat, headers={"x-api-key": "no"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    wrong = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        wrong.messages.create(model="tiny", max_tokens=2, messages=USER)


def test_a_dropped_stream_frees_its_request(server, http):
    body = {"model": "tiny", "max_tokens": 400, "messages": USER, "stream": True,
            "temperature": 0, "thinking": {"type": "adaptive"}}
    with http.stream("POST", "/v1/messages", json=body) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 12:
                break
    assert wait_until(lambda: server.metric("met_requests_running") == 0
                      and server.metric("met_kv_blocks_used") == 0, timeout=30)


def test_a_failure_mid_stream_is_an_error_event(ckpt, monkeypatch):
    """A fault after the stream started ends it with Anthropic's ``error`` event (no
    message_stop); without streaming it is a 500 api_error; nothing is left running."""
    real_push = IncrementalDetokenizer.push
    pushes = {"n": 0}

    def push(self, token_ids):
        pushes["n"] += 1
        if pushes["n"] % 4 == 0:
            raise RuntimeError("simulated detokenizer fault")
        return real_push(self, token_ids)

    monkeypatch.setattr(generate.IncrementalDetokenizer, "push", push)
    body = {"model": "tiny", "max_tokens": 10, "messages": USER, "temperature": 0}

    async def work(c):
        streamed = await c.post("/v1/messages", json={**body, "stream": True})
        plain = await c.post("/v1/messages", json=body)
        left = await settled(c)
        return streamed, plain, left

    streamed, plain, left = run_with_app(ckpt, QWEN3_STYLE_TEMPLATE, work)
    assert streamed.status_code == 200
    blocks = streamed.text.strip().split("\n\n")
    names = [b.split("\n")[0].removeprefix("event: ") for b in blocks]
    assert names[0] == "message_start" and names[-1] == "error"
    assert "message_stop" not in names and "content_block_delta" in names
    error = json.loads(blocks[-1].split("\n")[1].removeprefix("data: "))
    assert error["type"] == "error" and error["error"]["type"] == "api_error"
    assert "simulated detokenizer fault" in error["error"]["message"]
    _error(plain, 500, "api_error")
    assert left == (0, 0)


def test_rate_limits_count_per_x_api_key_and_answer_429(start_server, ckpt, tmp_path):
    path = tmp_path / "qwen3_style.jinja"
    path.write_text(QWEN3_STYLE_TEMPLATE)
    limited = start_server([ckpt, "--dtype", "float32", "--max-model-len", "128",
                            "--served-model-name", "tiny", "--chat-template", str(path),
                            "--api-key", "key-a", "--api-key", "key-b",
                            "--rate-limit-rpm", "1"])
    body = {"model": "tiny", "max_tokens": 2, "messages": USER}

    def post(key: str) -> httpx.Response:
        return httpx.post(limited.url + "/v1/messages", json=body, headers={"x-api-key": key},
                          timeout=60)

    assert post("key-a").status_code == 200
    r = post("key-a")
    _error(r, 429, "rate_limit_error")
    assert int(r.headers["retry-after"]) >= 1
    assert post("key-b").status_code == 200  # another key has its own budget


@pytest.mark.parametrize("status, kind", [
    (400, "invalid_request_error"), (401, "authentication_error"), (404, "not_found_error"),
    (413, "request_too_large"), (429, "rate_limit_error"), (500, "api_error"),
    (503, "overloaded_error")])
def test_error_types_follow_anthropic_statuses(status, kind):
    assert anthropic_error_body(status, "why") == {
        "type": "error", "error": {"type": kind, "message": "why"}}
