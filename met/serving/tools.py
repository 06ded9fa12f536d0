"""The request's ``tools``, ``tool_choice`` and ``parallel_tool_calls``, validated (400s name
the field), and how tools reach the prompt: through the chat template when it reads
``tools``; otherwise met writes a system message describing them in the tool parser's format
and renders tool history (assistant calls, tool results) as text, so tool use works with any
chat template."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from met.serving.errors import InvalidRequest
from met.serving.tool_parsers import ToolParser
from met.serving.tool_parsers.base import tools_json

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_CHOICES = ("auto", "none", "required")


@dataclass(frozen=True)
class ToolRequest:
    """What the request asked of tools. ``choice``: auto, none, required, or a function
    name (the named tool_choice)."""

    tools: tuple[dict[str, Any], ...]
    choice: str
    parallel: bool

    @property
    def active(self) -> bool:
        """Tools are rendered and the output is parsed for calls."""
        return bool(self.tools) and self.choice != "none"


def tool_request(tools: list[Any] | None, tool_choice: Any,
                 parallel_tool_calls: bool | None) -> ToolRequest:
    """Validate the OpenAI fields; tools become plain dicts (``{"type": "function",
    "function": {"name", "description", "parameters"}}``)."""
    plain: list[dict[str, Any]] = []
    names: set[str] = set()
    for i, tool in enumerate(tools or ()):
        raw = tool.model_dump(exclude_none=True) if hasattr(tool, "model_dump") else tool
        if not isinstance(raw, dict):
            raise InvalidRequest(f"tools.{i}: must be an object", f"tools.{i}")
        if raw.get("type") != "function":
            raise InvalidRequest(f"tools.{i}.type: must be 'function', got {raw.get('type')!r}",
                                 f"tools.{i}.type")
        fn = raw.get("function")
        if not isinstance(fn, dict):
            raise InvalidRequest(f"tools.{i}.function: required", f"tools.{i}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise InvalidRequest(f"tools.{i}.function.name: must be 1-64 characters of a-z, A-Z, "
                                 f"0-9, '_', '.', '-', got {name!r}", f"tools.{i}.function.name")
        if name in names:
            raise InvalidRequest(f"tools.{i}.function.name: {name!r} is given twice",
                                 f"tools.{i}.function.name")
        names.add(name)
        params = fn.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise InvalidRequest(f"tools.{i}.function.parameters: must be a JSON schema of "
                                 "type 'object'", f"tools.{i}.function.parameters")
        out = {"name": name, "parameters": params}
        if fn.get("description") is not None:
            out["description"] = fn["description"]
        plain.append({"type": "function", "function": out})
    choice = _choice(tool_choice, names)
    return ToolRequest(tuple(plain), choice, True if parallel_tool_calls is None
                       else bool(parallel_tool_calls))


def _choice(tool_choice: Any, names: set[str]) -> str:
    if tool_choice is None:
        return "auto" if names else "none"
    if isinstance(tool_choice, str):
        if tool_choice not in _CHOICES:
            raise InvalidRequest(f"tool_choice: must be one of {', '.join(_CHOICES)} or "
                                 f'{{"type": "function", "function": {{"name": ...}}}}, got '
                                 f"{tool_choice!r}", "tool_choice")
        if tool_choice == "required" and not names:
            raise InvalidRequest("tool_choice: 'required' needs tools", "tool_choice")
        return tool_choice
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function":
        raise InvalidRequest("tool_choice: a named choice is {\"type\": \"function\", "
                             "\"function\": {\"name\": ...}}", "tool_choice")
    fn = tool_choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise InvalidRequest("tool_choice.function.name: required", "tool_choice.function.name")
    if name not in names:
        raise InvalidRequest(f"tool_choice.function.name: {name!r} is not one of the given "
                             f"tools ({', '.join(sorted(names)) or 'none given'})",
                             "tool_choice.function.name")
    return name


def template_reads(template: str | None, variable: str) -> bool:
    """Whether the chat template's source uses ``variable`` (e.g. ``tools``)."""
    return bool(template) and re.search(rf"\b{re.escape(variable)}\b", template) is not None


def tool_system_text(tools: tuple[dict[str, Any], ...] | list[dict[str, Any]],
                     parser: ToolParser) -> str:
    """The system message met writes when the template cannot render tools."""
    return ("# Tools\n\nYou can call the functions below (one JSON signature per line) when "
            "they help answer the user.\n<tools>\n" + tools_json(tools) + "\n</tools>\n\n"
            + parser.call_instructions())


def prepare_conversation(template: str | None, conv: list[dict[str, Any]],
                         tools: list[dict[str, Any]] | None,
                         parser: ToolParser | None) -> tuple[list[dict[str, Any]],
                                                             list[dict[str, Any]] | None]:
    """(messages, tools to hand the template): unchanged when the template renders tools and
    tool history itself; otherwise tools become a system message and the history text."""
    has_history = any(m.get("tool_calls") or m["role"] == "tool" for m in conv)
    if parser is None or (not tools and not has_history):
        return conv, tools or None
    if has_history and not template_reads(template, "tool_calls"):
        conv = _history_as_text(conv, parser)
    if tools and not template_reads(template, "tools"):
        conv = _with_tool_system_message(conv, tool_system_text(tools, parser))
        tools = None
    return conv, tools or None


def _with_tool_system_message(conv: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    if conv and conv[0]["role"] == "system":
        first = dict(conv[0])
        first["content"] = (first["content"] + "\n\n" + text) if first["content"] else text
        return [first, *conv[1:]]
    return [{"role": "system", "content": text}, *conv]


def _history_as_text(conv: list[dict[str, Any]], parser: ToolParser) -> list[dict[str, Any]]:
    """Assistant calls written as the model writes them; each run of tool results becomes
    one user message in the parser's result format."""
    out: list[dict[str, Any]] = []
    results: list[str] = []
    for m in conv:
        if m["role"] == "tool":
            results.append(m["content"])
            continue
        if results:
            out.append({"role": "user", "content": parser.format_results(results)})
            results = []
        if m.get("tool_calls"):
            calls = parser.format_calls([(c["function"]["name"], c["function"]["arguments"])
                                         for c in m["tool_calls"]])
            m = {k: v for k, v in m.items() if k != "tool_calls"}
            m["content"] = (m["content"] + "\n" + calls) if m["content"] else calls
        out.append(m)
    if results:
        out.append({"role": "user", "content": parser.format_results(results)})
    return out


def call_arguments(arguments: Any) -> Any:
    """A history call's arguments as templates expect them: a dict when the JSON text parses
    to one (transformers' templates apply ``tojson`` or iterate items), else the text."""
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            return arguments
        return parsed if isinstance(parsed, dict) else arguments
    return arguments
