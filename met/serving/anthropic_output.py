"""An Anthropic message's content blocks, built from a choice's output deltas: the same
builder feeds the stream's block events and the non-streamed message, so the two always
agree."""

from __future__ import annotations

import json
from typing import Any

from met.serving.chat_output import ChatDelta


def tool_use_id(call_id: str) -> str:
    """A parser's ``call_…`` id in Anthropic's ``toolu_…`` form."""
    return "toolu_" + call_id.removeprefix("call_")


def stop_reason(finish_reason: str | None, engine_stop: str | int | None,
                called_tools: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) for a finished choice."""
    if finish_reason == "stop":
        if called_tools:
            return "tool_use", None
        if isinstance(engine_stop, str):
            return "stop_sequence", engine_stop
        return "end_turn", None
    return "max_tokens", None  # length, repetition cut-off, or the request timeout


class MessageBuilder:
    """A message's content blocks, built from its ChatDeltas; ``feed`` also returns the
    stream's ``content_block_start`` / ``_delta`` / ``_stop`` events for them."""

    def __init__(self) -> None:
        self.blocks: list[dict[str, Any]] = []
        self._open = False
        self._json: dict[int, str] = {}  # block index → tool input JSON text
        self._call_block: dict[int, int] = {}  # tool call index → block index

    def feed(self, d: ChatDelta) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if d.reasoning:
            events += self._append("thinking", d.reasoning)
        if d.content:
            events += self._append("text", d.content)
        for tc in d.tool_calls:
            if tc.id is not None:
                events += self._start({"type": "tool_use", "id": tool_use_id(tc.id),
                                       "name": tc.name, "input": {}})
                self._call_block[tc.index] = len(self.blocks) - 1
                self._json[len(self.blocks) - 1] = ""
            if tc.arguments:
                index = self._call_block[tc.index]
                self._json[index] += tc.arguments
                events.append({"type": "content_block_delta", "index": index, "delta": {
                    "type": "input_json_delta", "partial_json": tc.arguments}})
        return events

    def close(self) -> list[dict[str, Any]]:
        """The output ended: close the open block and settle the tool inputs."""
        for index, text in self._json.items():
            self.blocks[index]["input"] = _tool_input(text)
        return self._stop()

    @property
    def called_tools(self) -> bool:
        return bool(self._call_block)

    def _append(self, kind: str, text: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if not (self._open and self.blocks[-1]["type"] == kind):
            empty = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" \
                else {"type": "text", "text": ""}
            events += self._start(empty)
        key, delta_type = ("thinking", "thinking_delta") if kind == "thinking" \
            else ("text", "text_delta")
        self.blocks[-1][key] += text
        events.append({"type": "content_block_delta", "index": len(self.blocks) - 1,
                       "delta": {"type": delta_type, key: text}})
        return events

    def _start(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._stop()
        self.blocks.append(block)
        self._open = True
        events.append({"type": "content_block_start", "index": len(self.blocks) - 1,
                       "content_block": dict(block)})
        return events

    def _stop(self) -> list[dict[str, Any]]:
        if not self._open:
            return []
        self._open = False
        return [{"type": "content_block_stop", "index": len(self.blocks) - 1}]


def _tool_input(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text or "{}", strict=False)
    except ValueError:
        value = None
    # A call whose arguments are not an object (a model off its grammar) keeps its text.
    return value if isinstance(value, dict) else {"_arguments": text}
