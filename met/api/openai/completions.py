"""POST /v1/completions: prompt as a string, list of strings, token ids or token-id lists."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter, Request
from fastapi.responses import Response

from met.api.context import read_json, server_context
from met.api.openai.common import now, respond, stream_events, usage
from met.api.openai.logprobs import completion_logprobs
from met.api.sse import SSEResponse
from met.serving.generate import ChoiceDelta, Generation
from met.serving.prompts import completion_prompts
from met.serving.protocol import CompletionRequest, parse_body
from met.serving.validation import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    build_params,
    check_prompt_tokens,
    check_ranges,
    output_options,
)

router = APIRouter()


@router.post("/v1/completions", openapi_extra={"requestBody": {
    "required": True,
    "content": {"application/json": {"schema": {
        "$ref": "#/components/schemas/CompletionRequest"}}}}})
async def completions(request: Request) -> Response:
    ctx = server_context(request)
    model = ctx.require_model()
    req = parse_body(CompletionRequest, await read_json(request, ctx.config.max_body_bytes))
    ctx.check_model_name(req.model)
    check_ranges(req, req.max_tokens)
    prompts = completion_prompts(model.tokenizer, req.prompt)
    single = len(prompts) == 1
    params = []
    for i, p in enumerate(prompts):
        param = "prompt" if single else f"prompt.{i}"
        check_prompt_tokens(p.token_ids, model.limits, param)
        params.append(build_params(req, req.max_tokens, len(p.token_ids), model.limits,
                                   COMPLETIONS_DEFAULT_MAX_TOKENS, "prompt",
                                   tokenizer=model.tokenizer))
    ctx.check_queue()
    gen = ctx.new_generation(request, "completion", prompts, params, req.n,
                             output_options(req))
    prefixes = None
    if req.echo:
        texts = [p.text if p.text is not None
                 else model.tokenizer.decode(p.token_ids) if model.tokenizer is not None else ""
                 for p in prompts]
        prefixes = [texts[c.prompt_index] for c in gen.choices]
    top = params[0].logprobs

    def logprobs(entries, offset: int = 0) -> dict | None:
        return None if top is None else completion_logprobs(model.tokenizer, entries, top,
                                                            offset)

    name = req.model or ctx.config.model_name
    cid = f"cmpl-{gen.request_id}"
    created = now()
    if req.stream:
        return SSEResponse(_stream(gen, cid, created, name, prefixes, req.include_usage,
                                   logprobs))

    def body(texts: list[str]) -> dict:
        return {
            "id": cid, "object": "text_completion", "created": created, "model": name,
            "choices": [{"text": texts[c.index], "index": c.index,
                         "logprobs": logprobs(c.logprobs,
                                              len(prefixes[c.index]) if prefixes else 0),
                         "finish_reason": c.finish_reason} for c in gen.choices],
            "usage": usage(gen),
            "system_fingerprint": None,
        }

    return await respond(request, gen, prefixes, body)


def _stream(gen: Generation, cid: str, created: int, name: str, prefixes: list[str] | None,
            include_usage: bool, logprobs: Callable[..., dict | None]):
    def chunk(choices: list[dict]) -> dict:
        out = {"id": cid, "object": "text_completion", "created": created, "model": name,
               "system_fingerprint": None, "choices": choices}
        if include_usage:
            out["usage"] = None
        return out

    # Where each choice's next token starts in its text (after the echoed prompt).
    offsets = {c.index: len(prefixes[c.index]) if prefixes else 0 for c in gen.choices}

    def choice(index: int, text: str, finish_reason: str | None = None,
               entries: tuple = ()) -> dict:
        lp = logprobs(list(entries), offsets[index]) if entries else None
        if lp is not None:
            offsets[index] = lp["text_offset"][-1] + len(lp["tokens"][-1])
        return {"text": text, "index": index, "logprobs": lp, "finish_reason": finish_reason}

    def head() -> list[dict]:
        if not prefixes:
            return []
        return [chunk([choice(i, text)]) for i, text in enumerate(prefixes) if text]

    def on_delta(d: ChoiceDelta) -> list[dict]:
        out = []
        if d.text or d.logprobs:
            out.append(chunk([choice(d.index, d.text, None, d.logprobs)]))
        if d.finish_reason is not None:
            out.append(chunk([choice(d.index, "", d.finish_reason)]))
        return out

    def usage_chunk() -> dict:
        return {**chunk([]), "usage": usage(gen)}

    return stream_events(gen, head, on_delta, usage_chunk if include_usage else None)
