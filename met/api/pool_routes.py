"""The several-model server's own routes (`--models-dir`): /v1/models with each model's
state, POST /models/load and /models/unload (llama.cpp router's), and the pool's /health and
/metrics. Behind --api-key like every route but /health and /metrics."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from prometheus_client import generate_latest
from pydantic import BaseModel, ConfigDict

from met.api.context import read_json
from met.api.model_pool import LOADED, ModelEntry, ModelPool
from met.serving.errors import InvalidRequest
from met.serving.protocol import parse_body

router = APIRouter()


class ModelActionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str


def pool_of(request: Request) -> ModelPool | None:
    return getattr(request.app.state, "pool", None)


def pool_health(pool: ModelPool) -> dict:
    """ok while the process serves, whatever its models are doing (a load in progress is
    the model's state, not the server's)."""
    return {"status": "ok", "models": {e.name: e.state for e in pool.entries.values()}}


class _Merged:
    """Every registry's families as one exposition: each family's HELP and TYPE once, with
    the samples (one ``model_name`` each) of every model loaded now."""

    def __init__(self, registries: list[Any]):
        self.registries = registries

    def collect(self):
        families: dict[str, Any] = {}
        for registry in self.registries:
            for family in registry.collect():
                if family.name in families:
                    families[family.name].samples.extend(family.samples)
                else:
                    families[family.name] = family
        return list(families.values())


def pool_metrics(pool: ModelPool) -> bytes:
    registries = [pool.metrics.registry]
    for ctx in pool.contexts():
        ctx.metrics.refresh(ctx.engine)
        registries.append(ctx.metrics.registry)
    return generate_latest(_Merged(registries))  # type: ignore[arg-type]


async def _target(request: Request) -> tuple[ModelPool, ModelEntry]:
    pool = pool_of(request)
    if pool is None:
        raise InvalidRequest("model: this server serves one model; start met serve with "
                             "--models-dir to load and unload models", "model", None, 404)
    req = parse_body(ModelActionRequest, await read_json(request, pool.config.max_body_bytes))
    return pool, pool.entry(req.model)


@router.post("/models/load")
async def load_model(request: Request) -> dict:
    """Load ``model`` (waiting at most --model-load-timeout); a failed one is tried again."""
    pool, entry = await _target(request)
    already = entry.state == LOADED
    if not already and entry.load_task is None:
        pool.start_load(entry)  # also what retries a model whose load failed
    async with pool.use(entry.name):
        pass
    return {"success": True, "model": entry.name, "state": entry.state,
            "already_loaded": already}


@router.post("/models/unload")
async def unload_model(request: Request) -> dict:
    """Unload ``model`` (its KV, weights and engine thread); 409 while it serves requests."""
    pool, entry = await _target(request)
    unloaded = await pool.unload(entry.name)
    return {"success": True, "model": entry.name, "state": entry.state,
            "already_unloaded": not unloaded}
