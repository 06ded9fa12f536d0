"""POST /v1/chat/completions."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import Response

from met.api.context import ModelInfo, ServerContext, parse_request, read_json, server_context
from met.api.openai.common import now, respond, stream_events, usage
from met.api.openai.logprobs import chat_logprobs, prompt_logprobs
from met.api.openai.structured import compile_spec, with_structured_outputs
from met.api.sse import SSEResponse
from met.serving.chat_output import ChatDelta, ChoiceOutput
from met.serving.chat_request import ChatPrompt, render_chat_prompt, tool_grammar, with_spec
from met.serving.generate import ChoiceDelta, Generation
from met.serving.protocol import ChatCompletionRequest
from met.serving.thinking_request import with_thinking_budget
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
    req = parse_request(
        request, ChatCompletionRequest, await read_json(request, ctx.config.max_body_bytes))
    run = await start_chat(ctx, request, req)
    gen, outputs, top = run.gen, run.outputs, run.top_logprobs

    def logprobs(entries) -> dict | None:
        return None if top is None else chat_logprobs(model.tokenizer, entries, top)

    name = req.model or ctx.config.model_name
    cid = f"chatcmpl-{gen.request_id}"
    created = now()
    if req.stream:
        return SSEResponse(_stream(gen, cid, created, name, req.include_usage, logprobs,
                                   outputs, req.continuous_usage))

    def on_delta(d: ChoiceDelta) -> None:
        feed_choice(outputs[d.index], d, gen)

    def body(texts: list[str]) -> dict:
        out = {
            "id": cid, "object": "chat.completion", "created": created, "model": name,
            "choices": [{
                "index": c.index,
                "message": outputs[c.index].message(),
                "logprobs": logprobs(c.logprobs),
                "finish_reason": outputs[c.index].finish_reason(c.finish_reason),
                "stop_reason": c.stop_reason,
            } for c in gen.choices],
            "usage": _usage(gen, outputs),
            "system_fingerprint": None,
        }
        if req.prompt_logprobs is not None:  # vLLM's place: the response's top level
            first = gen.choices[0]
            out["prompt_logprobs"] = None if first.prompt_logprobs is None else (
                prompt_logprobs(model.tokenizer, gen.prompts[0].token_ids,
                                first.prompt_logprobs, req.prompt_logprobs))
        return out

    return await respond(request, gen, None, body, on_delta)


def render_chat_request(ctx: ServerContext, model: ModelInfo,
                        req: ChatCompletionRequest) -> ChatPrompt:
    """The request's messages and tools through the chat template (400s name the field)."""
    template_kwargs = req.chat_template_kwargs
    if req.enable_thinking is not None:
        template_kwargs = {"enable_thinking": req.enable_thinking, **(template_kwargs or {})}
    chat = render_chat_prompt(model.tokenizer, model.chat_template, req.messages, req.tools,
                              req.tool_choice, req.parallel_tool_calls,
                              ctx.config.tool_call_parser, ctx.config.reasoning_parser,
                              req.add_generation_prompt, template_kwargs)
    check_prompt_tokens(chat.prompt.token_ids, model.limits, "messages")
    return chat


@dataclass
class ChatRun:
    """A validated, admitted chat request: its generation and each choice's output."""

    gen: Generation
    outputs: list[ChoiceOutput]
    top_logprobs: int | None


async def start_chat(ctx: ServerContext, request: Request,
                     req: ChatCompletionRequest) -> ChatRun:
    """Validate ``req``, render it, build its sampling params (grammar, thinking budget,
    tool grammar) and admit it: the Generation to run (``async with``) and its outputs."""
    model = ctx.require_model()
    ctx.check_model(req)
    use_mct = req.max_completion_tokens is not None
    max_tokens = req.max_completion_tokens if use_mct else req.max_tokens
    max_tokens_param = "max_completion_tokens" if use_mct else "max_tokens"
    check_ranges(req, max_tokens, max_tokens_param)
    check_request_limits(req, max_tokens, model.limits.requests, max_tokens_param)
    chat = render_chat_request(ctx, model, req)
    params = build_params(req, max_tokens, len(chat.prompt.token_ids), model.limits, None,
                          "messages", max_tokens_param, model.tokenizer)
    params, = await with_structured_outputs(ctx, req, [params])
    params = with_thinking_budget(params, req, ctx.config.max_thinking_budget, model.tokenizer,
                                  chat.reasoning)
    spec = tool_grammar(chat, params)
    if spec is not None:
        await compile_spec(ctx, spec, "tools")
    params = with_spec(params, spec)
    ctx.check_queue()
    gen = ctx.new_generation(request, "chat", [chat.prompt], [params], req.n,
                             output_options(req))
    outputs = chat.outputs(len(gen.choices))
    return ChatRun(gen, outputs, params.logprobs)


def feed_choice(out: ChoiceOutput, d: ChoiceDelta, gen: Generation) -> ChatDelta:
    """The choice's reasoning / content / tool-call deltas for one engine delta."""
    cd = out.feed(d.text, gen.choices[d.index].num_tokens)
    if d.finish_reason is not None:
        tail = out.finish()
        cd.reasoning += tail.reasoning
        cd.content += tail.content
        cd.tool_calls += tail.tool_calls
    return cd


def _usage(gen: Generation, outputs: list[ChoiceOutput]) -> dict:
    """OpenAI's usage, with the reasoning tokens when a reasoning parser is on."""
    u = usage(gen)
    if outputs and outputs[0].reasoning_enabled:
        u["completion_tokens_details"] = {
            "reasoning_tokens": sum(o.reasoning_tokens for o in outputs)}
    return u


def _stream(gen: Generation, cid: str, created: int, name: str, include_usage: bool,
            logprobs: Callable[[list], dict | None], outputs: list[ChoiceOutput],
            continuous_usage: bool = False):
    def chunk(choices: list[dict]) -> dict:
        out = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": name,
               "system_fingerprint": None, "choices": choices}
        if continuous_usage:  # vLLM's continuous_usage_stats: the usage so far
            out["usage"] = _usage(gen, outputs)
        elif include_usage:
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
        cd = feed_choice(outputs[d.index], d, gen)
        delta = {}
        if cd.reasoning:
            delta["reasoning_content"] = cd.reasoning
        if cd.content or (d.logprobs and not cd.reasoning):
            delta["content"] = cd.content
        if delta:
            out.append(chunk([choice(d.index, delta, None, d.logprobs)]))
        for tc in cd.tool_calls:
            out.append(chunk([choice(d.index, {"tool_calls": [tc.to_openai()]})]))
        if d.finish_reason is not None:
            reason = outputs[d.index].finish_reason(d.finish_reason)
            out.append(chunk([choice(d.index, {}, reason)]))
        return out

    def usage_chunk() -> dict:
        return {**chunk([]), "usage": _usage(gen, outputs)}

    return stream_events(gen, head, on_delta, usage_chunk if include_usage else None)
