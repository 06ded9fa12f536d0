"""``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, as Qwen2.5 / Qwen3
and the Hermes models write calls (several in a row for parallel calls)."""

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

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"
    start_tags = (START,)

    def scan(self, text: str, final: bool) -> tuple[str, list[ParsedCall]]:
        segments: list[str] = []
        calls: list[ParsedCall] = []
        cur = ""  # outside text gathered since the last call (malformed tags included)
        pos = 0
        while True:
            i = text.find(START, pos)
            if i < 0:
                tail = text[pos:]
                if not final:
                    tail = tail[:len(tail) - partial_tag_len(tail, (START,))]
                segments.append(cur + tail)
                break
            body = skip_ws(text, i + len(START))
            j = text.find(END, body)
            if j < 0:  # the call is still being written (or the output was cut off)
                scan = scan_object(text, body, False)
                call = call_from_object(text, scan, False)
                if call is not None and call.name is not None:
                    segments += [cur + text[pos:i], ""]
                    calls.append(call)
                elif final and not scan.ok:  # not a call after all: its text stays content
                    segments.append(cur + text[pos:])
                else:  # a call cut before its name: markup, never content
                    segments.append(cur + text[pos:i])
                break
            scan = scan_object(text, body, True)
            call = call_from_object(text, scan, True)
            if call is not None and scan.end is not None and skip_ws(text, scan.end) == j:
                segments.append(cur + text[pos:i])
                calls.append(call)
                cur = ""
            else:  # not a call after all: its text stays content
                cur += text[pos:j + len(END)]
            pos = j + len(END)
        return join_content(segments, len(calls), not final), calls

    def format_calls(self, calls: Sequence[tuple[str, Any]]) -> str:
        return "\n".join(
            f"{START}\n" + json.dumps({"name": n, "arguments": a}, ensure_ascii=False) + f"\n{END}"
            for n, a in calls)

    def call_instructions(self) -> str:
        return (f"To call a function, write a JSON object with its name and arguments between "
                f"{START} and {END} tags, one call per pair of tags:\n{START}\n"
                f'{{"name": "<function name>", "arguments": {{<arguments as JSON>}}}}\n{END}')
