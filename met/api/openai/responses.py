"""``POST /v1/responses`` (OpenAI's Responses API, streamed or whole), ``GET`` and ``DELETE
/v1/responses/{id}``: served by the chat pipeline of ``/v1/chat/completions``; stored
responses (``store``, default true) live in the server's bounded ResponseStore and
``previous_response_id`` continues one."""

from __future__ import annotations

import itertools
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from met.api.context import (
    ServerContext,
    parse_request,
    read_json,
    response_store,
    server_context,
)
from met.api.errors import ApiError
from met.api.openai.chat import feed_choice, start_chat
from met.api.openai.common import now, respond, stream_events
from met.api.sse import SSEResponse, sse_event
from met.serving.chat_output import ChoiceOutput
from met.serving.errors import InvalidRequest
from met.serving.field_names import renamed
from met.serving.generate import ChoiceDelta, Generation
from met.serving.responses_output import ResponseBuilder
from met.serving.responses_protocol import (
    FIELD_NAMES,
    RENAMES,
    ResponsesRequest,
    input_items,
    to_chat_request,
)

router = APIRouter()


@router.post("/v1/responses", openapi_extra={"requestBody": {
    "required": True,
    "content": {"application/json": {"schema": {
        "$ref": "#/components/schemas/ResponsesRequest"}}}}})
async def create_response(request: Request) -> Response:
    ctx = server_context(request)
    ctx.require_model()
    req = parse_request(
        request, ResponsesRequest, await read_json(request, ctx.config.max_body_bytes),
        FIELD_NAMES)
    items = _conversation(ctx, req)
    try:
        run = await start_chat(ctx, request, to_chat_request(req, items))
    except InvalidRequest as e:
        raise renamed(e, RENAMES) from None
    gen, out = run.gen, run.outputs[0]
    resp = _ResponseRun(ctx, req, items, gen, out, req.model or ctx.config.model_name)
    if req.stream:
        return SSEResponse(_stream(resp))

    def on_delta(d: ChoiceDelta) -> None:
        resp.builder.feed(feed_choice(out, d, gen))
        if d.finish_reason is not None:
            resp.builder.close()
            resp.finish(d.finish_reason)

    return await respond(request, gen, None, lambda _: resp.body, on_delta)


@router.get("/v1/responses/{response_id}")
async def get_response(request: Request, response_id: str) -> JSONResponse:
    stored = response_store(request).get(response_id)
    if stored is None:
        raise _not_found(response_id)
    return JSONResponse(stored.response)


@router.delete("/v1/responses/{response_id}")
async def delete_response(request: Request, response_id: str) -> JSONResponse:
    if not response_store(request).delete(response_id):
        raise _not_found(response_id)
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


def _not_found(response_id: str) -> ApiError:
    return ApiError(404, f"response {response_id!r} not found (never stored, deleted, or "
                    f"expired)", "response_id", "not_found")


def _conversation(ctx: ServerContext, req: ResponsesRequest) -> list[dict[str, Any]]:
    """The input items this response answers: a previous response's input and output
    first, then this request's input."""
    items = input_items(req)
    if req.previous_response_id is None:
        return items
    prev = ctx.response_store.get(req.previous_response_id)
    if prev is None:
        raise InvalidRequest(f"previous_response_id: response {req.previous_response_id!r} "
                             f"not found (never stored, deleted, or expired)",
                             "previous_response_id", "not_found", 404)
    return [*prev.input_items, *prev.response["output"], *items]


class _ResponseRun:
    """One response: its output items as they are built, and its object at each stage."""

    def __init__(self, ctx: ServerContext, req: ResponsesRequest, items: list[dict[str, Any]],
                 gen: Generation, out: ChoiceOutput, model: str):
        self.ctx, self.req, self.items = ctx, req, items
        self.gen, self.out, self.model = gen, out, model
        self.builder = ResponseBuilder()
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created = now()
        self.body: dict[str, Any] = self.snapshot("in_progress")

    def snapshot(self, status: str, **extra: Any) -> dict[str, Any]:
        req = self.req
        fmt = req.text.format if req.text and req.text.format else None
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "error": None, "incomplete_details": None, "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens, "model": self.model,
            "output": [dict(i) for i in self.builder.output] if status != "in_progress" else [],
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": req.reasoning.effort if req.reasoning else None,
                          "summary": None},
            "store": req.store,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": {"format": (fmt.model_dump(by_alias=True, exclude_none=True) if fmt
                                else {"type": "text"})},
            "tool_choice": req.tool_choice or "auto",
            "tools": [t.model_dump() for t in req.tools or ()],
            "top_p": 1.0 if req.top_p is None else req.top_p, "truncation": "disabled",
            "usage": None, "user": req.user, "metadata": req.metadata or {}, **extra,
        }

    def finish(self, finish_reason: str | None) -> dict[str, Any]:
        """The finished response (stored when asked): completed, or incomplete when the
        output was cut off."""
        gen = self.gen
        usage = {"input_tokens": gen.prompt_tokens,
                 "input_tokens_details": {"cached_tokens": gen.cached_tokens},
                 "output_tokens": gen.completion_tokens,
                 "output_tokens_details": {"reasoning_tokens": self.out.reasoning_tokens},
                 "total_tokens": gen.prompt_tokens + gen.completion_tokens}
        if finish_reason == "stop":
            self.body = self.snapshot("completed", usage=usage)
        else:  # length, a repetition cut-off, or the request timeout
            self.body = self.snapshot("incomplete", usage=usage,
                                      incomplete_details={"reason": "max_output_tokens"})
        if self.req.store:
            self.ctx.response_store.put(self.body, self.items)
        return self.body


def _stream(resp: _ResponseRun) -> AsyncIterator[str]:
    """response.created, response.in_progress, the items' events, then response.completed
    (or response.incomplete); a failure sends ``error`` and ``response.failed``."""
    counter = itertools.count()

    def encode(event: dict[str, Any]) -> str:
        return sse_event({**event, "sequence_number": next(counter)})

    def head() -> list[dict[str, Any]]:
        return [{"type": t, "response": resp.body}
                for t in ("response.created", "response.in_progress")]

    def on_delta(d: ChoiceDelta) -> list[dict[str, Any]]:
        events = resp.builder.feed(feed_choice(resp.out, d, resp.gen))
        if d.finish_reason is not None:
            events += resp.builder.close()
            body = resp.finish(d.finish_reason)
            events.append({"type": f"response.{body['status']}", "response": body})
        return events

    def errors(status: int, message: str, code: str) -> list[dict[str, Any]]:
        failed = resp.snapshot("failed", error={"code": code, "message": message})
        return [{"type": "error", "code": code, "message": message, "param": None},
                {"type": "response.failed", "response": failed}]

    return stream_events(resp.gen, head, on_delta, None, encode=encode, error_events=errors,
                         done=None)
