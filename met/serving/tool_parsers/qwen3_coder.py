"""``qwen3_coder``: Qwen3-Coder's XML calls,
``<tool_call><function=NAME><parameter=P>value</parameter>...</function></tool_call>``.

Parameter values are plain text (surrounding whitespace dropped); each is converted by the
type its tool's JSON schema gives it (string, integer, number, boolean, object/array as JSON),
and the arguments are written as a JSON object in the order the parameters came. A call
streams one parameter at a time.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from met.serving.tool_parsers.base import (
    ParsedCall,
    ToolParser,
    join_content,
    loads,
    partial_tag_len,
)

TOOL_CALL, TOOL_CALL_END = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAM, PARAM_END = "<parameter=", "</parameter>"


class Qwen3CoderToolParser(ToolParser):
    name = "qwen3_coder"
    start_tags = (TOOL_CALL, FUNCTION)

    def scan(self, text: str, final: bool) -> tuple[str, list[ParsedCall]]:
        segments: list[str] = []
        calls: list[ParsedCall] = []
        cur, pos = "", 0
        while True:
            i = _find_first(text, pos, self.start_tags)
            if i < 0:
                tail = text[pos:]
                if not final:
                    tail = tail[:len(tail) - partial_tag_len(tail, self.start_tags)]
                segments.append(cur + tail)
                break
            wrapped = text.startswith(TOOL_CALL, i)
            f = text.find(FUNCTION, i) if wrapped else i
            if wrapped and f >= 0 and text[i + len(TOOL_CALL):f].strip():
                f = -1  # something other than a function inside the tags
            call, end = self._scan_call(text, f, final) if f >= 0 else (None, None)
            if end is not None and wrapped:
                k = text.find(TOOL_CALL_END, end)
                if k >= 0 and not text[end:k].strip():
                    end = k + len(TOOL_CALL_END)
                elif k < 0 and not final and TOOL_CALL_END.startswith(text[end:].strip()):
                    end = None  # the closing tag is still to come
            if call is not None and call.name is not None:
                segments.append(cur + text[pos:i])
                calls.append(call)
                if end is None:  # being written (or cut off)
                    segments.append("")
                    break
                cur, pos = "", end
                continue
            if not final or _cut_before_name(text, i, wrapped):
                # Not known yet (held back), or a call max_tokens cut before its name was
                # complete: markup, never content.
                segments.append(cur + text[pos:i])
                break
            # Not a call: its text, up to its closing tag, stays content.
            closer = TOOL_CALL_END if wrapped else FUNCTION_END
            closing = text.find(closer, i)
            stop = len(text) if closing < 0 else closing + len(closer)
            cur += text[pos:stop]
            pos = stop
        return join_content(segments, len(calls), not final), calls

    def _scan_call(self, text: str, f: int, final: bool) -> tuple[ParsedCall | None, int | None]:
        """The function at ``f``: (call so far, end after ``</function>`` or None)."""
        gt = text.find(">", f)
        if gt < 0:
            return ParsedCall(None, ""), None
        name = text[f + len(FUNCTION):gt].strip()
        if not name or "<" in name or "\n" in name:
            return None, None
        schema = self._param_types(name)
        parts: list[str] = []
        i = gt + 1
        while True:
            j = _skip_space(text, i)
            if text.startswith(FUNCTION_END, j):
                return ParsedCall(name, _args(parts, True)), j + len(FUNCTION_END)
            if text.startswith(PARAM, j):
                gt = text.find(">", j)
                e = text.find(PARAM_END, j)
                if gt < 0 or e < 0 or e < gt:
                    return ParsedCall(name, _args(parts, final)), None
                key = text[j + len(PARAM):gt].strip()
                value = _strip_newline(text[gt + 1:e])
                parts.append(f"{json.dumps(key, ensure_ascii=False)}: "
                             f"{json.dumps(convert(value, schema.get(key)), ensure_ascii=False)}")
                i = e + len(PARAM_END)
                continue
            if j >= len(text) or FUNCTION_END.startswith(text[j:]) or PARAM.startswith(text[j:]):
                return ParsedCall(name, _args(parts, final)), None
            return None, None  # stray text inside the function

    def _param_types(self, name: str) -> dict[str, Any]:
        for t in self.tools:
            fn = t.get("function", t)
            if fn.get("name") == name:
                props = (fn.get("parameters") or {}).get("properties") or {}
                return props if isinstance(props, dict) else {}
        return {}

    def format_calls(self, calls: Sequence[tuple[str, Any]]) -> str:
        out = []
        for name, args in calls:
            if not isinstance(args, dict):  # arguments that were not a JSON object
                args = {"arguments": args}
            params = "".join(
                f"{PARAM}{k}>\n{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}"
                f"\n{PARAM_END}\n" for k, v in args.items())
            out.append(f"{TOOL_CALL}\n{FUNCTION}{name}>\n{params}{FUNCTION_END}\n{TOOL_CALL_END}")
        return "\n".join(out)

    def call_instructions(self) -> str:
        return (f"To call a function, write:\n{TOOL_CALL}\n{FUNCTION}<function name>>\n"
                f"{PARAM}<parameter name>>\n<value>\n{PARAM_END}\n{FUNCTION_END}\n"
                f"{TOOL_CALL_END}\nwith one parameter block per argument (values as plain "
                "text; lists and objects as JSON).")


def convert(value: str, schema: Any) -> Any:
    """A parameter's text as the JSON value its schema type asks for (text if it does not
    fit; text too when the tool does not declare the parameter)."""
    types = schema.get("type") if isinstance(schema, dict) else None
    types = [types] if isinstance(types, str) else list(types or [])
    if value.strip() == "null" and ("null" in types):
        return None
    for t in types:
        v = value.strip()
        try:
            if t == "integer":
                return int(v)
            if t == "number":
                f = float(v)
                return int(f) if f.is_integer() and "." not in v and "e" not in v.lower() else f
            if t == "boolean" and v.lower() in ("true", "false"):
                return v.lower() == "true"
            if t in ("object", "array"):
                parsed = loads(v)
                if isinstance(parsed, dict if t == "object" else list):
                    return parsed
        except ValueError:
            continue
    if not types and isinstance(schema, dict) and schema:  # enum/anyOf etc.: try JSON
        try:
            return loads(value)
        except ValueError:
            pass
    return value


def _args(parts: list[str], closed: bool) -> str:
    return "{" + ", ".join(parts) + ("}" if closed else "")


def _strip_newline(value: str) -> str:
    """The value between the tags without the whitespace around it (the format puts a newline
    each side, and the grammar lets whitespace pad a value)."""
    return value.strip(" \t\r\n")


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def _find_first(text: str, pos: int, tags: Sequence[str]) -> int:
    hits = [i for i in (text.find(t, pos) for t in tags) if i >= 0]
    return min(hits) if hits else -1


def _cut_before_name(text: str, i: int, wrapped: bool) -> bool:
    """The output ends inside the call that starts at ``i``, before its function name's
    ``>``: ``<tool_call>``, ``<tool_call><func`` or ``<function=get_w``."""
    rest = text[i + len(TOOL_CALL):].lstrip() if wrapped else text[i:]
    if FUNCTION.startswith(rest):
        return True
    if not rest.startswith(FUNCTION):
        return False
    fragment = rest[len(FUNCTION):]
    return not any(c in fragment for c in "<>\n")
