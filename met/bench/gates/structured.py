"""structured-validity: many chat requests with OpenAI's ``response_format`` json_schema
(strict); every output must parse as JSON and validate against its schema."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema

from met.bench.floors import get
from met.bench.gates.base import GateContext, GateOutcome
from met.bench.loadgen import Target, complete
from met.bench.progress import Progress
from met.bench.records import Check
from met.bench.sweep import run_batch

SCHEMAS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("person", {
        "type": "object",
        "properties": {"name": {"type": "string", "enum": ["Ada", "Alan", "Grace", "Linus"]},
                       "age": {"type": "integer", "minimum": 0, "maximum": 120},
                       "admin": {"type": "boolean"}},
        "required": ["name", "age", "admin"], "additionalProperties": False}),
    ("weather", {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Lima", "Oslo"]},
                       "sky": {"type": "string", "enum": ["clear", "cloudy", "rain"]},
                       "celsius": {"type": "integer", "minimum": -40, "maximum": 50}},
        "required": ["city", "sky", "celsius"], "additionalProperties": False}),
    ("tags", {
        "type": "object",
        "properties": {"tags": {"type": "array", "minItems": 1, "maxItems": 3,
                                "items": {"type": "string", "enum": ["red", "green", "blue"]}}},
        "required": ["tags"], "additionalProperties": False}),
)
_ASKS = ("Describe a person as JSON.", "Report today's weather as JSON.",
         "Give some colour tags as JSON.")


@dataclass(frozen=True)
class StructuredConfig:
    requests: int
    max_tokens: int
    concurrency: int


def configure(section: dict[str, Any], path: Path | None) -> StructuredConfig:
    g = "structured-validity"
    cfg = StructuredConfig(requests=get(section, "requests", 24, path, g),
                           max_tokens=get(section, "max_tokens", 128, path, g),
                           concurrency=get(section, "concurrency", 8, path, g))
    if cfg.requests < 1 or cfg.max_tokens < 8 or cfg.concurrency < 1:
        raise ValueError(f"{path}: [{g}] needs requests >= 1, max_tokens >= 8, "
                         "concurrency >= 1")
    return cfg


def response_format(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's field shape for a strict JSON-schema output."""
    return {"type": "json_schema",
            "json_schema": {"name": name, "schema": schema, "strict": True}}


def request_body(target: Target, i: int, max_tokens: int, stream: bool = True) -> dict:
    name, schema = SCHEMAS[i % len(SCHEMAS)]
    return target.body(_ASKS[i % len(SCHEMAS)], max_tokens, stream=stream,
                       temperature=0.7, seed=100 + i, ignore_eos=False,
                       response_format=response_format(name, schema))


def validation_error(text: str, schema: dict[str, Any]) -> str | None:
    """Why ``text`` is not a valid instance of ``schema`` (None when it is)."""
    try:
        value = json.loads(text)
    except ValueError as e:
        return f"not JSON: {e}"
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError as e:
        return f"schema: {e.message}"
    return None


async def run(ctx: GateContext, cfg: StructuredConfig) -> GateOutcome:
    chat = Target(ctx.target.url, ctx.target.model, "chat", ctx.target.api_key, False)
    try:  # a server without response_format says so with a 400 naming the field
        await complete(ctx.client, chat, request_body(chat, 0, cfg.max_tokens, stream=False))
    except RuntimeError as e:
        return GateOutcome(metrics={"preflight_error": str(e)},
                           checks=[Check.of("server accepts response_format", str(e), "==",
                                            "200 OK")])
    bodies = [request_body(chat, i, cfg.max_tokens) for i in range(cfg.requests)]
    with Progress(len(bodies), "structured-validity", ctx.progress) as bar:
        results, _ = await run_batch(ctx.client, chat, bodies, cfg.concurrency, 600.0, bar)
    invalid, errors = [], []
    for i, r in enumerate(results):
        if not r.ok:
            errors.append(f"request {i}: {r.error}")
            continue
        why = validation_error(r.text, SCHEMAS[i % len(SCHEMAS)][1])
        if why:
            invalid.append({"request": i, "schema": SCHEMAS[i % len(SCHEMAS)][0],
                            "finish_reason": r.finish_reason, "why": why,
                            "text": r.text[:300]})
    metrics = {"requests": cfg.requests, "valid": cfg.requests - len(invalid) - len(errors),
               "invalid": invalid[:10], "errors": errors[:10],
               "examples": [r.text[:300] for r in results[:len(SCHEMAS)] if r.ok]}
    return GateOutcome(metrics=metrics, checks=[
        Check.of("errors", len(errors), "==", 0),
        Check.of("invalid_outputs", len(invalid), "==", 0)])
