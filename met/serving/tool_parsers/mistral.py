"""``mistral``: ``[TOOL_CALLS]`` then a JSON list of ``{"name", "arguments"}`` objects, or the
newer ``[TOOL_CALLS]name[ARGS]{...}`` form (repeated for several calls). ``[TOOL_CALLS]`` is a
control token, so with special tokens skipped an output that starts with the list is a call
list too."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from met.serving.tool_parsers.base import (
    ParsedCall,
    ToolParser,
    call_from_object,
    escape_controls,
    join_content,
    loads,
    partial_tag_len,
    scan_object,
    skip_ws,
    value_end,
)

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"


class MistralToolParser(ToolParser):
    name = "mistral"
    start_tags = (TOOL_CALLS,)

    def scan(self, text: str, final: bool) -> tuple[str, list[ParsedCall]]:
        tag = text.find(TOOL_CALLS)
        if tag < 0:
            # The tag is a control token: with special tokens skipped, the output starts
            # right at the list.
            first = skip_ws(text, 0)
            after = skip_ws(text, first + 1)
            if not final and (first == len(text) or (text[first] == "[" and after == len(text))):
                return "", []  # may still become a list of calls
            if first < len(text) and text[first] == "[" and text.startswith("{", after):
                head, tag, i = "", first, first
            else:
                tail = text if final else text[:len(text) - partial_tag_len(text, (TOOL_CALLS,))]
                return join_content([tail], 0, not final), []
        else:
            head = text[:tag]
            i = skip_ws(text, tag + len(TOOL_CALLS))
        if i >= len(text):
            return (join_content([text], 0, False), []) if final else \
                (join_content([head], 0, True), [])
        if text[i] == "[":
            result = self._scan_list(text, i, final)
        else:
            result = self._scan_named(text, tag, final)
        if result is None:  # not a well-formed call: everything is content
            if final:
                return join_content([text], 0, False), []
            return join_content([head], 0, True), []
        calls, rest = result
        if rest is None:  # still inside the calls
            return join_content([head, ""], len(calls), not final), calls
        tail = text[rest:]
        if not final:  # it may be the start of another call
            tail = tail[:len(tail) - partial_tag_len(tail, (TOOL_CALLS,))]
        return join_content([head, tail], len(calls), not final), calls

    @staticmethod
    def _scan_list(text: str, i: int, final: bool) -> tuple[list[ParsedCall], int | None] | None:
        """``[{...}, {...}]`` at ``i``: the calls, and where the text after the list starts."""
        calls: list[ParsedCall] = []
        j = skip_ws(text, i + 1)
        while True:
            if j >= len(text):
                return (calls, None) if not final else None
            if text[j] == "]" and not calls:
                return None
            scan = scan_object(text, j, final)
            if scan.end is None:
                if not scan.ok:
                    return None
                call = call_from_object(text, scan, False)
                if call is not None and call.name is not None:
                    calls.append(call)
                return (calls, None) if not final or calls else None
            call = call_from_object(text, scan, True)
            if call is None:
                return None
            calls.append(call)
            j = skip_ws(text, scan.end)
            if j >= len(text):
                return (calls, None) if not final else (calls, j)
            if text[j] == ",":
                j = skip_ws(text, j + 1)
                continue
            if text[j] == "]":
                return calls, j + 1
            return None

    @staticmethod
    def _scan_named(text: str, tag: int, final: bool) -> tuple[list[ParsedCall],
                                                             int | None] | None:
        """``[TOOL_CALLS]name[ARGS]{...}`` repeated from ``tag``."""
        calls: list[ParsedCall] = []
        i = tag
        while True:
            start = i + len(TOOL_CALLS)
            a = text.find(ARGS, start)
            if a < 0:
                if not final:
                    return calls, None
                fragment = text[start:].strip()
                if not any(c in fragment for c in " \n{[\"'"):
                    return calls, len(text)  # cut before [ARGS]: markup, never content
                return (calls, i) if calls else None
            name = text[start:a].strip()
            if not name or any(c in name for c in " \n{[\"'"):
                return None
            v = skip_ws(text, a + len(ARGS))
            end = value_end(text, v, final) if v < len(text) else None
            if end is None:
                calls.append(ParsedCall(name, escape_controls(text[v:])))
                return calls, None
            raw = text[v:end]
            try:
                if not isinstance(loads(raw), dict):
                    return None
            except ValueError:
                return None
            calls.append(ParsedCall(name, escape_controls(raw)))
            nxt = skip_ws(text, end)
            if text.startswith(TOOL_CALLS, nxt):
                i = nxt
                continue
            if nxt >= len(text) and not final:
                return calls, None
            return calls, end

    def format_calls(self, calls: Sequence[tuple[str, Any]]) -> str:
        return TOOL_CALLS + json.dumps([{"name": n, "arguments": a} for n, a in calls],
                                       ensure_ascii=False)

    def format_results(self, results: Sequence[str]) -> str:
        return "\n".join(f"[TOOL_RESULTS]{r}[/TOOL_RESULTS]" for r in results)

    def call_instructions(self) -> str:
        return (f"To call functions, reply with {TOOL_CALLS} followed by a JSON list of calls: "
                f'{TOOL_CALLS}[{{"name": "<function name>", "arguments": {{<arguments as '
                f"JSON>}}}}]")
