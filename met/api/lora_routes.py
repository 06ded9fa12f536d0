"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's shape), only under
``--allow-runtime-lora`` and behind the API key like every route."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict

from met.api.context import ServerContext, read_json, server_context
from met.serving.errors import InvalidRequest
from met.serving.protocol import parse_body

router = APIRouter()


class LoadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str


def _manager(ctx: ServerContext):
    if not ctx.config.allow_runtime_lora:
        raise InvalidRequest("lora_name: loading adapters while serving is off; start met "
                             "serve with --allow-runtime-lora", "lora_name",
                             "permission_error", 403)
    ctx.require_model()
    lora = ctx.engine.core.lora
    if lora is None:
        raise InvalidRequest("lora_name: LoRA is not enabled; start met serve with "
                             "--enable-lora", "lora_name")
    return lora


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: Request) -> dict:
    ctx = server_context(request)
    lora = _manager(ctx)
    req = parse_body(LoadLoRARequest, await read_json(request, ctx.config.max_body_bytes))
    if req.lora_name in ctx.config.served_model_names:
        raise InvalidRequest(f"lora_name: {req.lora_name!r} is the base model's name",
                             "lora_name")
    try:
        adapter = await asyncio.to_thread(lora.register, req.lora_name, req.lora_path)
    except ValueError as e:
        raise InvalidRequest(str(e), "lora_path") from e
    return {"object": "lora_adapter", "id": adapter.name, "rank": adapter.rank,
            "bytes": adapter.nbytes, "status": "loaded"}


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: Request) -> dict:
    ctx = server_context(request)
    lora = _manager(ctx)
    req = parse_body(UnloadLoRARequest, await read_json(request, ctx.config.max_body_bytes))
    if req.lora_name not in lora.adapters:
        raise InvalidRequest(f"lora_name: no adapter {req.lora_name!r} is loaded", "lora_name",
                             "model_not_found", 404)
    try:
        lora.unregister(req.lora_name)
    except ValueError as e:  # running requests use it: they finish first
        raise InvalidRequest(str(e), "lora_name", "adapter_in_use", 409) from e
    return {"object": "lora_adapter", "id": req.lora_name, "status": "unloaded"}
