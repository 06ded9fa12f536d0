"""Tool calling and the reasoning split through `met serve`, driven with the official OpenAI
SDK: a tiny Qwen3 with a Qwen3-style chat template (tests/api/chat_templates.py: it renders
tools, tool history and <think>), and the embedded SmolLM2, whose template knows nothing of
tools."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from chat_templates import QWEN3_STYLE_TEMPLATE
from tiny_models import load_tokenizer

from met import LLM, SamplingParams

# Small on purpose: the tiny tokenizer spends about one token per character of JSON, and the
# tiny model holds 512 positions.
SCHEMA = {"type": "object", "properties": {
    "city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"]}
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": SCHEMA}}
TIME = {"type": "function", "function": {"name": "time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
USER = [{"role": "user", "content": "Weather in Paris?"}]
NO_THINK = {"enable_thinking": False}
MAX_MODEL_LEN = 512


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
    return start_server([ckpt, "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
                         "--served-model-name", "tiny", "--chat-template", template_file])


@pytest.fixture(scope="module")
def offline(ckpt):
    return LLM(ckpt, dtype="float32", max_model_len=MAX_MODEL_LEN)


def render(ckpt: str, messages: list[dict], **kwargs) -> list[int]:
    """The prompt as transformers renders it with the test template."""
    tok = load_tokenizer(ckpt)
    text = tok.apply_chat_template(messages, chat_template=QWEN3_STYLE_TEMPLATE, tokenize=False,
                                   add_generation_prompt=True, **kwargs)
    return tok(text, add_special_tokens=False)["input_ids"]


def _check_call(call, schema: dict) -> dict:
    assert call.id.startswith("call_") and call.type == "function"
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, schema)
    return args


def test_required_tool_call_parses_and_validates(client):
    r = client.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER],
                                       tool_choice="required", max_tokens=100, temperature=0,
                                       parallel_tool_calls=False,
                                       extra_body={"chat_template_kwargs": NO_THINK})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    assert choice.message.tool_calls[0].function.name == "weather"
    _check_call(choice.message.tool_calls[0], SCHEMA)


def test_named_tool_choice_calls_that_tool(client):
    r = client.chat.completions.create(
        model="tiny", messages=USER, tools=[WEATHER, TIME], max_tokens=100, temperature=0,
        tool_choice={"type": "function", "function": {"name": "time"}},
        parallel_tool_calls=False, extra_body={"enable_thinking": False})
    calls = r.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["time"]
    _check_call(calls[0], TIME["function"]["parameters"])


def test_streamed_tool_call_equals_the_non_streamed_one(client):
    kwargs = dict(model="tiny", messages=USER, tools=[WEATHER], tool_choice="required",
                  max_tokens=100, temperature=0, parallel_tool_calls=False,
                  extra_body={"chat_template_kwargs": NO_THINK})
    whole = client.chat.completions.create(**kwargs).choices[0]
    # The SDK's stream helper accumulates the deltas into a completion.
    with client.chat.completions.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    done = [e for e in events if e.type == "tool_calls.function.arguments.done"]
    assert [e.name for e in done] == ["weather"]
    assert json.loads(done[0].arguments) == json.loads(whole.message.tool_calls[0]
                                                       .function.arguments)
    # Raw chunks: one header per call (id, type, name, empty arguments), then fragments.
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    deltas = [tc for ch in chunks for c in ch.choices for tc in (c.delta.tool_calls or [])]
    head, rest = deltas[0], deltas[1:]
    assert head.index == 0 and head.id.startswith("call_") and head.type == "function"
    assert head.function.name == "weather" and head.function.arguments == ""
    assert rest and all(d.id is None and d.function.name is None for d in rest)
    assert "".join(d.function.arguments for d in rest) == \
        whole.message.tool_calls[0].function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_history_is_rendered_through_the_template(client, ckpt):
    """A multi-turn agent loop: the assistant's call (arguments as JSON text) and the tool's
    result are rendered as the template renders them (arguments as a mapping)."""
    args = {"city": "Oslo", "days": 2}
    history = USER + [
        {"role": "assistant", "content": "",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "weather", "arguments": json.dumps(args)}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    r = client.chat.completions.create(model="tiny", messages=history, tools=[WEATHER],
                                       max_tokens=3, temperature=0,
                                       extra_body={"chat_template_kwargs": NO_THINK})
    expected = history[:1] + [{**history[1], "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "weather", "arguments": args}}]}] + history[2:]
    assert r.usage.prompt_tokens == len(render(ckpt, expected, tools=[WEATHER], **NO_THINK))


def test_tool_choice_none_renders_no_tools(client, ckpt):
    r = client.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER],
                                       tool_choice="none", max_tokens=4, temperature=0,
                                       extra_body={"chat_template_kwargs": NO_THINK})
    assert r.usage.prompt_tokens == len(render(ckpt, USER, **NO_THINK))
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason == "length"


def test_reasoning_split_when_the_prompt_opened_thinking(client, offline, ckpt):
    """The template opens <think>; the tiny model never closes it, so all is reasoning."""
    ref = offline.generate([{"prompt_token_ids": render(ckpt, USER)}],
                           SamplingParams(max_tokens=16, temperature=0))[0].outputs[0].text
    r = client.chat.completions.create(model="tiny", messages=USER, max_tokens=16,
                                       temperature=0)
    msg = r.choices[0].message
    assert msg.reasoning_content == ref.strip() and msg.content == ""
    assert r.usage.completion_tokens_details.reasoning_tokens == 16
    chunks = list(client.chat.completions.create(model="tiny", messages=USER, max_tokens=16,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    streamed = "".join(getattr(c.delta, "reasoning_content", None) or ""
                       for ch in chunks for c in ch.choices)
    assert streamed == ref.strip()
    assert "".join(c.delta.content or "" for ch in chunks for c in ch.choices) == ""
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == 16


def test_thinking_off_gives_only_content(client, offline, ckpt):
    ref = offline.generate([{"prompt_token_ids": render(ckpt, USER, **NO_THINK)}],
                           SamplingParams(max_tokens=12, temperature=0))[0].outputs[0].text
    r = client.chat.completions.create(model="tiny", messages=USER, max_tokens=12,
                                       temperature=0, extra_body={"enable_thinking": False})
    assert r.choices[0].message.content == ref
    assert r.choices[0].message.reasoning_content is None
    assert r.usage.completion_tokens_details.reasoning_tokens == 0


@pytest.mark.parametrize("tools,choice,param", [
    ([{"type": "retrieval"}], None, "tools.0.type"),
    ([{"type": "function", "function": {"name": "bad name!"}}], None, "tools.0.function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], None,
     "tools.0.function.parameters"),
    ([WEATHER], {"type": "function", "function": {"name": "time"}},
     "tool_choice.function.name"),
    ([WEATHER], "sometimes", "tool_choice"),
    (None, "required", "tool_choice"),
])
def test_bad_tool_fields_are_400s_naming_the_field(client, tools, choice, param):
    kwargs = {"tools": tools} if tools is not None else {}
    if choice is not None:
        kwargs["tool_choice"] = choice
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=USER, max_tokens=2, **kwargs)
    assert e.value.body["param"] == param
    assert param in e.value.body["message"]


def test_tool_message_without_tool_call_id_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", max_tokens=2, messages=USER + [
            {"role": "tool", "content": "x"}])
    assert e.value.body["param"] == "messages.1.tool_call_id"


def test_every_choice_gets_its_own_calls(client):
    r = client.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER],
                                       tool_choice="required", parallel_tool_calls=False, n=2,
                                       temperature=1.0, seed=7, max_tokens=100,
                                       extra_body={"enable_thinking": False})
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        assert c.finish_reason == "tool_calls"
        _check_call(c.message.tool_calls[0], SCHEMA)
    ids = [c.message.tool_calls[0].id for c in r.choices]
    assert len(set(ids)) == 2


def test_required_tools_and_a_response_format_do_not_mix(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER],
                                       tool_choice="required", max_tokens=4,
                                       response_format={"type": "json_object"})
    assert e.value.body["param"] == "tool_choice"
    # With auto, the response format rules: the output is a JSON object, no call is parsed.
    r = client.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER],
                                       max_tokens=60, temperature=0,
                                       response_format={"type": "json_object"},
                                       extra_body={"enable_thinking": False})
    assert r.choices[0].message.tool_calls is None
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
