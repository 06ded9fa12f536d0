"""POST /v1/rerank (Cohere/Jina's shape, also at /rerank and /v2/rerank) and POST /v1/score
(vLLM's shape): query/document pairs scored by the same engine as generation.

With ``--score-mode yesno`` each pair is one pooling request of kind "score" (its rendered
reranker prompt, P("yes") at the last position); with ``cosine`` each text is one embedding
request and a pair's score is the cosine of the two (met.sampling.scoring). Either way the
requests batch in the engine's steps beside everything else and generate no token."""

from __future__ import annotations

import uuid
from collections.abc import Callable

from fastapi import APIRouter, Request
from fastapi.responses import Response

from met.api.context import ModelInfo, read_json, server_context
from met.api.openai.common import respond
from met.sampling.params import SamplingParams
from met.sampling.pooling import PoolingParams
from met.sampling.scoring import cosine, pair_indices, rerank_token_ids
from met.serving.errors import InvalidRequest
from met.serving.prompts import Prompt
from met.serving.protocol import RerankRequest, ScoreRequest, parse_body
from met.serving.validation import OutputOptions, check_prompt_tokens

router = APIRouter()

MAX_PAIRS = 2048  # pairs in one request (as many as /v1/embeddings takes inputs)


def _checked(model: ModelInfo, ids: list[int], param: str) -> list[int]:
    check_prompt_tokens(ids, model.limits, param)
    limit = model.limits.max_sequence_tokens
    if len(ids) > limit:
        raise InvalidRequest(f"{param}: {len(ids)} tokens, over this model's maximum context "
                             f"length of {limit} tokens (max_model_len "
                             f"{model.limits.max_model_len})", param, "context_length_exceeded")
    return ids


def _texts(value: str | list[str], param: str) -> list[str]:
    texts = [value] if isinstance(value, str) else list(value)
    if not texts:
        raise InvalidRequest(f"{param}: must not be empty", param)
    if len(texts) > MAX_PAIRS:
        raise InvalidRequest(f"{param}: at most {MAX_PAIRS} texts per request, got "
                             f"{len(texts)}", param)
    for i, t in enumerate(texts):
        name = param if isinstance(value, str) else f"{param}.{i}"
        if not t:
            raise InvalidRequest(f"{name}: must not be an empty string", name)
    return texts


def _names(value: str | list[str], param: str) -> list[str]:
    return [param] if isinstance(value, str) else [f"{param}.{i}" for i in range(len(value))]


async def _score_pairs(request: Request, kind: str, firsts: list[str], seconds: list[str],
                       pairs: list[tuple[int, int]], first_params: list[str],
                       second_params: list[str], instruction: str | None,
                       build: Callable[[list[float], int], dict]) -> Response:
    """Run the pairs (index pairs into ``firsts`` and ``seconds``, whose fields are
    ``*_params``) and answer ``build(scores, prompt tokens)``; a 400 naming the field for a
    pair that cannot run."""
    ctx = server_context(request)
    model = ctx.require_model()
    if model.score_mode.startswith("unavailable"):
        raise InvalidRequest(f"model: scoring {model.score_mode}", "model")
    if instruction is not None and model.score_mode != "yesno":
        raise InvalidRequest(f"instruction: only --score-mode yesno has a prompt to put it in "
                             f"(this server scores by {model.score_mode})", "instruction")
    tok = model.tokenizer
    if tok is None:
        raise InvalidRequest("model: this model has no tokenizer to score texts with", "model")
    if model.score_mode == "yesno":
        prompts = []
        for i, j in pairs:
            ids = rerank_token_ids(tok, firsts[i], seconds[j], instruction)
            prompts.append(Prompt(_checked(model, ids, second_params[j]), None))
        params = [SamplingParams(max_tokens=1, pooling=PoolingParams(
            kind="score", token_ids=model.score_token_ids))] * len(prompts)
    else:  # cosine: every text embedded once, each pair reads its two
        prompts = []
        for texts, names in ((firsts, first_params), (seconds, second_params)):
            for t, param in zip(texts, names, strict=True):
                ids = list(tok(t)["input_ids"])
                prompts.append(Prompt(_checked(model, ids, param), t))
        params = [SamplingParams(max_tokens=1, pooling=PoolingParams("last", True))] * len(
            prompts)
    ctx.check_queue()
    gen = ctx.new_generation(request, kind, prompts, params, 1, OutputOptions())

    def body(_texts: list[str]) -> dict:
        vectors = [c.embedding or [] for c in sorted(gen.choices, key=lambda c: c.index)]
        if model.score_mode == "yesno":
            scores = [v[1] for v in vectors]
        else:
            n = len(firsts)
            scores = [cosine(vectors[i], vectors[n + j]) for i, j in pairs]
        return build(scores, gen.prompt_tokens)

    return await respond(request, gen, None, body)


