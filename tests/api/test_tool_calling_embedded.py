"""Tool use on the embedded SmolLM2, whose chat template knows nothing of tools: met describes
the tools in a system message, and the grammar makes ``tool_choice: required`` return a call
whose arguments validate."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.slow

NAME = "SmolLM2-135M-Instruct"
SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 20},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city", "parameters": SCHEMA}}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def server(start_server):
    # float32, the exact reference: the answers checked below are float32's.
    return start_server(["--dtype", "float32", "--max-model-len", "1024", "--max-num-seqs", "4"])


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=300)


def test_required_call_on_a_template_without_tools(client):
    r = client.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER],
                                       tool_choice="required", parallel_tool_calls=False,
                                       max_tokens=64, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    call, = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMA)
    assert "paris" in args["city"].lower()  # the system message told the model the tools


def test_streamed_call_and_a_second_turn_with_the_result(client):
    kwargs = dict(model=NAME, tools=[WEATHER], max_tokens=64, temperature=0)
    with client.chat.completions.stream(messages=ASK, tool_choice="required",
                                        parallel_tool_calls=False, **kwargs) as stream:
        first = stream.get_final_completion().choices[0]
    assert first.finish_reason == "tool_calls"
    call = first.message.tool_calls[0]
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA)
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": '
                                                             '"clear"}'},
    ]
    r = client.chat.completions.create(messages=history, tool_choice="none", **kwargs)
    answer = r.choices[0].message
    assert answer.tool_calls is None and answer.content
    assert "21" in answer.content  # it read the tool's result


TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


@pytest.mark.parametrize("tool_choice", ["required", "auto"])
def test_a_reply_cut_inside_a_call_never_leaks_markup(client, tool_choice):
    """Two tools, sampled replies cut by max_tokens at many points (the cut that once put raw
    <tool_call> markup into content was seed 9 of this prompt under "required"): content never
    holds call markup, and a cut reply says finish_reason "length"."""
    ask = [{"role": "user", "content": "Weather in Rome, f"}]
    seen_cut_call = False
    for seed in (9, 3, 5):
        for max_tokens in (12, 20, 28, 36, 44):
            r = client.chat.completions.create(
                model=NAME, messages=ask, tools=[WEATHER, TIME], tool_choice=tool_choice,
                max_tokens=max_tokens, temperature=1.0, seed=seed)
            choice = r.choices[0]
            content = choice.message.content or ""
            where = f"seed {seed}, max_tokens {max_tokens}: {content!r}"
            assert "<tool_call" not in content and "</tool_call" not in content, where
            assert '"name": "get_' not in content, where
            if r.usage.completion_tokens >= max_tokens:
                assert choice.finish_reason == "length", where
                seen_cut_call |= bool(choice.message.tool_calls)
            for call in choice.message.tool_calls or []:
                assert call.function.name in ("get_weather", "get_time"), where
    if tool_choice == "required":
        assert seen_cut_call, "no reply was cut inside a call: the test proved nothing"
