"""Tool-call parsers on canned model outputs: the one-shot parse gives the expected content
and calls, and the streaming parser fed the same text in pieces (every character, every split
into two, every token of a real tokenizer) gives exactly the same."""

from __future__ import annotations

import json

import pytest

from met.serving.detokenizer import IncrementalDetokenizer
from met.serving.tool_parsers import get_tool_parser, select_tool_parser

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
        "hours": {"type": "array", "items": {"type": "number"}},
        "ratio": {"type": "number"}},
        "required": ["city"]}}}
TOOLS = [WEATHER]

# (parser, model text, expected content, expected [(name, arguments dict)])
CASES = [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
               '{"city": "Paris", "days": 3}}\n</tool_call>',
     "Let me check.", [("get_weather", {"city": "Paris", "days": 3})]),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
               '</tool_call>\n<tool_call>\n{"arguments": {"city": "Rome, \\"IT\\" {x}"}, '
               '"name": "get_weather"}\n</tool_call>',
     "", [("get_weather", {"city": "Oslo"}), ("get_weather", {"city": 'Rome, "IT" {x}'})]),
    ("hermes", "No tools needed: 2 < 3 and <tool is a word.", "No tools needed: 2 < 3 and "
     "<tool is a word.", []),
    ("hermes", '<tool_call>\nnot json\n</tool_call> after',
     "<tool_call>\nnot json\n</tool_call> after", []),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>\nDone.',
     "Done.", [("get_weather", {})]),
    ("hermes", 'Unicode: ☃ <tool_call>{"name": "get_weather", "arguments": {"city": "Zürich"}}'
               '</tool_call>', "Unicode: ☃", [("get_weather", {"city": "Zürich"})]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', "",
     [("get_weather", {"city": "Paris"})]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "A"}}; '
                    '{"name": "get_weather", "arguments": {"city": "B", "days": 1}}', "",
     [("get_weather", {"city": "A"}), ("get_weather", {"city": "B", "days": 1})]),
    ("llama3_json", "The answer is {not a call}.", "The answer is {not a call}.", []),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    ("llama3_json", '{"name": "Bob", "age": 3}', '{"name": "Bob", "age": 3}', []),
    ("llama3_json", 'Sure. <|python_tag|>{"name": "get_weather", "parameters": {"city": "X"}}',
     "Sure.", [("get_weather", {"city": "X"})]),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                '{"name": "get_weather", "arguments": {"city": "Lyon", "metric": true}}]', "",
     [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Lyon", "metric": True})]),
    ("mistral", 'Checking. [TOOL_CALLS]get_weather[ARGS]{"city": "Nice"}[TOOL_CALLS]get_weather'
                '[ARGS]{"city": "Metz"}', "Checking.",
     [("get_weather", {"city": "Nice"}), ("get_weather", {"city": "Metz"})]),
    ("mistral", "Plain [TOOL text [x].", "Plain [TOOL text [x].", []),
    ("mistral", ' [{"name": "get_weather", "arguments": {"city": "Pau"}}]', "",
     [("get_weather", {"city": "Pau"})]),  # the tag was a skipped special token
    ("mistral", '[{"a": 1}] is a JSON answer', '[{"a": 1}] is a JSON answer', []),
    ("mistral", "[ ] [x]", "[ ] [x]", []),
    ("qwen3_coder", "I will look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
                    "New York\n</parameter>\n<parameter=days>\n5\n</parameter>\n"
                    "<parameter=metric>\ntrue\n</parameter>\n<parameter=hours>\n[1, 2.5]\n"
                    "</parameter>\n<parameter=ratio>\n0.5\n</parameter>\n</function>\n"
                    "</tool_call>",
     "I will look.", [("get_weather", {"city": "New York", "days": 5, "metric": True,
                                       "hours": [1, 2.5], "ratio": 0.5})]),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\n12\n</parameter>\n"
                    "</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n"
                    "<parameter=city>\na <b> c\n</parameter>\n</function>\n</tool_call>", "",
     [("get_weather", {"city": "12"}), ("get_weather", {"city": "a <b> c"})]),
    ("qwen3_coder", "<function=get_weather>\n<parameter=city>\nBern\n</parameter>\n</function>",
     "", [("get_weather", {"city": "Bern"})]),
    ("qwen3_coder", "x <tool_call> y </tool_call> z", "x <tool_call> y </tool_call> z", []),
]


def _calls(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def _stream(parser, pieces: list[str]) -> tuple[str, list[tuple[str, str, str]]]:
    """Feed ``pieces``; the content and calls (id, name, arguments) the deltas add up to."""
    s = parser.streamer()
    content, calls = "", {}
    for d in [*(s.feed(p) for p in pieces), s.finish()]:
        content += d.content
        for tc in d.tool_calls:
            if tc.id is not None:
                assert tc.index == len(calls) and tc.arguments == "" and tc.name
                calls[tc.index] = [tc.id, tc.name, ""]
            calls[tc.index][2] += tc.arguments
    return content, [tuple(c) for c in calls.values()]


def _assert_stream_matches(parser, text: str, pieces: list[str]) -> None:
    assert "".join(pieces) == text
    content, calls = _parse(parser, text)
    s_content, s_calls = _stream(parser, pieces)
    assert s_content == content
    assert [(n, a) for _, n, a in s_calls] == [(c.name, c.arguments) for c in calls]
    assert all(cid.startswith("call_") for cid, _, _ in s_calls)
    assert len({cid for cid, _, _ in s_calls}) == len(s_calls)


def _parse(parser, text):
    return parser.parse(text)


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_one_shot_parse(name, text, content, calls):
    got_content, got_calls = get_tool_parser(name, tools=TOOLS).parse(text)
    assert got_content == content
    assert _calls(got_calls) == calls


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_stream_character_by_character_and_every_two_way_split(name, text, content, calls):
    parser = get_tool_parser(name, tools=TOOLS)
    _assert_stream_matches(parser, text, list(text))
    for cut in range(len(text) + 1):
        _assert_stream_matches(parser, text, [text[:cut], text[cut:]])


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_stream_token_by_token(name, text, content, calls, tiny_checkpoint):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_checkpoint("qwen3")))
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.push([t]) for t in ids] + [detok.flush()]
    assert len(ids) > 5
    _assert_stream_matches(get_tool_parser(name, tools=TOOLS), text, pieces)


