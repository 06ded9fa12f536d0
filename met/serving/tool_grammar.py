"""The grammar that holds tool calls to a valid shape: an xgrammar structural tag built from
the tools' JSON schemas in the selected parser's format, put on the request's SamplingParams
as ``StructuredOutputs(structural_tag=...)`` (the sampler enforces it).

- ``tool_choice`` ``required`` or a named function: the output is one call (one or more with
  ``parallel_tool_calls``) and nothing else, so it always parses and its arguments validate;
- ``auto``: free text until the parser's start tag, then the call is held to a tool's schema.

A thinking model may think first: ``thinking="open"`` (the prompt opened ``<think>``) lets the
output run free until ``</think>``; ``"optional"`` allows a leading ``<think>…</think>``.
Tags are plain strings: a format whose tag is a special token (``[TOOL_CALLS]``) is then
written with ordinary tokens, which parses the same.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Literal

from met.sampling.params import StructuredOutputs
from met.serving.reasoning import ThinkParser
from met.serving.tool_parsers import ToolParser
from met.serving.tools import ToolRequest

Thinking = Literal["none", "optional", "open"]
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


def _schema(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or _ANY_OBJECT


def _content(schema: dict[str, Any], style: str = "json") -> dict[str, Any]:
    # At most one whitespace character in a row: a small model allowed free whitespace can
    # pad forever instead of closing the call.
    return {"type": "json_schema", "json_schema": schema, "style": style,
            "max_whitespace_cnt": 1}


def _json_call(begin: str, name: str, key: str, schema: dict[str, Any], end: str) -> dict:
    return {"type": "tag", "begin": f'{begin}{{"name": {json.dumps(name)}, "{key}": ',
            "content": _content(schema), "end": "}" + end}


def _call_tags(parser: str, tools: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One tag per tool: a whole call in ``parser``'s format."""
    tags = []
    for tool in tools:
        name, schema = tool["function"]["name"], _schema(tool)
        if parser == "hermes":
            tags.append(_json_call("<tool_call>\n", name, "arguments", schema, "\n</tool_call>"))
        elif parser == "llama3_json":
            tags.append(_json_call("", name, "parameters", schema, ""))
        elif parser == "mistral":
            tags.append(_json_call("", name, "arguments", schema, ""))
        elif parser == "qwen3_coder":
            tags.append({"type": "tag", "begin": f"<tool_call>\n<function={name}>\n",
                         "content": _content(schema, "qwen_xml"),
                         "end": "\n</function>\n</tool_call>"})
        else:
            raise ValueError(f"tool grammar: unknown parser {parser!r}")
    return tags


def _separator(parser: str) -> str:
    return {"llama3_json": "; ", "mistral": ", "}.get(parser, "\n")


def _calls(parser: str, tags: list[dict], parallel: bool) -> dict[str, Any]:
    """One or more calls and nothing else."""
    calls = {"type": "tags_with_separator", "tags": tags, "separator": _separator(parser),
             "at_least_one": True, "stop_after_first": not parallel}
    if parser == "mistral":
        return {"type": "sequence", "elements": [
            {"type": "const_string", "value": "[TOOL_CALLS]["}, calls,
            {"type": "const_string", "value": "]"}]}
    return calls


def _triggered(parser: str, tags: list[dict], parallel: bool) -> dict[str, Any]:
    """Free text; once the start tag appears, a call held to its schema."""
    if parser == "mistral":
        inner = {"type": "tags_with_separator", "tags": tags, "separator": ", ",
                 "at_least_one": True, "stop_after_first": not parallel}
        return {"type": "triggered_tags", "triggers": ["[TOOL_CALLS]"],
                "tags": [{"type": "tag", "begin": "[TOOL_CALLS][", "content": inner,
                          "end": "]"}]}
    trigger = {"hermes": "<tool_call>", "qwen3_coder": "<tool_call>",
               "llama3_json": '{"name": '}[parser]
    return {"type": "triggered_tags", "triggers": [trigger], "tags": tags,
            "stop_after_first": not parallel}


def tool_call_structural_tag(parser: str, tools: Sequence[dict[str, Any]], choice: str,
                             parallel: bool = True, thinking: Thinking = "none") -> dict:
    """The structural tag (as a mapping) for ``choice``: ``auto``, ``required`` or the name
    of one of ``tools`` (validated OpenAI tool dicts)."""
    if choice == "auto":
        fmt = _triggered(parser, _call_tags(parser, tools), parallel)
        return {"type": "structural_tag", "format": fmt}
    if choice != "required":
        tools = [t for t in tools if t["function"]["name"] == choice]
        if not tools:
            raise ValueError(f"tool_choice: no tool named {choice!r}")
    fmt = _calls(parser, _call_tags(parser, tools), parallel)
    if thinking != "none":
        # The thinking, then at most two newlines (bounded: a small model allowed free
        # whitespace can pad forever) before the calls.
        think = {"type": "sequence", "elements": [
            {"type": "tag", "begin": "" if thinking == "open" else "<think>",
             "content": {"type": "any_text"}, "end": "</think>"},
            {"type": "regex", "pattern": "\\n{0,2}"}]}
        if thinking == "optional":
            think = {"type": "optional", "content": think}
        fmt = {"type": "sequence", "elements": [think, fmt]}
    return {"type": "structural_tag", "format": fmt}


def tool_structured_outputs(parser: str, tools: Sequence[dict[str, Any]], choice: str,
                            parallel: bool = True,
                            thinking: Thinking = "none") -> StructuredOutputs:
    """``StructuredOutputs`` for the request, checked to build with xgrammar (a ValueError
    carries xgrammar's message otherwise)."""
    spec = tool_call_structural_tag(parser, tools, choice, parallel, thinking)
    check_structural_tag(spec)
    return StructuredOutputs(structural_tag=spec)


def check_structural_tag(spec: dict[str, Any]) -> None:
    """Raise ValueError unless xgrammar builds a grammar from ``spec``."""
    import xgrammar

    try:
        xgrammar.Grammar.from_structural_tag(json.dumps(spec))
    except Exception as e:  # xgrammar raises its own error types (and RuntimeErrors)
        raise ValueError(f"tools: cannot build the tool-call grammar: {e}") from None


def request_tool_grammar(tool_req: ToolRequest, parser: ToolParser,
                         reasoning: ThinkParser | None) -> StructuredOutputs | None:
    """The grammar a chat request's tools call for (None when tools are off). ``reasoning``
    (the request's reasoning parser) lets thinking come first; pass None when the engine
    keeps the grammar out of the thinking itself (a thinking budget)."""
    if not tool_req.active:
        return None
    thinking: Thinking = "none"  # also when the prompt closed the thinking (thinking off)
    if reasoning is not None and not reasoning.closed_in_prompt:
        thinking = "open" if reasoning.starts_inside else "optional"
    return tool_structured_outputs(parser.name, tool_req.tools, tool_req.choice,
                                   tool_req.parallel, thinking)
