"""Tool-call parsers, one module per model family's format, and ``auto`` selection.

``get_tool_parser(name, template, tools)`` returns a parser; ``name`` is one of
``TOOL_PARSERS`` or ``"auto"`` (chosen from the chat template's text: the format the template
teaches the model, hermes when it teaches none, since met then describes the tools itself).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from met.serving.tool_parsers.base import (
    ParsedCall,
    StreamDelta,
    ToolCallDelta,
    ToolCallStream,
    ToolParser,
    new_call_id,
)
from met.serving.tool_parsers.hermes import HermesToolParser
from met.serving.tool_parsers.llama3_json import Llama3JsonToolParser
from met.serving.tool_parsers.mistral import MistralToolParser
from met.serving.tool_parsers.qwen3_coder import Qwen3CoderToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser,
                        Qwen3CoderToolParser)
}
TOOL_PARSER_CHOICES = ("auto", *TOOL_PARSERS)


def select_tool_parser(template: str | None) -> str:
    """The parser a chat template's format calls for (``hermes`` when it shows none)."""
    t = template or ""
    if "<function=" in t and "<parameter=" in t:
        return "qwen3_coder"
    if "<tool_call>" in t:
        return "hermes"
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "<|python_tag|>" in t or '"parameters"' in t:
        return "llama3_json"
    return "hermes"


def get_tool_parser(name: str, template: str | None = None,
                    tools: Sequence[dict[str, Any]] | None = None) -> ToolParser:
    """A parser by name (``auto``: from ``template``), knowing the request's ``tools``."""
    if name == "auto":
        name = select_tool_parser(template)
    if name not in TOOL_PARSERS:
        raise ValueError(f"--tool-call-parser: unknown parser {name!r}; expected one of "
                         f"{', '.join(TOOL_PARSER_CHOICES)}")
    return TOOL_PARSERS[name](tools)


__all__ = [
    "TOOL_PARSERS", "TOOL_PARSER_CHOICES", "ParsedCall", "StreamDelta", "ToolCallDelta",
    "ToolCallStream", "ToolParser", "get_tool_parser", "new_call_id", "select_tool_parser",
]
