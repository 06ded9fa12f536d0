"""Server routes beside the OpenAI ones: /health, /version, /metrics, /tokenize, /detokenize,
and vLLM's operator routes /sleep, /wake_up, /is_sleeping, /reset_prefix_cache."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

import met
from met.api.context import parse_request, read_json, server_context
from met.api.errors import ApiError
from met.api.pool_routes import pool_health, pool_metrics, pool_of
from met.engine.async_engine import SLEEP_LEVELS, EngineBusy, EngineState
from met.serving.errors import InvalidRequest
from met.serving.prompts import render_chat
from met.serving.protocol import DetokenizeRequest, TokenizeRequest
from met.serving.validation import check_prompt_tokens

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> Response:
    """200 when ready; 503 while loading, sleeping (POST /sleep), or when faulted (with the
    reason). /health is readiness: a sleeping server serves no generation. With
    --models-dir: 200 with each model's state, models loading or not."""
    pool = pool_of(request)
    if pool is not None:
        return JSONResponse(pool_health(pool))
    ctx = server_context(request)
    state = ctx.engine.state
    if state == EngineState.READY and ctx.model is not None:
        return JSONResponse({"status": "ok"})
    if state == EngineState.SLEEPING:
        return JSONResponse({"status": "sleeping", "level": ctx.engine.sleep_level},
                            status_code=503)
    if state == EngineState.FAULTED:
        return JSONResponse({"status": "faulted", "reason": ctx.engine.fault_reason},
                            status_code=503)
    if state == EngineState.STOPPED:
        return JSONResponse({"status": "stopped"}, status_code=503)
    return JSONResponse({"status": "loading"}, status_code=503, headers={"Retry-After": "5"})


@router.get("/version")
async def version() -> dict:
    return {"version": met.__version__}


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    pool = pool_of(request)
    if pool is not None:
        return Response(pool_metrics(pool), media_type=CONTENT_TYPE_LATEST)
    ctx = server_context(request)
    return Response(ctx.metrics.render(ctx.engine), media_type=CONTENT_TYPE_LATEST)


@router.post("/tokenize", openapi_extra={"requestBody": {"required": True, "content": {
    "application/json": {"schema": {"$ref": "#/components/schemas/TokenizeRequest"}}}}})
async def tokenize(request: Request) -> dict:
    """A prompt (or chat messages, through the chat template) → token ids and their count."""
    ctx = server_context(request)
    model = ctx.require_model()
    req = parse_request(
        request, TokenizeRequest, await read_json(request, ctx.config.max_body_bytes))
    ctx.check_model(req)
    if (req.prompt is None) == (req.messages is None):
        raise InvalidRequest("prompt: send exactly one of 'prompt' or 'messages'", "prompt")
    if req.messages is not None:
        ids = render_chat(model.tokenizer, model.chat_template, req.messages,
                          req.add_generation_prompt, req.chat_template_kwargs).token_ids
    else:
        if model.tokenizer is None:
            raise InvalidRequest("prompt: this model has no tokenizer", "prompt")
        ids = list(model.tokenizer(req.prompt, add_special_tokens=req.add_special_tokens)
                   ["input_ids"])
    return {"tokens": ids, "count": len(ids), "max_model_len": model.limits.max_model_len}


@router.post("/detokenize", openapi_extra={"requestBody": {"required": True, "content": {
    "application/json": {"schema": {"$ref": "#/components/schemas/DetokenizeRequest"}}}}})
async def detokenize(request: Request) -> dict:
    ctx = server_context(request)
    model = ctx.require_model()
    req = parse_request(
        request, DetokenizeRequest, await read_json(request, ctx.config.max_body_bytes))
    ctx.check_model(req)
    if model.tokenizer is None:
        raise InvalidRequest("tokens: this model has no tokenizer", "tokens")
    if req.tokens:
        check_prompt_tokens(req.tokens, model.limits, "tokens")
    return {"prompt": model.tokenizer.decode(req.tokens)}


@router.post("/sleep")
async def sleep(request: Request) -> dict:
    """Free the KV pool (``level`` 1, the default) or the KV pool and the weights (level 2,
    reloaded from the model's path by /wake_up); the process keeps its port. ``level`` as a
    query parameter (vLLM's) or in a JSON body. 409 while requests are in flight."""
    ctx = server_context(request)
    level = await _sleep_level(request, ctx.config.max_body_bytes)
    if ctx.engine.state != EngineState.SLEEPING:
        ctx.require_model()
    if ctx.has_pending_requests():
        raise ApiError(409, "the server has requests in flight; sleep once they finish",
                       None, "engine_busy")
    try:
        slept = await ctx.engine.sleep(level)
    except EngineBusy as e:
        raise ApiError(409, str(e), None, "engine_busy") from None
    return {"status": "sleeping", "level": ctx.engine.sleep_level,
            "already_sleeping": not slept}


async def _sleep_level(request: Request, limit: int) -> int:
    raw: object = request.query_params.get("level")
    if raw is None and (await request.body()):
        body = await read_json(request, limit)
        if not isinstance(body, dict) or set(body) - {"level"}:
            raise InvalidRequest("request body: only 'level' (1 or 2) may be sent", "level")
        raw = body.get("level")
    if raw is None:
        return 1
    try:
        level = int(raw)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        level = -1
    if level not in SLEEP_LEVELS or isinstance(raw, bool | float):
        raise InvalidRequest(f"level: must be 1 (free the KV cache) or 2 (the weights too), "
                             f"got {raw!r}", "level")
    return level


@router.post("/wake_up")
async def wake_up(request: Request) -> dict:
    """Reallocate what /sleep freed; the server is ready again when this returns."""
    ctx = server_context(request)
    if ctx.engine.state != EngineState.SLEEPING:
        ctx.require_model()
    try:
        woke = await ctx.engine.wake_up()
    except Exception as e:
        raise ApiError(500, f"wake up failed: {e}", None, "engine_error") from None
    return {"status": "ok", "already_awake": not woke}


@router.get("/is_sleeping")
async def is_sleeping(request: Request) -> dict:
    ctx = server_context(request)
    return {"is_sleeping": ctx.engine.state == EngineState.SLEEPING,
            "level": ctx.engine.sleep_level}


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(request: Request) -> dict:
    """Forget every cached KV block no request holds: the next identical prompt is computed
    again (cached_tokens 0). Blocks running requests hold are left alone."""
    ctx = server_context(request)
    if ctx.engine.state != EngineState.SLEEPING:
        ctx.require_model()
    dropped = await ctx.engine.reset_prefix_cache()
    return {"status": "ok", "blocks_reset": dropped}
