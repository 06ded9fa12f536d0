"""Server routes beside the OpenAI ones: /health, /version, /metrics, /tokenize, /detokenize."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

import met
from met.api.context import read_json, server_context
from met.engine.async_engine import EngineState
from met.serving.errors import InvalidRequest
from met.serving.prompts import render_chat
from met.serving.protocol import DetokenizeRequest, TokenizeRequest, parse_body
from met.serving.validation import check_prompt_tokens

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> Response:
    """200 when ready; 503 while loading, or when faulted (with the reason)."""
    ctx = server_context(request)
    state = ctx.engine.state
    if state == EngineState.READY and ctx.model is not None:
        return JSONResponse({"status": "ok"})
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
    ctx = server_context(request)
    return Response(ctx.metrics.render(ctx.engine), media_type=CONTENT_TYPE_LATEST)


@router.post("/tokenize", openapi_extra={"requestBody": {"required": True, "content": {
    "application/json": {"schema": {"$ref": "#/components/schemas/TokenizeRequest"}}}}})
async def tokenize(request: Request) -> dict:
    """A prompt (or chat messages, through the chat template) → token ids and their count."""
    ctx = server_context(request)
    model = ctx.require_model()
    req = parse_body(TokenizeRequest, await read_json(request, ctx.config.max_body_bytes))
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
    req = parse_body(DetokenizeRequest, await read_json(request, ctx.config.max_body_bytes))
    ctx.check_model(req)
    if model.tokenizer is None:
        raise InvalidRequest("tokens: this model has no tokenizer", "tokens")
    if req.tokens:
        check_prompt_tokens(req.tokens, model.limits, "tokens")
    return {"prompt": model.tokenizer.decode(req.tokens)}
