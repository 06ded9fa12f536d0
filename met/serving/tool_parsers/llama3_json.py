"""``llama3_json``: Llama 3.x JSON calls, ``{"name": ..., "parameters": {...}}`` (or
``"arguments"``), optionally after ``<|python_tag|>``, several separated by ``;``. Without the
tag, an output is a call only when it starts with ``{``; given the request's tools, an object
is a call only when it names one of them (otherwise it is a JSON answer)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from met.serving.tool_parsers.base import (
    ParsedCall,
    ToolParser,
    call_from_object,
    join_content,
    partial_tag_len,
    scan_object,
    skip_ws,
)

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    start_tags = (PYTHON_TAG,)

    def scan(self, text: str, final: bool) -> tuple[str, list[ParsedCall]]:
        tag = text.find(PYTHON_TAG)
        if tag >= 0:
            head, start = text[:tag], tag + len(PYTHON_TAG)
        else:
            first = skip_ws(text, 0)
            if first == len(text) and not final:
                return "", []  # only whitespace so far: a call may still start
            if first < len(text) and text[first] == "{":
                head, start = "", first
            else:
                tail = text if final else text[:len(text) - partial_tag_len(text, (PYTHON_TAG,))]
                return join_content([tail], 0, not final), []
        calls: list[ParsedCall] = []
        i = skip_ws(text, start)
        while True:
            if i >= len(text):
                if not final or calls:
                    return join_content([head, ""], len(calls), not final), calls
                break  # a bare tag and nothing after it
            scan = scan_object(text, i, final)
            if scan.end is None:  # incomplete (or malformed)
                call = call_from_object(text, scan, False) if scan.ok else None
                if call is not None and self._unknown(call):
                    break
                if call is not None and call.name is not None:
                    calls.append(call)
                    return join_content([head, ""], len(calls), not final), calls
                if scan.ok and (not final or calls or tag >= 0):
                    # Still being written, or cut by max_tokens before its name: markup.
                    return join_content([head, ""] if calls else [head], len(calls),
                                        not final), calls
                break
            call = call_from_object(text, scan, True)
            if call is None or self._unknown(call):
                break
            calls.append(call)
            i = skip_ws(text, scan.end)
            if i < len(text) and text[i] == ";":
                i = skip_ws(text, i + 1)
                continue
            if i >= len(text) and not final:
                return join_content([head, ""], len(calls), True), calls
            # Text after the last call is content.
            return join_content([head, text[i:]], len(calls), not final), calls
        # Not a well-formed call list: everything is content.
        return join_content([text], 0, not final), []

    def _unknown(self, call: ParsedCall) -> bool:
        """A bare JSON object is only a call when it names one of the request's tools (it
        may just be a JSON answer); without tools, any name counts."""
        names = {t.get("function", t).get("name") for t in self.tools}
        return bool(names) and call.name is not None and call.name not in names

    def format_calls(self, calls: Sequence[tuple[str, Any]]) -> str:
        return PYTHON_TAG + "; ".join(
            json.dumps({"name": n, "parameters": a}, ensure_ascii=False) for n, a in calls)

    def call_instructions(self) -> str:
        return ('To call a function, reply with only a JSON object of the form {"name": '
                '"<function name>", "parameters": {<arguments as JSON>}}; for several calls, '
                "separate the objects with '; '.")
