"""A chat choice's output as the API returns it: the reasoning split first, then tool calls
parsed out of the answer. Fed the choice's text deltas (with its token count so far); gives
the streamed deltas and, at the end, the whole message. Non-streaming responses are built
from the same deltas, so both ways agree."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from met.serving.reasoning import ReasoningStream, ThinkParser
from met.serving.tool_parsers import ToolCallDelta, ToolCallStream, ToolParser


@dataclass
class ChatDelta:
    """What one text delta of a choice released."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


class ChoiceOutput:
    """One choice's reasoning / content / tool calls, built up delta by delta."""

    def __init__(self, reasoning: ThinkParser | None, tools: ToolParser | None):
        self._reasoning: ReasoningStream | None = (
            reasoning.streamer() if reasoning is not None else None)
        self._tools: ToolCallStream | None = tools.streamer() if tools is not None else None
        self.reasoning_text = ""
        self.content = ""
        self.reasoning_tokens = 0

    def feed(self, text: str, num_tokens: int) -> ChatDelta:
        """``text``: the choice's new text; ``num_tokens``: its output tokens so far."""
        if self._reasoning is None:
            return self._answer(text, final=False)
        thinking = not self._reasoning.thinking_ended
        r = self._reasoning.feed(text)
        if thinking and self._reasoning.has_reasoning:
            # Tokens up to the one that closes the thinking count as reasoning.
            self.reasoning_tokens = num_tokens
        out = self._answer(r.content, final=False)
        out.reasoning = r.reasoning
        self.reasoning_text += r.reasoning
        return out

    def finish(self) -> ChatDelta:
        """The choice ended: release everything held back."""
        if self._reasoning is None:
            return self._answer("", final=True)
        r = self._reasoning.finish()
        if not self._reasoning.has_reasoning:
            self.reasoning_tokens = 0
        out = self._answer(r.content, final=True)
        out.reasoning = r.reasoning
        self.reasoning_text += r.reasoning
        return out

    def _answer(self, text: str, final: bool) -> ChatDelta:
        if self._tools is None:
            self.content += text
            return ChatDelta(content=text)
        d = self._tools.feed(text)
        if final:
            tail = self._tools.finish()
            d.content += tail.content
            d.tool_calls += tail.tool_calls
        self.content += d.content
        return ChatDelta(content=d.content, tool_calls=d.tool_calls)

    @property
    def reasoning_enabled(self) -> bool:
        """A reasoning parser is on (usage reports reasoning tokens)."""
        return self._reasoning is not None

    @property
    def has_reasoning(self) -> bool:
        return self._reasoning is not None and self._reasoning.has_reasoning

    @property
    def tool_calls(self) -> list[dict[str, Any]]:
        """The calls in OpenAI's message shape."""
        if self._tools is None:
            return []
        return [{"id": cid, "type": "function", "function": {"name": name, "arguments": args}}
                for cid, name, args in self._tools.calls]

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """``tool_calls`` when the model stopped after calling tools."""
        if engine_reason == "stop" and self.tool_calls:
            return "tool_calls"
        return engine_reason

    def message(self) -> dict[str, Any]:
        """The whole assistant message (non-streaming ``choices[i].message``)."""
        calls = self.tool_calls
        msg: dict[str, Any] = {"role": "assistant",
                               "content": self.content if self.content or not calls else None,
                               "refusal": None}
        if self._reasoning is not None:
            msg["reasoning_content"] = self.reasoning_text if self.has_reasoning else None
        if calls:
            msg["tool_calls"] = calls
        return msg
