"""A Responses-API response's output items (reasoning, message, function_call), built from
a choice's output deltas: the same builder gives the stream's events and the whole
response, so the two always agree."""

from __future__ import annotations

import uuid
from typing import Any

from met.serving.chat_output import ChatDelta


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseBuilder:
    """A response's output items, built from its ChatDeltas; ``feed`` also returns the
    stream's item / content-part / delta events for them (without sequence numbers)."""

    def __init__(self) -> None:
        self.output: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        self._call_item: dict[int, int] = {}  # tool call index → output index

    def feed(self, d: ChatDelta) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if d.reasoning:
            events += self._text("reasoning", d.reasoning)
        if d.content:
            events += self._text("message", d.content)
        for tc in d.tool_calls:
            if tc.id is not None:
                events += self._start({"id": _new_id("fc"), "type": "function_call",
                                       "status": "in_progress", "arguments": "",
                                       "call_id": tc.id, "name": tc.name})
                self._call_item[tc.index] = len(self.output) - 1
            if tc.arguments:
                index = self._call_item[tc.index]
                item = self.output[index]
                item["arguments"] += tc.arguments
                events.append({"type": "response.function_call_arguments.delta",
                               "item_id": item["id"], "output_index": index,
                               "delta": tc.arguments})
        return events

    def close(self) -> list[dict[str, Any]]:
        """The output ended: finish the open item."""
        return self._done()

    @property
    def called_tools(self) -> bool:
        return bool(self._call_item)

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self._open is None or self._open["type"] != kind:
            if kind == "reasoning":
                item = {"id": _new_id("rs"), "type": "reasoning", "summary": [],
                        "content": [], "status": "in_progress"}
                part = {"type": "reasoning_text", "text": ""}
            else:
                item = {"id": _new_id("msg"), "type": "message", "status": "in_progress",
                        "role": "assistant", "content": []}
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events += self._start(item)
            item["content"].append(part)
            events.append({"type": "response.content_part.added", "item_id": item["id"],
                           "output_index": len(self.output) - 1, "content_index": 0,
                           "part": dict(part)})
        item = self.output[-1]
        item["content"][0]["text"] += text
        delta_type = ("response.reasoning_text.delta" if kind == "reasoning"
                      else "response.output_text.delta")
        event = {"type": delta_type, "item_id": item["id"], "output_index": len(self.output) - 1,
                 "content_index": 0, "delta": text}
        if kind == "message":
            event["logprobs"] = []
        events.append(event)
        return events

    def _start(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._done()
        self.output.append(item)
        self._open = item
        return events + [{"type": "response.output_item.added",
                          "output_index": len(self.output) - 1, "item": _copy(item)}]

    def _done(self) -> list[dict[str, Any]]:
        item = self._open
        if item is None:
            return []
        self._open = None
        index = len(self.output) - 1
        item["status"] = "completed"
        base = {"item_id": item["id"], "output_index": index}
        events: list[dict[str, Any]] = []
        if item["type"] == "function_call":
            events.append({"type": "response.function_call_arguments.done", **base,
                           "name": item["name"], "arguments": item["arguments"]})
        else:
            part = item["content"][0]
            done = ("response.reasoning_text.done" if item["type"] == "reasoning"
                    else "response.output_text.done")
            text_done = {"type": done, **base, "content_index": 0, "text": part["text"]}
            if item["type"] == "message":
                text_done["logprobs"] = []
            events += [text_done, {"type": "response.content_part.done", **base,
                                   "content_index": 0, "part": dict(part)}]
        events.append({"type": "response.output_item.done", "output_index": index,
                       "item": _copy(item)})
        return events


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    return {k: ([dict(c) for c in v] if k == "content" else v) for k, v in item.items()}
