"""Server-sent events as OpenAI sends them: ``data: {json}\\n\\n`` … ``data: [DONE]\\n\\n``."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

DONE = "data: [DONE]\n\n"


def sse_data(obj: object) -> str:
    return "data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n\n"


def sse_event(obj: dict) -> str:
    """A named event, as Anthropic's and OpenAI's Responses streams send them:
    ``event: {obj["type"]}`` then its data line."""
    return f"event: {obj['type']}\n" + sse_data(obj)


class SSEResponse(StreamingResponse):
    """A StreamingResponse that always closes its event generator when the response ends.

    A client disconnect can cancel the response while the generator sits at a ``yield``;
    closing it here runs its cleanup (aborting the engine requests) right away rather than
    whenever the generator is garbage-collected.
    """

    def __init__(self, events: AsyncGenerator[str, None]):
        # no-cache / no buffering: proxies must pass every token through as it comes.
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose()