def _schema(name: str) -> dict:
    ref = {"$ref": f"#/components/schemas/{name}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


@router.post("/v1/rerank", openapi_extra=_schema("RerankRequest"))
@router.post("/rerank", openapi_extra=_schema("RerankRequest"))
@router.post("/v2/rerank", openapi_extra=_schema("RerankRequest"))
async def rerank(request: Request) -> Response:
    ctx = server_context(request)
    ctx.require_model()
    req = parse_body(RerankRequest, await read_json(request, ctx.config.max_body_bytes))
    ctx.check_model_name(req.model)
    if not req.query:
        raise InvalidRequest("query: must not be an empty string", "query")
    if not req.documents:
        raise InvalidRequest("documents: must not be empty", "documents")
    docs = [d if isinstance(d, str) else d.text for d in req.documents]
    if len(docs) > MAX_PAIRS:
        raise InvalidRequest(f"documents: at most {MAX_PAIRS} documents per request, got "
                             f"{len(docs)}", "documents")
    for i, d in enumerate(docs):
        if not d:
            raise InvalidRequest(f"documents.{i}: must not be an empty string",
                                 f"documents.{i}")
    if req.top_n is not None and req.top_n < 1:
        raise InvalidRequest(f"top_n: must be >= 1, got {req.top_n}", "top_n")
    name = req.model or ctx.config.model_name

    def build(scores: list[float], tokens: int) -> dict:
        order = sorted(range(len(scores)), key=lambda j: (-scores[j], j))
        if req.top_n is not None:
            order = order[:req.top_n]
        results = []
        for j in order:
            item: dict = {"index": j, "relevance_score": scores[j]}
            if req.return_documents:
                item["document"] = {"text": docs[j]}
            results.append(item)
        return {"id": f"rerank-{uuid.uuid4().hex}", "model": name, "results": results,
                "usage": {"total_tokens": tokens}}

    return await _score_pairs(request, "rerank", [req.query], docs,
                              pair_indices(1, len(docs)), ["query"],
                              [f"documents.{j}" for j in range(len(docs))], req.instruction,
                              build)


@router.post("/v1/score", openapi_extra=_schema("ScoreRequest"))
@router.post("/score", openapi_extra=_schema("ScoreRequest"))
async def score(request: Request) -> Response:
    ctx = server_context(request)
    ctx.require_model()
    req = parse_body(ScoreRequest, await read_json(request, ctx.config.max_body_bytes))
    ctx.check_model_name(req.model)
    firsts = _texts(req.text_1, "text_1")
    seconds = _texts(req.text_2, "text_2")
    try:
        pairs = pair_indices(len(firsts), len(seconds))
    except ValueError as e:
        raise InvalidRequest(str(e), "text_2") from None
    name = req.model or ctx.config.model_name

    def build(scores: list[float], tokens: int) -> dict:
        return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "model": name,
                "data": [{"index": k, "object": "score", "score": s}
                         for k, s in enumerate(scores)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    return await _score_pairs(request, "score", firsts, seconds, pairs,
                              _names(req.text_1, "text_1"), _names(req.text_2, "text_2"),
                              req.instruction, build)
