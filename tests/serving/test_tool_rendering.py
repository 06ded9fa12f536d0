"""Tools into the prompt (through the template, or described by met when the template cannot
render them), request validation, and a choice's output split into reasoning, content and
tool calls."""

from __future__ import annotations

import json

import pytest
from tiny_models import CHAT_TEMPLATE

from met.serving.chat_output import ChoiceOutput
from met.serving.errors import InvalidRequest
from met.serving.prompts import render_chat
from met.serving.protocol import ChatMessage
from met.serving.reasoning import ThinkParser
from met.serving.tool_parsers import get_tool_parser
from met.serving.tools import prepare_conversation, template_reads, tool_request

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Forecast",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
TOOL_TEMPLATE = ("{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}"
                 "{% endif %}{% for m in messages %}[{{ m.role }}]{{ m.content }}"
                 "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} "
                 "{{ c.function.arguments | tojson }}{% endfor %}{% endfor %}")
HISTORY = [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": "",
     "tool_calls": [{"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_checkpoint("qwen3")))


def test_a_template_without_tools_gets_a_system_message_and_history_as_text(tokenizer):
    """The tiny models' ChatML template (like SmolLM2's) never reads ``tools``."""
    assert not template_reads(CHAT_TEMPLATE, "tools")
    parser = get_tool_parser("hermes")
    prompt = render_chat(tokenizer, CHAT_TEMPLATE, [ChatMessage(**m) for m in HISTORY],
                         tools=[WEATHER], tool_parser=parser)
    text = prompt.text
    system = text[:text.index("<|im_start|>user")]
    assert system.startswith("<|im_start|>system\n# Tools")
    assert json.dumps(WEATHER) in system and "<tool_call>" in system
    # The assistant's call in the format the parser reads, the result as a user message.
    assistant = text[text.index("<|im_start|>assistant"):text.index("<|im_end|>",
                                                                   text.index("assistant"))]
    _, calls = parser.parse(assistant.removeprefix("<|im_start|>assistant\n"))
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather",
                                                                  {"city": "Oslo"})]
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_a_template_that_reads_tools_gets_them_and_parsed_arguments(tokenizer):
    prompt = render_chat(tokenizer, TOOL_TEMPLATE, [ChatMessage(**m) for m in HISTORY],
                         tools=[WEATHER], tool_parser=get_tool_parser("hermes"))
    assert prompt.text.startswith("TOOLS:get_weather;")
    assert 'CALL get_weather {"city": "Oslo"}' in prompt.text  # a mapping, not a string
    assert "[tool]sunny" in prompt.text


def test_an_existing_system_message_is_extended():
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    out, tools = prepare_conversation(CHAT_TEMPLATE, conv, [WEATHER], get_tool_parser("hermes"))
    assert tools is None and len(out) == 2
    assert out[0]["content"].startswith("Be brief.\n\n# Tools")


def test_no_tools_no_change():
    conv = [{"role": "user", "content": "hi"}]
    assert prepare_conversation(CHAT_TEMPLATE, conv, None, get_tool_parser("hermes")) == (
        conv, None)


@pytest.mark.parametrize("tools,choice,param", [
    ([{"type": "function"}], None, "tools.0.function"),
    ([{"type": "function", "function": {"name": ""}}], None, "tools.0.function.name"),
    ([WEATHER, WEATHER], None, "tools.1.function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], None,
     "tools.0.function.parameters"),
    ([WEATHER], {"type": "function"}, "tool_choice.function.name"),
    ([WEATHER], {"type": "tool"}, "tool_choice"),
])
def test_bad_tools_name_the_field(tools, choice, param):
    with pytest.raises(InvalidRequest) as e:
        tool_request(tools, choice, None)
    assert e.value.param == param


def test_tool_request_defaults():
    assert tool_request(None, None, None).choice == "none"
    req = tool_request([WEATHER], None, None)
    assert req.choice == "auto" and req.parallel and req.active
    assert not tool_request([WEATHER], "none", False).active
    named = tool_request([WEATHER], {"type": "function", "function": {"name": "get_weather"}},
                         False)
    assert named.choice == "get_weather" and not named.parallel
    no_params = tool_request([{"type": "function", "function": {"name": "f"}}], None, None)
    assert no_params.tools[0]["function"]["parameters"] == {"type": "object", "properties": {}}


OUTPUT = ('<think>\nThe user wants weather.\n</think>\n\nChecking.\n<tool_call>\n{"name": '
          '"get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')


@pytest.mark.parametrize("step", [1, 3, 7, len(OUTPUT)])
def test_choice_output_splits_reasoning_content_and_calls(step):
    """Fed in pieces (each piece one "token"), the result is the same; tokens up to the one
    that closes the thinking count as reasoning tokens."""
    out = ChoiceOutput(ThinkParser(), get_tool_parser("hermes"))
    reasoning, content, calls = "", "", []
    pieces = [OUTPUT[i:i + step] for i in range(0, len(OUTPUT), step)]
    for n, piece in enumerate(pieces, 1):
        d = out.feed(piece, n)
        reasoning, content, calls = reasoning + d.reasoning, content + d.content, \
            calls + d.tool_calls
    d = out.finish()
    reasoning, content, calls = reasoning + d.reasoning, content + d.content, calls + d.tool_calls
    assert reasoning == "The user wants weather." == out.reasoning_text
    assert content == "Checking." == out.content
    msg = out.message()
    assert msg["reasoning_content"] == reasoning and msg["content"] == "Checking."
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather"]
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo"}
    assert out.finish_reason("stop") == "tool_calls" and out.finish_reason("length") == "length"
    closes = OUTPUT.index("</think>") + len("</think>")
    assert out.reasoning_tokens == next(n for n in range(1, len(pieces) + 1)
                                        if n * step >= closes)


def test_choice_output_without_parsers_is_plain_text():
    out = ChoiceOutput(None, None)
    assert out.feed("<think>x</think>", 3).content == "<think>x</think>"
    out.finish()
    assert out.message() == {"role": "assistant", "content": "<think>x</think>",
                             "refusal": None}
    assert out.finish_reason("stop") == "stop" and out.reasoning_tokens == 0
