"""GET /v1/models and /v1/models/{id}."""

from __future__ import annotations

from fastapi import APIRouter, Request

from met.api.context import ServerContext, server_context
from met.api.model_pool import LOADED, ModelEntry, ModelPool
from met.serving.errors import InvalidRequest

router = APIRouter()


def model_card(ctx: ServerContext, name: str) -> dict:
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


def entry_card(pool: ModelPool, e: ModelEntry) -> dict:
    """/v1/models' card for a pool model: the usual fields once loaded, plus ``state``
    (loaded, loading, unloading, unloaded, failed) and ``error`` when its load failed."""
    if e.state == LOADED and e.ctx is not None:
        card = model_card(e.ctx, e.name)
    else:
        card = {"id": e.name, "object": "model", "created": pool.created, "owned_by": "met",
                "root": e.path, "parent": None, "max_model_len": None, "dtype": None,
                "quantization": None, "kv_cache_dtype": None}
    card["state"] = e.state
    if e.error is not None:
        card["error"] = e.error
    return card


def _adapter_card(ctx: ServerContext, name: str) -> dict:
    lora = ctx.engine.core.lora
    adapter = lora.adapters[name]
    return {"id": name, "object": "model", "created": ctx.created, "owned_by": "met",
            "root": adapter.path, "parent": ctx.config.model_name, "lora_rank": adapter.rank,
            "resident": name in lora.slot_of}


def _cards(ctx: ServerContext) -> list[dict]:
    cards = [model_card(ctx, n) for n in ctx.config.served_model_names]
    for name in ctx.adapter_names():
        try:
            cards.append(_adapter_card(ctx, name))
        except KeyError:  # unloaded meanwhile
            pass
    return cards


@router.get("/v1/models")
async def list_models(request: Request) -> dict:
    pool = request.app.state.pool
    if pool is not None:  # --models-dir: every model, with its state
        return {"object": "list", "data": [entry_card(pool, e) for e in pool.entries.values()]}
    ctx = server_context(request)
    return {"object": "list", "data": _cards(ctx)}


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request) -> dict:
    pool = request.app.state.pool
    if pool is not None:
        return entry_card(pool, pool.entry(model_id))
    ctx = server_context(request)
    if model_id in ctx.adapter_names():
        return _adapter_card(ctx, model_id)
    if model_id not in ctx.config.served_model_names:
        raise InvalidRequest(f"model: the model {model_id!r} does not exist", "model",
                             "model_not_found", 404)
    return model_card(ctx, model_id)
