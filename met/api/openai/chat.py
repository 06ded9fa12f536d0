"""POST /v1/chat/completions."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter, Request
from fastapi.responses import Response

from met.api.context import read_json, server_context
from met.api.openai.common import now, respond, stream_events, usage
from met.api.openai.logprobs import chat_logprobs
from met.api.openai.structured import with_structured_outputs
from met.api.sse import SSEResponse
from met.serving.generate import ChoiceDelta, Generation
from met.serving.prompts import render_chat
from met.serving.protocol import ChatCompletionRequest, parse_body
from met.serving.validation import (
    build_params,
    check_prompt_tokens,
    check_ranges,
    check_request_limits,
    output_options,
)

router = APIRouter()


@router.post("/v1/chat/completions", openapi_extra={"requestBody": {
    "required": True,
    "content": {"application/json": {"schema": {
        "$ref": "#/components/schemas/ChatCompletionRequest"}}}}})
async def chat_completions(request: Request) -> Response:
    ctx = server_context(request)
    model = ctx.require_model()
    req = parse_body(ChatCompletionRequest, await read_json(request, ctx.config.max_body_bytes))
    ctx.check_model_name(req.model)
    use_mct = req.max_completion_tokens is not None
    max_tokens = req.max_completion_tokens if use_mct else req.max_tokens
    max_tokens_param = "max_completion_tokens" if use_mct else "max_tokens"
    check_ranges(req, max_tokens, max_tokens_param)
    check_request_limits(req, max_tokens, model.limits.requests, max_tokens_param)
    prompt = render_chat(model.tokenizer, model.chat_template, req.messages,
                         req.add_generation_prompt, req.chat_template_kwargs)
    check_prompt_tokens(prompt.token_ids, model.limits, "messages")
    params = build_params(req, max_tokens, len(prompt.token_ids), model.limits, None,
                          "messages", max_tokens_param, model.tokenizer)
    params, = await with_structured_outputs(ctx, req, [params])
    top = params.logprobs

    def logprobs(entries) -> dict | None:
        return None if top is None else chat_logprobs(model.tokenizer, entries, top)

    ctx.check_queue()
    gen = ctx.new_generation(request, "chat", [prompt], [params], req.n, output_options(req))
    name = req.model or ctx.config.model_name
    cid = f"chatcmpl-{gen.request_id}"
    created = now()
    if req.stream:
        return SSEResponse(_stream(gen, cid, created, name, req.include_usage, logprobs))

    def body(texts: list[str]) -> dict:
        return {
            "id": cid, "object": "chat.completion", "created": created, "model": name,
            "choices": [{
                "index": c.index,
                "message": {"role": "assistant", "content": texts[c.index], "refusal": None},
                "logprobs": logprobs(c.logprobs),
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            } for c in gen.choices],
            "usage": usage(gen),
            "system_fingerprint": None,
        }

    return await respond(request, gen, None, body)


def _stream(gen: Generation, cid: str, created: int, name: str, include_usage: bool,
            logprobs: Callable[[list], dict | None]):
    def chunk(choices: list[dict]) -> dict:
        out = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": name,
               "system_fingerprint": None, "choices": choices}
        if include_usage:
            out["usage"] = None
        return out

    def choice(index: int, delta: dict, finish_reason: str | None = None,
               entries: tuple = ()) -> dict:
        return {"index": index, "delta": delta,
                "logprobs": logprobs(list(entries)) if entries else None,
                "finish_reason": finish_reason,
                "stop_reason": gen.choices[index].stop_reason if finish_reason else None}

    def head() -> list[dict]:
        return [chunk([choice(c.index, {"role": "assistant", "content": ""})])
                for c in gen.choices]

    def on_delta(d: ChoiceDelta) -> list[dict]:
        out = []
        if d.text or d.logprobs:
            out.append(chunk([choice(d.index, {"content": d.text}, None, d.logprobs)]))
        if d.finish_reason is not None:
            out.append(chunk([choice(d.index, {}, d.finish_reason)]))
        return out

    def usage_chunk() -> dict:
        return {**chunk([]), "usage": usage(gen)}

    return stream_events(gen, head, on_delta, usage_chunk if include_usage else None)
