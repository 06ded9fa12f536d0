"""OpenAI's Responses API through `met serve`, driven with the official `openai` SDK
(create, stream, retrieve, delete, previous_response_id): a tiny Qwen3 with a Qwen3-style
chat template (tools, tool history, <think>). The same conversation through
/v1/chat/completions is the reference for what the engine should produce."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from chat_templates import QWEN3_STYLE_TEMPLATE
from in_process import run_with_app, settled
from serve_harness import wait_until

from met.api.context import ServerConfig
from met.serving import generate
from met.serving.detokenizer import IncrementalDetokenizer
from met.serving.response_store import ResponseStore

SCHEMA = {"type": "object", "properties": {
    "city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"]}
WEATHER = {"type": "function", "name": "weather", "description": "Weather forecast",
           "parameters": SCHEMA}
NO_THINK = {"effort": "none"}
YES_NO = {"format": {"type": "json_schema", "name": "answer",
                     "schema": {"enum": ["yes", "no"]}}}


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return str(tiny_checkpoint("qwen3"))


@pytest.fixture(scope="module")
def template_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tmpl") / "qwen3_style.jinja"
    path.write_text(QWEN3_STYLE_TEMPLATE)
    return str(path)


@pytest.fixture(scope="module")
def server(start_server, ckpt, template_file):
    return start_server([ckpt, "--dtype", "float32", "--max-model-len", "512",
                         "--served-model-name", "tiny", "--chat-template", template_file])


def _chat(client, messages: list[dict], max_tokens: int, **extra):
    return client.chat.completions.create(model="tiny", messages=messages, max_tokens=max_tokens,
                                          temperature=0, extra_body={"enable_thinking": False},
                                          **extra)


def test_create_answers_what_chat_completions_answers(client):
    r = client.responses.create(model="tiny", input="Weather in Paris?", instructions="Be brief.",
                                max_output_tokens=10, temperature=0, reasoning=NO_THINK)
    chat = _chat(client, [{"role": "system", "content": "Be brief."},
                          {"role": "user", "content": "Weather in Paris?"}], 10)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == "tiny"
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert [o.type for o in r.output] == ["message"]
    assert r.output[0].role == "assistant" and r.output[0].content[0].type == "output_text"
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == 10 and r.usage.total_tokens == r.usage.input_tokens + 10
    assert r.instructions == "Be brief." and r.max_output_tokens == 10


def test_message_items_are_the_same_conversation_as_a_string(client):
    as_text = client.responses.create(model="tiny", input="Hello", max_output_tokens=4,
                                      temperature=0, reasoning=NO_THINK, store=False)
    as_items = client.responses.create(
        model="tiny", max_output_tokens=4, temperature=0, reasoning=NO_THINK, store=False,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Hello"}]}])
    assert as_items.output_text == as_text.output_text
    assert as_items.usage.input_tokens == as_text.usage.input_tokens


def test_stream_accumulates_to_the_completed_response(client):
    kwargs = dict(model="tiny", input="Is it sunny?", max_output_tokens=20, temperature=0,
                  reasoning=NO_THINK, text=YES_NO)
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    names = [e.type for e in events]
    assert names[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert names[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert set(names[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert json.loads(deltas) in ("yes", "no")
    assert final.status == "completed" and final.output_text == deltas
    # Stored (store defaults to true): retrieve gives the same response.
    stored = client.responses.retrieve(final.id)
    assert (stored.id, stored.status, stored.output_text, stored.usage) == \
        (final.id, final.status, final.output_text, final.usage)
    whole = client.responses.create(**kwargs)
    assert whole.output_text == final.output_text and whole.status == "completed"


def test_retrieve_and_delete(client):
    r = client.responses.create(model="tiny", input="Hi", max_output_tokens=3, temperature=0,
                                reasoning=NO_THINK)
    got = client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.retrieve(r.id)
    assert r.id in e.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(r.id)
    unstored = client.responses.create(model="tiny", input="Hi", max_output_tokens=3,
                                       reasoning=NO_THINK, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_previous_response_id_continues_the_conversation(client):
    first = client.responses.create(model="tiny", input="Weather in Paris?", temperature=0,
                                    max_output_tokens=8, reasoning=NO_THINK)
    second = client.responses.create(model="tiny", input="And in Oslo?", temperature=0,
                                     max_output_tokens=8, reasoning=NO_THINK,
                                     previous_response_id=first.id)
    chat = _chat(client, [{"role": "user", "content": "Weather in Paris?"},
                          {"role": "assistant", "content": first.output_text},
                          {"role": "user", "content": "And in Oslo?"}], 8)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens_details.cached_tokens > 0  # the first turn's prefix
    # A third turn chains through both.
    third = client.responses.create(model="tiny", input="Thanks", max_output_tokens=2,
                                    reasoning=NO_THINK, previous_response_id=second.id)
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="tiny", input="x", previous_response_id="resp_nope")
    assert e.value.body["param"] == "previous_response_id"


def test_function_call_items_and_their_stream(client):
    kwargs = dict(model="tiny", input="Weather in Paris?", tools=[WEATHER],
                  tool_choice="required", parallel_tool_calls=False, max_output_tokens=100,
                  temperature=0, reasoning=NO_THINK)
    whole = client.responses.create(**kwargs)
    calls = [o for o in whole.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "weather"
    assert calls[0].call_id.startswith("call_") and whole.status == "completed"
    jsonschema.validate(json.loads(calls[0].arguments), SCHEMA)
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    streamed = [o for o in final.output if o.type == "function_call"]
    assert [(c.name, c.arguments) for c in streamed] == [(c.name, c.arguments) for c in calls]
    deltas = "".join(e.delta for e in events
                     if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert deltas == calls[0].arguments and [d.arguments for d in done] == [deltas]


def test_function_call_output_continues_through_the_template(client):
    first = client.responses.create(model="tiny", input="Weather in Paris?", tools=[WEATHER],
                                    tool_choice={"type": "function", "name": "weather"},
                                    parallel_tool_calls=False, max_output_tokens=100,
                                    temperature=0, reasoning=NO_THINK)
    call = next(o for o in first.output if o.type == "function_call")
    second = client.responses.create(
        model="tiny", previous_response_id=first.id, tools=[WEATHER], max_output_tokens=6,
        temperature=0, reasoning=NO_THINK,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"}])
    chat = _chat(client, [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{
            "id": call.call_id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny"}], 6,
        tools=[{"type": "function", "function": {k: WEATHER[k] for k in
                                                 ("name", "description", "parameters")}}])
    assert second.usage.input_tokens == chat.usage.prompt_tokens


def test_reasoning_comes_back_as_a_reasoning_item(client):
    """The template opens <think> and the tiny model never closes it: all reasoning."""
    kwargs = dict(model="tiny", input="Think.", max_output_tokens=12, temperature=0)
    whole = client.responses.create(**kwargs)
    assert [o.type for o in whole.output] == ["reasoning"]
    assert whole.output[0].content[0].type == "reasoning_text"
    assert whole.output[0].content[0].text
    assert whole.usage.output_tokens_details.reasoning_tokens == 12
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
    assert events[-1].type == "response.incomplete"  # cut off by max_output_tokens
    final = events[-1].response
    text = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert text == whole.output[0].content[0].text
    assert final.output[0].content[0].text == text
    effort = client.responses.create(**kwargs, reasoning={"effort": "low"}, store=False)
    assert effort.output[0].content[0].text == text  # the budget (4096) is never reached


@pytest.mark.parametrize("extra, param", [
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 5000}, "max_output_tokens"),
    ({"temperature": 9}, "temperature"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"tools": [{**WEATHER, "name": "no spaces"}]}, "tools.0.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
     "tool_choice.name"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"text": {"format": {"type": "json_schema", "name": "x",
                          "schema": {"type": "object", "properties": 5}}}},
     "text.format.schema"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"input": [{"role": "user", "content": [{"type": "input_image",
                                              "image_url": "http://x/y.png"}]}]},
     "input.0.content.0.type"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input.0.call_id"),
    ({"input": []}, "input"),
])
def test_bad_input_is_a_400_naming_the_field(http, extra, param):
    body = {"model": "tiny", "input": "Hi", **extra}
    r = http.post("/v1/responses", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"].startswith(param + ":"), err
    assert err["type"] == "invalid_request_error"


def test_a_dropped_stream_frees_its_request_and_stores_nothing(server, http):
    body = {"model": "tiny", "input": "Think.", "max_output_tokens": 400, "stream": True}
    rid = None
    with http.stream("POST", "/v1/responses", json=body) as r:
        for i, line in enumerate(r.iter_lines()):
            if line.startswith("data: ") and rid is None:
                rid = json.loads(line[6:])["response"]["id"]
            if i > 12:
                break
    assert wait_until(lambda: server.metric("met_requests_running") == 0
                      and server.metric("met_kv_blocks_used") == 0, timeout=30)
    assert http.get(f"/v1/responses/{rid}").status_code == 404


def test_the_store_keeps_the_newest_responses(start_server, ckpt, template_file):
    small = start_server([ckpt, "--dtype", "float32", "--max-model-len", "128",
                          "--served-model-name", "tiny", "--chat-template", template_file,
                          "--responses-store-max", "2"])
    c = openai.OpenAI(base_url=small.base_url, api_key="unused", max_retries=0, timeout=120)
    ids = [c.responses.create(model="tiny", input="Hi", max_output_tokens=2,
                              reasoning=NO_THINK).id for _ in range(3)]
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(ids[0])
    assert [c.responses.retrieve(i).id for i in ids[1:]] == ids[1:]
    with pytest.raises(openai.NotFoundError):  # its conversation is gone too
        c.responses.create(model="tiny", input="x", previous_response_id=ids[0])


def test_store_bounds_count_and_age():
    now = [0.0]
    store = ResponseStore(max_entries=3, ttl_s=10, clock=lambda: now[0])
    for i in range(4):
        store.put({"id": f"r{i}"}, [])
        now[0] += 1
    assert store.get("r0") is None and [store.get(f"r{i}").response["id"]
                                        for i in (1, 2, 3)] == ["r1", "r2", "r3"]
    now[0] = 11.5  # r1 was stored at 1, r2 at 2: r1 is past its 10 s
    assert store.get("r1") is None and store.get("r2") is not None
    assert len(store) == 2
    assert store.delete("r2") and not store.delete("r2")
    nothing = ResponseStore(max_entries=0)
    nothing.put({"id": "x"}, [])
    assert nothing.get("x") is None


@pytest.mark.parametrize("field, value, flag", [
    ("responses_store_max", -1, "--responses-store-max"),
    ("responses_store_ttl", 0, "--responses-store-ttl"),
])
def test_store_flags_are_validated(field, value, flag):
    with pytest.raises(ValueError, match=flag):
        ServerConfig(served_model_names=("tiny",), **{field: value})


def test_openapi_documents_the_bodies(http):
    spec = http.get("/openapi.json").json()
    assert {"/v1/responses", "/v1/responses/{response_id}", "/v1/messages",
            "/v1/messages/count_tokens"} <= set(spec["paths"])
    schemas = spec["components"]["schemas"]
    assert "previous_response_id" in schemas["ResponsesRequest"]["properties"]
    assert "max_tokens" in schemas["MessagesRequest"]["required"]


def test_non_json_output_is_incomplete_not_failed(http):
    """A cut-off output is a response too (status incomplete), streamed or not."""
    body = {"model": "tiny", "input": "Hi", "max_output_tokens": 3,
            "reasoning": {"effort": "none"}, "stream": True}
    with http.stream("POST", "/v1/responses", json=body) as r:
        raw = r.read().decode()
    names = [b.split("\n")[0].removeprefix("event: ") for b in raw.strip().split("\n\n")]
    assert names[-1] == "response.incomplete"
    assert "error" not in names and httpx.codes.OK == r.status_code


def test_a_failure_mid_stream_is_an_error_event(ckpt, monkeypatch):
    """A fault after the stream started sends ``error`` then ``response.failed`` (never
    response.completed) and stores nothing; without streaming it is a 500."""
    real_push = IncrementalDetokenizer.push
    pushes = {"n": 0}

    def push(self, token_ids):
        pushes["n"] += 1
        if pushes["n"] % 4 == 0:
            raise RuntimeError("simulated detokenizer fault")
        return real_push(self, token_ids)

    monkeypatch.setattr(generate.IncrementalDetokenizer, "push", push)
    body = {"model": "tiny", "input": "Hi", "max_output_tokens": 10, "temperature": 0}

    async def work(c):
        streamed = await c.post("/v1/responses", json={**body, "stream": True})
        plain = await c.post("/v1/responses", json=body)
        rid = json.loads(streamed.text.split("\n")[1].removeprefix("data: "))["response"]["id"]
        stored = await c.get(f"/v1/responses/{rid}")
        left = await settled(c)
        return streamed, plain, stored, left

    streamed, plain, stored, left = run_with_app(ckpt, QWEN3_STYLE_TEMPLATE, work)
    assert streamed.status_code == 200
    events = [json.loads(b.split("\n")[1].removeprefix("data: "))
              for b in streamed.text.strip().split("\n\n")]
    names = [e["type"] for e in events]
    assert names[0] == "response.created" and names[-2:] == ["error", "response.failed"]
    assert "response.completed" not in names
    assert "simulated detokenizer fault" in events[-2]["message"]
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and "simulated" in failed["error"]["message"]
    assert plain.status_code == 500 and plain.json()["error"]["type"] == "server_error"
    assert stored.status_code == 404
    assert left == (0, 0)