def test_stream_releases_content_before_the_call_finishes():
    """Content is not held longer than a possible tag start; arguments stream as they come."""
    s = get_tool_parser("hermes").streamer()
    assert s.feed("Hello <tool").content == "Hello"
    d = s.feed('_call>{"name": "get_weather", "arguments": {"city": "Pa')
    assert [(t.index, t.name, t.arguments) for t in d.tool_calls] == [
        (0, "get_weather", ""), (0, None, '{"city": "Pa')]
    assert d.tool_calls[0].id.startswith("call_")
    assert s.feed('ris"}}').tool_calls[0].arguments == 'ris"}'
    assert s.feed("</tool_call>").tool_calls == []


def test_cut_off_call_keeps_what_was_written():
    """A call interrupted by max_tokens is still a call (its arguments may be incomplete)."""
    content, calls = get_tool_parser("hermes").parse(
        'Hi <tool_call>{"name": "get_weather", "arguments": {"city": "Pa')
    assert content == "Hi" and [(c.name, c.arguments) for c in calls] == [
        ("get_weather", '{"city": "Pa')]


def test_qwen3_coder_converts_by_schema_and_keeps_undeclared_as_text():
    parser = get_tool_parser("qwen3_coder", tools=TOOLS)
    _, calls = parser.parse("<tool_call>\n<function=get_weather>\n<parameter=days>\nseven\n"
                            "</parameter>\n<parameter=extra>\n42\n</parameter>\n</function>\n"
                            "</tool_call>")
    assert json.loads(calls[0].arguments) == {"days": "seven", "extra": "42"}


@pytest.mark.parametrize("template,expected", [
    ("{{ '<tool_call>' }}{% if tools %}{% endif %}", "hermes"),
    ("<function=x><parameter=y>{{ tools }}", "qwen3_coder"),
    ("[TOOL_CALLS] {{ tools }}", "mistral"),
    ("<|python_tag|>{{ tools }}", "llama3_json"),
    ("{% for m in messages %}{{ m.content }}{% endfor %}", "hermes"),
    (None, "hermes"),
])
def test_auto_picks_from_the_template(template, expected):
    assert select_tool_parser(template) == expected
    assert get_tool_parser("auto", template).name == expected


def test_unknown_parser_names_the_flag():
    with pytest.raises(ValueError, match="--tool-call-parser"):
        get_tool_parser("nope")


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "mistral", "qwen3_coder"])
def test_formatted_calls_parse_back(name):
    """What met writes into the history for a call is what the parser reads as that call."""
    parser = get_tool_parser(name, tools=TOOLS)
    calls = [("get_weather", {"city": "Paris", "days": 2}), ("get_weather", {"city": "Rome"})]
    _, parsed = parser.parse(parser.format_calls(calls))
    assert _calls(parsed) == calls


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "mistral", "qwen3_coder"])
def test_history_calls_with_non_object_arguments_still_render(name):
    text = get_tool_parser(name, tools=TOOLS).format_calls([("get_weather", "not json")])
    assert "get_weather" in text and "not json" in text


@pytest.mark.parametrize("cut", ['<tool_call>', '<tool_call>\n{"na',
                                 '<tool_call>\n{"name": "get_w'])
def test_call_cut_before_its_name_never_leaks_markup_into_content(cut):
    # max_tokens can stop a second call before its name is written (issue 36)
    text = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>\n'
            + cut)
    parser = get_tool_parser("hermes", TOOLS)
    content, calls = parser.parse(text)
    assert content == "" and [c.name for c in calls] == ["get_weather"]
    stream = parser.streamer()
    pieces = [stream.feed(ch) for ch in text] + [stream.finish()]
    assert "".join(p.content for p in pieces) == ""


_FIRST = {
    "llama3_json": '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}; ',
    "mistral": '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}',
    "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n"
                   "</function>\n</tool_call>\n",
}


@pytest.mark.parametrize("name,cut", [
    ("llama3_json", '{"na'), ("llama3_json", '{"name": "get_w'), ("llama3_json", "{"),
    ("mistral", "[TOOL_CALLS]"), ("mistral", "[TOOL_CALLS]get_w"),
    ("qwen3_coder", "<tool_call>"), ("qwen3_coder", "<tool_call>\n<func"),
    ("qwen3_coder", "<tool_call>\n<function=get_w"),
])
def test_other_parsers_never_leak_a_call_cut_before_its_name(name, cut):
    """The same max_tokens cut for every parser: the first call is kept, the cut one is
    dropped, and no markup reaches content (one-shot and stream)."""
    parser = get_tool_parser(name, TOOLS)
    text = _FIRST[name] + cut
    content, calls = parser.parse(text)
    assert content == "" and _calls(calls) == [("get_weather", {"city": "Rome"})], content
    stream = parser.streamer()
    pieces = [stream.feed(ch) for ch in text] + [stream.finish()]
    assert "".join(p.content for p in pieces) == ""
