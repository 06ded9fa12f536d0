"""The FastAPI app: routes, middleware, error handlers, and the engine's lifetime."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import quote

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import met
from met.api.anthropic import messages as anthropic_messages
from met.api.auth import ApiKeyMiddleware
from met.api.context import IGNORED_FIELDS_HEADER, ServerConfig, ServerContext
from met.api.errors import error_body, install_error_handlers
from met.api.lora_routes import router as lora_router
from met.api.model_pool import ModelPool
from met.api.model_router import ModelRouterMiddleware
from met.api.openai import chat, completions, embeddings, models, responses, scores
from met.api.pool_routes import router as pool_router
from met.api.routes import router as server_router
from met.api.webui import WebChatMiddleware
from met.engine.async_engine import AsyncEngine, EngineState
from met.serving.anthropic_protocol import CountTokensRequest, MessagesRequest
from met.serving.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    RerankRequest,
    ScoreRequest,
    TokenizeRequest,
)
from met.serving.responses_protocol import ResponsesRequest

log = logging.getLogger("met.api")

_BODY_MODELS = (ChatCompletionRequest, CompletionRequest, EmbeddingRequest, RerankRequest,
                ScoreRequest, TokenizeRequest, DetokenizeRequest,
                MessagesRequest, CountTokensRequest, ResponsesRequest)


class RequestIdMiddleware:
    """``x-request-id`` on every response (the client's own, or a fresh one), and a JSON 500
    for anything that escaped the handlers, so even a crash answers in OpenAI's shape."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1").strip()
        rid = given[:128] if given else uuid.uuid4().hex
        state = scope.setdefault("state", {})
        state["request_id"] = rid
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                headers = list(message.get("headers", []))
                headers.append((b"x-request-id", rid.encode("latin-1")))
                ignored = state.get("ignored_fields")
                if ignored:  # the body's unknown fields (context.parse_request)
                    # Percent-encoded: a field name may hold CR, NUL or commas, which
                    # must not reach (or split) a header value.
                    names = ",".join(quote(n, safe="._-") for n in ignored)[:1024].encode()
                    headers.append((IGNORED_FIELDS_HEADER.encode(), names))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            log.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"))
            if started:
                raise
            body = json.dumps(error_body(500, "internal server error", None,
                                         "internal_error")).encode()
            await send_with_id({"type": "http.response.start", "status": 500, "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode())]})
            await send_with_id({"type": "http.response.body", "body": body})


def build_app(config: ServerConfig, engine: AsyncEngine | None,
              on_fatal: Callable[[], None] | None = None,
              pool: ModelPool | None = None) -> FastAPI:
    """The app serving ``engine``, or (``--models-dir``) the models of ``pool``. Its lifespan
    starts the engine (loading the model in the engine thread, so /health answers 503
    "loading" meanwhile) and stops it at shutdown. ``on_fatal`` is called when the model
    fails to load (the CLI stops the server). A pool loads its models when requests name
    them; its lifespan stops every loaded one at shutdown."""
    if (engine is None) == (pool is None):
        raise ValueError("build_app: give exactly one of engine or pool")
    ctx = ServerContext(config, engine) if engine is not None else None

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if pool is not None:
            pool.start()
            try:
                yield
            finally:
                log.info("stopping the loaded models' engines")
                await pool.shutdown()
            return
        assert engine is not None and ctx is not None
        engine.start()
        waiter = asyncio.create_task(_announce_when_ready(ctx, on_fatal))
        try:
            yield
        finally:
            waiter.cancel()
            log.info("stopping the engine")
            await engine.shutdown()

    app = FastAPI(title="met", version=met.__version__, lifespan=lifespan,
                  docs_url=None, redoc_url=None)
    app.state.ctx = ctx
    app.state.pool = pool
    install_error_handlers(app)
    for router in (chat.router, completions.router, embeddings.router, scores.router,
                   models.router, responses.router, anthropic_messages.router, lora_router,
                   pool_router, server_router):
        app.include_router(router)
    if pool is not None:
        # Inside the key check: an unauthenticated request never makes a model load.
        app.add_middleware(ModelRouterMiddleware, pool=pool,
                           max_body_bytes=config.max_body_bytes)
    app.add_middleware(ApiKeyMiddleware, keys=config.api_keys)
    app.add_middleware(WebChatMiddleware)  # outside the key check: the page at / loads keyless
    app.add_middleware(RequestIdMiddleware)  # added last = outermost: 401s get an id too
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


async def _announce_when_ready(ctx: ServerContext, on_fatal: Callable[[], None] | None) -> None:
    await ctx.engine.wait_ready()
    if ctx.engine.state != EngineState.READY:
        log.error("met: cannot serve: %s", ctx.engine.fault_reason)
        if on_fatal is not None:
            on_fatal()
        return
    ctx.on_engine_ready()
    model = ctx.model
    core = ctx.engine.core
    assert model is not None and core is not None
    log.info("met: ready in %.1fs — model %s (%s), dtype %s, quantization %s, max_model_len "
             "%d, KV cache %d tokens (%d blocks of %d, %s)", ctx.engine.load_seconds or 0.0,
             ctx.config.model_name, model.root, model.dtype, model.quantization,
             model.limits.max_model_len, core.capacity_tokens,
             model.limits.num_kv_blocks, model.limits.block_size, model.kv_cache_dtype)


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema plus the request bodies, which the routes parse themselves (to answer
    every bad field with an OpenAI-shaped 400 that names it)."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for model in _BODY_MODELS:
        body = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(body.pop("$defs", {}))
        components[model.__name__] = body
    app.openapi_schema = schema
    return schema
