"""POST /v1/completions: prompt as a string, list of strings, token ids or token-id lists."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter, Request
from fastapi.responses import Response

from met.api.context import parse_request, read_json, server_context
from met.api.openai.common import now, respond, stream_events, usage
from met.api.openai.logprobs import completion_logprobs, prompt_logprobs
from met.api.openai.structured import with_structured_outputs
from met.api.sse import SSEResponse
from met.serving.errors import InvalidRequest
from met.serving.generate import ChoiceDelta, ChoiceState, Generation, best_choices, ranked_params
from met.serving.prompts import completion_prompts, fim_prompts
from met.serving.protocol import CompletionRequest
from met.serving.validation import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    build_params,
    check_prompt_tokens,
    check_ranges,
    num_candidates,
    output_options,
    requested_logprobs,
)

router = APIRouter()


@router.post("/v1/completions", openapi_extra={"requestBody": {
    "required": True,
    "content": {"application/json": {"schema": {
        "$ref": "#/components/schemas/CompletionRequest"}}}}})
async def completions(request: Request) -> Response:
    ctx = server_context(request)
    model = ctx.require_model()
    req = parse_request(request, CompletionRequest,
                        await read_json(request, ctx.config.max_body_bytes))
    ctx.check_model(req)
    check_ranges(req, req.max_tokens)
    prompts = completion_prompts(model.tokenizer, req.prompt)
    if req.suffix is not None:
        if req.echo:
            raise InvalidRequest("suffix: cannot be combined with echo (the prompt the model "
                                 "sees is the fill-in-the-middle one)", "suffix")
        prompts = fim_prompts(model.tokenizer, prompts, req.suffix)
    single = len(prompts) == 1
    params = []
    for i, p in enumerate(prompts):
        param = "prompt" if single else f"prompt.{i}"
        check_prompt_tokens(p.token_ids, model.limits, param)
        params.append(build_params(req, req.max_tokens, len(p.token_ids), model.limits,
                                   COMPLETIONS_DEFAULT_MAX_TOKENS, "prompt",
                                   tokenizer=model.tokenizer))
    params = await with_structured_outputs(ctx, req, params)
    top = requested_logprobs(req)  # what the client sees; best_of ranks by logprobs too
    candidates = num_candidates(req)
    params = [ranked_params(p, req.n, candidates) for p in params]
    ctx.check_queue()
    gen = ctx.new_generation(request, "completion", prompts, params, candidates,
                             output_options(req))
    prefixes = None
    if req.echo:
        texts = [p.text if p.text is not None
                 else model.tokenizer.decode(p.token_ids) if model.tokenizer is not None else ""
                 for p in prompts]
        prefixes = [texts[c.prompt_index] for c in gen.choices]

    def logprobs(entries, offset: int = 0) -> dict | None:
        return None if top is None else completion_logprobs(model.tokenizer, entries, top,
                                                            offset)

    name = req.model or ctx.config.model_name
    cid = f"cmpl-{gen.request_id}"
    created = now()
    if req.stream:
        return SSEResponse(_stream(gen, cid, created, name, prefixes, req.include_usage,
                                   logprobs, req.continuous_usage))

    def choice_logprobs(c: ChoiceState) -> dict | None:
        out = logprobs(c.logprobs, len(prefixes[c.index]) if prefixes else 0)
        if out is None or not req.echo or c.prompt_logprobs is None:
            return out
        # echo + logprobs: the echoed prompt's tokens come first (the first has none).
        ids = prompts[c.prompt_index].token_ids
        head = completion_logprobs(model.tokenizer, list(zip(ids, c.prompt_logprobs,
                                                             strict=True)), top or 0)
        return {key: head[key] + out[key] for key in out}

    def choice(c: ChoiceState, text: str, index: int) -> dict:
        out = {"text": text, "index": index, "logprobs": choice_logprobs(c),
               "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        if req.prompt_logprobs is not None:
            out["prompt_logprobs"] = None if c.prompt_logprobs is None else prompt_logprobs(
                model.tokenizer, prompts[c.prompt_index].token_ids, c.prompt_logprobs,
                req.prompt_logprobs)
        return out

    def body(texts: list[str]) -> dict:
        return {
            "id": cid, "object": "text_completion", "created": created, "model": name,
            "choices": [choice(c, texts[c.index], i)
                        for i, c in enumerate(best_choices(gen.choices, req.n, candidates))],
            "usage": usage(gen),
            "system_fingerprint": None,
        }

    return await respond(request, gen, prefixes, body)


def _stream(gen: Generation, cid: str, created: int, name: str, prefixes: list[str] | None,
            include_usage: bool, logprobs: Callable[..., dict | None],
            continuous_usage: bool = False):
    def chunk(choices: list[dict]) -> dict:
        out = {"id": cid, "object": "text_completion", "created": created, "model": name,
               "system_fingerprint": None, "choices": choices}
        if continuous_usage:  # vLLM's continuous_usage_stats: the usage so far
            out["usage"] = usage(gen)
        elif include_usage:
            out["usage"] = None
        return out

    # Where each choice's next token starts in its text (after the echoed prompt).
    offsets = {c.index: len(prefixes[c.index]) if prefixes else 0 for c in gen.choices}

    def choice(index: int, text: str, finish_reason: str | None = None,
               entries: tuple = ()) -> dict:
        lp = logprobs(list(entries), offsets[index]) if entries else None
        if lp is not None:
            offsets[index] = lp["text_offset"][-1] + len(lp["tokens"][-1])
        stop_reason = gen.choices[index].stop_reason if finish_reason is not None else None
        return {"text": text, "index": index, "logprobs": lp, "finish_reason": finish_reason,
                "stop_reason": stop_reason}

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
