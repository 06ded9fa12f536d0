"""``POST /v1/messages`` (streamed in Anthropic's event order, or whole) and
``POST /v1/messages/count_tokens``, served by the chat pipeline of ``/v1/chat/completions``."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from met.api.anthropic.errors import error_body, error_response
from met.api.anthropic.routing import AnthropicRoute
from met.api.context import parse_request, read_json, server_context
from met.api.openai.chat import feed_choice, render_chat_request, start_chat
from met.api.openai.common import respond, stream_events
from met.api.sse import SSEResponse, sse_event
from met.serving.anthropic_output import MessageBuilder, stop_reason
from met.serving.anthropic_protocol import (
    FIELD_NAMES,
    RENAMES,
    CountTokensRequest,
    MessagesRequest,
    to_chat_request,
)
from met.serving.errors import InvalidRequest
from met.serving.field_names import renamed
from met.serving.generate import ChoiceDelta, Generation
from met.serving.validation import check_request_limits

router = APIRouter(route_class=AnthropicRoute)


def _body_schema(name: str) -> dict[str, Any]:
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": {
        "$ref": f"#/components/schemas/{name}"}}}}}


@router.post("/v1/messages", openapi_extra=_body_schema("MessagesRequest"))
async def create_message(request: Request) -> Response:
    ctx = server_context(request)
    ctx.require_model()
    req = parse_request(
        request, MessagesRequest, await read_json(request, ctx.config.max_body_bytes),
        FIELD_NAMES)
    try:
        run = await start_chat(ctx, request, to_chat_request(req))
    except InvalidRequest as e:
        raise renamed(e, RENAMES) from None
    gen, out = run.gen, run.outputs[0]
    builder = MessageBuilder()
    message = {"id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message", "role": "assistant",
               "model": req.model, "content": [], "stop_reason": None, "stop_sequence": None}

    def finish(d: ChoiceDelta) -> dict[str, Any]:
        """The message's ending: its stop reason and stop sequence."""
        reason, sequence = stop_reason(d.finish_reason, gen.choices[0].stop_reason,
                                       builder.called_tools)
        return {"stop_reason": reason, "stop_sequence": sequence}

    if req.stream:
        return SSEResponse(_stream(gen, message, builder,
                                   lambda d: builder.feed(feed_choice(out, d, gen)), finish))

    ending: dict[str, Any] = {}

    def on_delta(d: ChoiceDelta) -> None:
        builder.feed(feed_choice(out, d, gen))
        if d.finish_reason is not None:
            builder.close()
            ending.update(finish(d))

    def body(_: list[str]) -> dict[str, Any]:
        return {**message, "content": builder.blocks, **ending, "usage": _usage(gen)}

    return await respond(request, gen, None, body, on_delta, on_error=error_response)


@router.post("/v1/messages/count_tokens", openapi_extra=_body_schema("CountTokensRequest"))
async def count_tokens(request: Request) -> JSONResponse:
    """``{"input_tokens": N}``: the prompt the request would run, chat template and tools
    included."""
    ctx = server_context(request)
    model = ctx.require_model()
    req = parse_request(
        request, CountTokensRequest, await read_json(request, ctx.config.max_body_bytes),
        FIELD_NAMES)
    ctx.check_model(req)
    try:
        chat_req = to_chat_request(req)
        check_request_limits(chat_req, None, model.limits.requests)
        chat = render_chat_request(ctx, model, chat_req)
    except InvalidRequest as e:
        raise renamed(e, RENAMES) from None
    return JSONResponse({"input_tokens": len(chat.prompt.token_ids)})


def _usage(gen: Generation) -> dict[str, int]:
    """Anthropic's usage: ``input_tokens`` excludes the prompt tokens read from the cache."""
    cached = gen.cached_tokens
    return {"input_tokens": gen.prompt_tokens - cached, "output_tokens": gen.completion_tokens,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def _stream(gen: Generation, message: dict[str, Any], builder: MessageBuilder,
            feed: Callable[[ChoiceDelta], list[dict[str, Any]]],
            finish: Callable[[ChoiceDelta], dict[str, Any]]) -> AsyncIterator[str]:
    """message_start, the blocks' start / delta / stop events (a ping after the first
    start), message_delta with the stop reason and usage, message_stop; on a failure an
    ``error`` event ends the stream."""
    pinged = False

    def head() -> list[dict[str, Any]]:
        usage = {"input_tokens": gen.prompt_tokens, "output_tokens": 0,
                 "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}
        return [{"type": "message_start", "message": {**message, "usage": usage}}]

    def on_delta(d: ChoiceDelta) -> list[dict[str, Any]]:
        nonlocal pinged
        events = feed(d)
        if not pinged and events:
            pinged = True
            events.insert(1, {"type": "ping"})
        if d.finish_reason is not None:
            events += builder.close()
            events.append({"type": "message_delta", "delta": finish(d), "usage": _usage(gen)})
            events.append({"type": "message_stop"})
        return events

    def errors(status: int, msg: str, code: str) -> list[dict[str, Any]]:
        return [error_body(status, msg)]

    return stream_events(gen, head, on_delta, None, encode=sse_event, error_events=errors,
                         done=None)
