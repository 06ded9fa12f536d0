"""POST /v1/embeddings: OpenAI's shape, served by the same engine as generation.

Each input becomes a pooling request (met.sampling.pooling): its prompt runs in the engine's
flat batch beside generating requests and finishes with the pooled vector, returned as JSON
floats or, with ``encoding_format: "base64"``, as base64 of little-endian float32 (OpenAI's
encoding)."""

from __future__ import annotations

import base64
import struct

from fastapi import APIRouter, Request
from fastapi.responses import Response

from met.api.context import read_json, server_context
from met.api.openai.common import respond
from met.sampling.params import SamplingParams
from met.sampling.pooling import PoolingParams
from met.serving.errors import InvalidRequest, from_value_error
from met.serving.prompts import completion_prompts
from met.serving.protocol import EmbeddingRequest, parse_body
from met.serving.validation import OutputOptions, check_prompt_tokens

router = APIRouter()

ENCODING_FORMATS = ("float", "base64")
MAX_INPUTS = 2048  # inputs in one request, as OpenAI allows


def encode_embedding(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector


@router.post("/v1/embeddings", openapi_extra={"requestBody": {
    "required": True,
    "content": {"application/json": {"schema": {
        "$ref": "#/components/schemas/EmbeddingRequest"}}}}})
async def embeddings(request: Request) -> Response:
    ctx = server_context(request)
    model = ctx.require_model()
    req = parse_body(EmbeddingRequest, await read_json(request, ctx.config.max_body_bytes))
    ctx.check_model_name(req.model)
    if req.encoding_format not in ENCODING_FORMATS:
        raise InvalidRequest(f"encoding_format: must be one of {', '.join(ENCODING_FORMATS)}, "
                             f"got {req.encoding_format!r}", "encoding_format")
    if req.dimensions is not None and not 1 <= req.dimensions <= model.hidden_size:
        raise InvalidRequest(f"dimensions: must be in [1, {model.hidden_size}] (this model's "
                             f"embedding size), got {req.dimensions}", "dimensions")
    try:
        pooling = PoolingParams(req.pooling or model.pooling,
                                model.normalize_embeddings if req.normalize is None
                                else req.normalize, req.dimensions)
    except ValueError as e:
        raise from_value_error(e) from None
    if isinstance(req.input, list) and any(isinstance(x, str) and not x for x in req.input):
        i = req.input.index("")
        raise InvalidRequest(f"input.{i}: must not be an empty string", f"input.{i}")
    if req.input == "":
        raise InvalidRequest("input: must not be an empty string", "input")
    if isinstance(req.input, list) and len(req.input) > MAX_INPUTS and not all(
            isinstance(x, int) for x in req.input):
        raise InvalidRequest(f"input: at most {MAX_INPUTS} inputs per request, got "
                             f"{len(req.input)}", "input")
    prompts = completion_prompts(model.tokenizer, req.input, "input")
    single = len(prompts) == 1
    limit = model.limits.max_sequence_tokens
    for i, p in enumerate(prompts):
        param = "input" if single else f"input.{i}"
        check_prompt_tokens(p.token_ids, model.limits, param)
        if len(p.token_ids) > limit:
            raise InvalidRequest(f"{param}: {len(p.token_ids)} tokens, over this model's "
                                 f"maximum context length of {limit} tokens (max_model_len "
                                 f"{model.limits.max_model_len})", param,
                                 "context_length_exceeded")
    # max_tokens only sizes the rate limit's charge: a pooling request generates nothing.
    params = [SamplingParams(max_tokens=1, pooling=pooling)] * len(prompts)
    ctx.check_queue()
    gen = ctx.new_generation(request, "embedding", prompts, params, 1, OutputOptions())
    name = req.model or ctx.config.model_name

    def body(_texts: list[str]) -> dict:
        return {
            "object": "list",
            "data": [{"object": "embedding", "index": c.index,
                      "embedding": encode_embedding(c.embedding or [], req.encoding_format)}
                     for c in gen.choices],
            "model": name,
            "usage": {"prompt_tokens": gen.prompt_tokens, "total_tokens": gen.prompt_tokens},
        }

    return await respond(request, gen, None, body)
