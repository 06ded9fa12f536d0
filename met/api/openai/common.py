"""Shared pieces of the OpenAI routes: usage, non-stream collection, stream error handling."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from met.api.context import ClientDisconnected, until_disconnected
from met.api.errors import error_body, error_response
from met.api.sse import DONE, sse_data
from met.serving.generate import ChoiceDelta, Generation, GenerationFailed

log = logging.getLogger("met.api")


def usage(gen: Generation) -> dict:
    prompt, completion = gen.prompt_tokens, gen.completion_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": gen.cached_tokens},
    }


def now() -> int:
    return int(time.time())


async def collect(gen: Generation, prefixes: list[str] | None = None,
                  on_delta: Callable[[ChoiceDelta], None] | None = None) -> list[str]:
    """Run the generation to the end; the full text of each choice. ``on_delta`` sees each
    delta as it comes (while the choice's token count is that of the delta)."""
    parts: list[list[str]] = [[p] for p in prefixes] if prefixes else [[] for _ in gen.choices]
    async with gen:
        async for d in gen.deltas():
            parts[d.index].append(d.text)
            if on_delta is not None:
                on_delta(d)
    return ["".join(p) for p in parts]


async def respond(request: Request, gen: Generation, prefixes: list[str] | None,
                  build: Callable[[list[str]], dict],
                  on_delta: Callable[[ChoiceDelta], None] | None = None,
                  on_error: Callable[..., Response] = error_response) -> Response:
    """Non-stream: collect (aborting if the client leaves), then build the JSON body.
    ``on_error(status, message, param, code)`` answers a failed generation (another API's
    error shape)."""
    try:
        texts = await until_disconnected(request, collect(gen, prefixes, on_delta))
    except ClientDisconnected:
        return Response(status_code=499)
    except GenerationFailed as e:
        status = 400 if e.is_client_error else 500
        return on_error(status, e.message, None, None if status == 400 else "engine_error")
    return JSONResponse(build(texts))


def _openai_error_events(status: int, message: str, code: str) -> list[dict]:
    return [error_body(status, message, None, None if status == 400 else code)]


async def stream_events(gen: Generation, head: Callable[[], list[dict]],
                        delta_chunk: Callable[[ChoiceDelta], list[dict]],
                        usage_chunk: Callable[[], dict] | None, *,
                        encode: Callable[[dict], str] = sse_data,
                        error_events: Callable[[int, str, str], list[dict]] | None = None,
                        done: str | None = DONE) -> AsyncIterator[str]:
    """The SSE body: ``head`` chunks, one or more chunks per delta, the usage chunk, [DONE].

    Other APIs' streams change how each event is written (``encode``), the error event
    (``error_events(status, message, code)``) and the end marker (``done``, None for none).

    A failure after the stream has started becomes an error event, then [DONE]: the client
    never sees a dropped connection. A disconnect cancels this generator, and leaving the
    ``async with`` aborts the engine requests.
    """
    errors = error_events or _openai_error_events
    try:
        async with gen:
            for chunk in head():
                yield encode(chunk)
            async for d in gen.deltas():
                for chunk in delta_chunk(d):
                    yield encode(chunk)
            if usage_chunk is not None:
                yield encode(usage_chunk())
    except GenerationFailed as e:
        log.warning("request %s failed mid-stream: %s", gen.request_id, e.message)
        status = 400 if e.is_client_error else 500
        for event in errors(status, e.message, "invalid_request" if status == 400
                            else "engine_error"):
            yield encode(event)
    except Exception as e:  # a bug of ours: still end the stream properly
        log.exception("request %s: stream failed", gen.request_id)
        for event in errors(500, f"internal error: {e}", "internal_error"):
            yield encode(event)
    if done is not None:
        yield done
