"""Routes each request of a several-model server (`--models-dir`) to its model's context.

The model is the JSON body's ``model`` (every OpenAI and Anthropic route that takes one,
/tokenize and /detokenize), else the ``model`` query parameter (routes without a body, e.g.
POST /sleep?model=NAME). The middleware reads the body once and hands the same bytes on, so
the routes parse it as they always do; the context it puts in the scope is what
``server_context`` returns. The lease it takes (ModelPool.use) lasts until the response's
last byte has gone, streams included: a model is never unloaded under a request.

A request naming no model reaches the route unrouted, and the route's ``server_context``
answers the 400 naming ``model``. The pool's own routes (/v1/models, /models/load,
/models/unload, /health, /metrics) are never routed: their ``model`` is what they act on.
"""

from __future__ import annotations

import json
from contextlib import AsyncExitStack
from typing import Any
from urllib.parse import parse_qs

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from met.api.anthropic.errors import ANTHROPIC_PATH_PREFIX
from met.api.anthropic.errors import error_body as anthropic_error_body
from met.api.context import ROUTED_CONTEXT_KEY
from met.api.errors import ApiError, error_body
from met.api.model_pool import ModelPool
from met.serving.errors import InvalidRequest

_POOL_PATHS = ("/health", "/metrics", "/version", "/v1/models", "/models")


class ModelRouterMiddleware:
    def __init__(self, app: ASGIApp, pool: ModelPool, max_body_bytes: int):
        self.app = app
        self.pool = pool
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path.startswith(_POOL_PATHS):
            await self.app(scope, receive, send)
            return
        body, receive = await self._buffer(scope, receive)
        if body is None:  # over the body limit
            await _reply(scope, send, 413, f"request body: over the {self.max_body_bytes}-byte "
                         "limit", None, "request_too_large")
            return
        name = _model_in(body) or _query_model(scope)
        if name is None:
            await self.app(scope, receive, send)
            return
        async with AsyncExitStack() as stack:
            try:
                ctx = await stack.enter_async_context(self.pool.use(name))
            except (ApiError, InvalidRequest) as e:
                await _reply(scope, send, e.status, e.message, e.param, e.code,
                             getattr(e, "headers", None))
                return
            scope.setdefault("state", {})[ROUTED_CONTEXT_KEY] = ctx
            await self.app(scope, receive, send)

    async def _buffer(self, scope: Scope, receive: Receive) -> tuple[bytes | None, Receive]:
        """The whole body (None past the limit) and a ``receive`` that replays it, then
        passes on what comes after (the disconnect the routes watch for)."""
        if scope.get("method") not in ("POST", "PUT", "PATCH"):
            return b"", receive
        chunks = bytearray()
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending it all
                return b"", _replaying(b"", receive, message)
            chunks += message.get("body", b"")
            if len(chunks) > self.max_body_bytes:
                return None, receive
            if not message.get("more_body", False):
                break
        return bytes(chunks), _replaying(bytes(chunks), receive)


def _replaying(body: bytes, receive: Receive, first: Message | None = None) -> Receive:
    pending: list[Message] = [first or {"type": "http.request", "body": body,
                                        "more_body": False}]

    async def replay() -> Message:
        if pending:
            return pending.pop()
        return await receive()

    return replay


def _model_in(body: bytes) -> str | None:
    if not body:
        return None
    try:
        parsed: Any = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None  # the route answers the malformed JSON
    model = parsed.get("model") if isinstance(parsed, dict) else None
    return model if isinstance(model, str) else None


def _query_model(scope: Scope) -> str | None:
    values = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("model")
    return values[0] if values else None


async def _reply(scope: Scope, send: Send, status: int, message: str, param: str | None,
                 code: str | None, headers: dict[str, str] | None = None) -> None:
    """The error in the shape of the API the path belongs to."""
    body = (anthropic_error_body(status, message)
            if scope.get("path", "").startswith(ANTHROPIC_PATH_PREFIX)
            else error_body(status, message, param, code))
    raw = json.dumps(body).encode()
    extra = [(k.lower().encode("latin-1"), v.encode("latin-1"))
             for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(raw)).encode())] + extra})
    await send({"type": "http.response.body", "body": raw})
