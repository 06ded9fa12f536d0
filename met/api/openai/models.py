"""GET /v1/models and /v1/models/{id}."""

from __future__ import annotations

from fastapi import APIRouter, Request

from met.api.context import ServerContext, server_context
from met.serving.errors import InvalidRequest

router = APIRouter()


def _card(ctx: ServerContext, name: str) -> dict:
    model = ctx.model
    return {
        "id": name, "object": "model", "created": ctx.created, "owned_by": "met",
        "root": model.root if model else None, "parent": None,
        "max_model_len": model.limits.max_model_len if model else None,
        # What the engine runs with (--dtype / --quantization auto resolved for this machine).
        "dtype": model.dtype if model else None,
        "quantization": model.quantization if model else None,
        "kv_cache_dtype": model.kv_cache_dtype if model else None,
    }


@router.get("/v1/models")
async def list_models(request: Request) -> dict:
    ctx = server_context(request)
    return {"object": "list", "data": [_card(ctx, n) for n in ctx.config.served_model_names]}


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request) -> dict:
    ctx = server_context(request)
    if model_id not in ctx.config.served_model_names:
        raise InvalidRequest(f"model: the model {model_id!r} does not exist", "model",
                             "model_not_found", 404)
    return _card(ctx, model_id)
