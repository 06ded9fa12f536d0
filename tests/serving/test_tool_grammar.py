"""The tool-call grammar: xgrammar builds it, a matcher accepts a valid call in the parser's
format and rejects invalid ones, and decoding random logits under its mask (a stand-in for
a model) always yields calls that parse and validate against the tool's schema."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
import xgrammar as xgr

from met.serving.tool_grammar import tool_call_structural_tag, tool_structured_outputs
from met.serving.tool_parsers import get_tool_parser

SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "unit": {"type": "string", "enum": ["c", "f"]},
    "days": {"type": "integer"}},
    "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}},
        "required": ["zone"], "additionalProperties": False}}},
]
PARSERS = ["hermes", "llama3_json", "mistral", "qwen3_coder"]
GOOD = {"city": "Paris", "unit": "c"}


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_checkpoint("qwen3")))


@pytest.fixture(scope="module")
def compiler(tokenizer):
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    return xgr.GrammarCompiler(info)


def _call_text(parser: str, calls) -> str:
    text = get_tool_parser(parser, tools=TOOLS).format_calls(calls)
    return text.removeprefix("<|python_tag|>")  # the grammar writes bare JSON calls


def _accepts(compiler, spec: dict, text: str) -> bool:
    matcher = xgr.GrammarMatcher(compiler.compile_structural_tag(json.dumps(spec)),
                                 terminate_without_stop_token=True)
    return matcher.accept_string(text) and matcher.is_terminated()


@pytest.mark.parametrize("parser", PARSERS)
def test_required_accepts_a_valid_call_and_rejects_invalid_ones(parser, compiler):
    spec = tool_call_structural_tag(parser, TOOLS, "required", parallel=False)
    assert _accepts(compiler, spec, _call_text(parser, [("get_weather", GOOD)]))
    # wrong argument type, unknown tool, missing required field, text before the call
    assert not _accepts(compiler, spec, _call_text(parser, [("get_weather", {**GOOD,
                                                                             "days": "x"})]))
    assert not _accepts(compiler, spec, _call_text(parser, [("get_rain", GOOD)]))
    assert not _accepts(compiler, spec, _call_text(parser, [("get_weather", {"city": "a"})]))
    assert not _accepts(compiler, spec, "Sure! " + _call_text(parser, [("get_weather", GOOD)]))
    # two calls only with parallel_tool_calls
    two = _call_text(parser, [("get_weather", GOOD), ("get_time", {"zone": "UTC"})])
    assert not _accepts(compiler, spec, two)
    assert _accepts(compiler, tool_call_structural_tag(parser, TOOLS, "required"), two)


@pytest.mark.parametrize("parser", PARSERS)
def test_named_choice_allows_only_that_function(parser, compiler):
    spec = tool_call_structural_tag(parser, TOOLS, "get_time")
    assert _accepts(compiler, spec, _call_text(parser, [("get_time", {"zone": "CET"})]))
    assert not _accepts(compiler, spec, _call_text(parser, [("get_weather", GOOD)]))


@pytest.mark.parametrize("parser", ["hermes", "qwen3_coder", "mistral"])
def test_auto_is_free_text_until_the_tag_then_holds_the_call(parser, compiler):
    spec = tool_call_structural_tag(parser, TOOLS, "auto")
    assert _accepts(compiler, spec, "Just an answer, no call.")
    assert _accepts(compiler, spec, "Let me look. " + _call_text(parser, [("get_weather", GOOD)]))
    assert not _accepts(compiler, spec,
                        "Let me look. " + _call_text(parser, [("get_weather", {"city": 1})]))


def test_thinking_may_come_first(compiler):
    call = _call_text("hermes", [("get_weather", GOOD)])
    opened = tool_call_structural_tag("hermes", TOOLS, "required", thinking="open")
    assert _accepts(compiler, opened, "hmm, weather.</think>\n\n" + call)
    optional = tool_call_structural_tag("hermes", TOOLS, "required", thinking="optional")
    assert _accepts(compiler, optional, call)
    assert _accepts(compiler, optional, "<think>ok</think>\n" + call)
    assert not _accepts(compiler, optional, "ok</think>\n" + call)


def test_unknown_named_tool_and_bad_schema_are_value_errors():
    with pytest.raises(ValueError, match="tool_choice"):
        tool_structured_outputs("hermes", TOOLS, "get_rain")
    bad = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "pattern": "(unclosed"}}}}}]
    with pytest.raises(ValueError, match="tools"):
        tool_structured_outputs("hermes", bad, "required")


@pytest.mark.parametrize("parser", PARSERS)
def test_decoding_under_the_mask_always_gives_valid_calls(parser, compiler, tokenizer):
    """Random logits stand in for a model; the mask alone makes the output a valid call."""
    so = tool_structured_outputs(parser, TOOLS, "required", parallel=True)
    compiled = compiler.compile_structural_tag(so.structural_tag)
    vocab = len(tokenizer)
    gen = torch.Generator().manual_seed(0)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for trial in range(3):
        matcher = xgr.GrammarMatcher(compiled)
        bitmask = xgr.allocate_token_bitmask(1, vocab)
        ids: list[int] = []
        for _ in range(2000):
            if matcher.is_terminated():
                break
            logits = torch.randn(1, vocab, generator=gen)
            logits[0, tokenizer.eos_token_id] = 50.0  # a model that stops when it may
            matcher.fill_next_token_bitmask(bitmask)
            xgr.apply_token_bitmask_inplace(logits, bitmask)
            token = int(logits.argmax())
            assert matcher.accept_token(token)
            ids.append(token)
        assert matcher.is_terminated(), f"{parser} trial {trial} did not finish"
        text = tokenizer.decode(ids, skip_special_tokens=True)
        assert ids[-1] == tokenizer.eos_token_id
        content, calls = get_tool_parser(parser, tools=TOOLS).parse(text)
        assert content == "" and calls, text
        for c in calls:
            jsonschema.validate(json.loads(c.arguments), schemas[c.name])


def test_thinking_prefix_follows_the_prompt():
    from met.serving.reasoning import ThinkParser
    from met.serving.tool_grammar import request_tool_grammar
    from met.serving.tools import tool_request

    req = tool_request(TOOLS, "required", False)
    parser = get_tool_parser("hermes", tools=TOOLS)

    def spec(reasoning):
        return json.loads(request_tool_grammar(req, parser, reasoning).structural_tag)

    assert "</think>" not in json.dumps(spec(None))
    assert "</think>" not in json.dumps(spec(ThinkParser(closed_in_prompt=True)))  # thinking off
    opened = spec(ThinkParser(starts_inside=True))["format"]["elements"][0]
    assert opened["elements"][0]["begin"] == "" and opened["elements"][0]["end"] == "</think>"
    optional = spec(ThinkParser())["format"]["elements"][0]
    assert optional["type"] == "optional"
    assert not request_tool_grammar(tool_request(TOOLS, "none", True), parser, None)
