"""OpenAI's Responses API: the request body (pydantic) and its input items (normalised,
earlier turns prepended) as the chat request the engine serves (the output items are built
in ``met.serving.responses_output``).

Input items: messages (``user``, ``system``, ``developer`` → system, ``assistant``; text
content), ``function_call`` (joins the assistant message before it as a tool call),
``function_call_output`` (a tool message) and ``reasoning`` (the next assistant message's
reasoning). ``instructions`` is this request's system message; it is not carried to later
turns.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from met.serving.errors import InvalidRequest
from met.serving.field_names import model_field_names
from met.serving.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    JsonSchemaFormat,
    MessageToolCall,
    MessageToolCallFunction,
    ResponseFormat,
    Unsupported,
    refuse_unsupported,
)


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class InputContent(_Body):
    type: str
    text: str | None = None


class InputItem(_Body):
    """Any input item; which fields a type needs is checked in ``input_items``."""

    type: str | None = None  # "message" when absent
    role: str | None = None
    content: str | list[InputContent] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[InputContent] | None = None
    summary: list[InputContent] | None = None


class FunctionTool(_Body):
    """``{"type": "function", "name", "description", "parameters", "strict"}``."""

    type: str
    name: Any = None
    description: str | None = None
    parameters: Any = None
    strict: bool | None = None


class TextFormat(_Body):
    type: str
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Body):
    format: TextFormat | None = None


class ReasoningConfig(_Body):
    effort: str | None = None
    summary: str | None = None  # auto (the reasoning whole) only


class ResponsesRequest(_Body):
    """``POST /v1/responses``."""

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning: ReasoningConfig | None = None
    text: TextConfig | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None  # a label for the caller's own records: no effect
    speculative: bool = True  # false: this request never speculates (met's own field)
    adapter: str | None = None  # a LoRA adapter by name (or `model` naming one)
    prompt_cache_key: str | None = None  # a label: met's prefix cache needs no routing key
    safety_identifier: str | None = None  # a label
    # OpenAI fields met has no machinery for (_UNSUPPORTED: a 400 unless the no-op value)
    background: Any = None
    include: Any = None
    max_tool_calls: Any = None
    prompt: Any = None
    service_tier: Any = None
    top_logprobs: Any = None
    truncation: Any = None
    conversation: Any = None
    stream_options: Any = None


_UNSUPPORTED: Unsupported = {
    "background": ((None, False), "background responses are not served"),
    "include": ((None, []), "no extra output items are served"),
    "max_tool_calls": ((None,), "built-in tools are not served"),
    "prompt": ((None,), "stored prompt templates are not served"),
    "service_tier": ((None, "auto", "default"), "there is one service tier"),
    "top_logprobs": ((None, 0), "logprobs are served by /v1/chat/completions"),
    "truncation": ((None, "disabled"), "the context is never truncated"),
    "conversation": ((None,), "conversations are chained with previous_response_id"),
    "stream_options": ((None,), "stream options are not served here"),
}
_UNSUPPORTED_REASONING: Unsupported = {
    "summary": ((None, "auto"), "reasoning comes back whole, not summarised"),
}


FIELD_NAMES = model_field_names(InputContent, InputItem, FunctionTool, TextFormat, TextConfig,
                                ReasoningConfig, ResponsesRequest)

# Internal chat-request fields → the Responses fields they came from (for 400s).
RENAMES = (
    (r"max_tokens", "max_output_tokens"),
    (r"messages", "input"),
    (r"tools\.(\d+)\.function\.(\w+)", r"tools.\1.\2"),
    (r"tools\.(\d+)\.function", r"tools.\1"),
    (r"tool_choice\.function\.name", "tool_choice.name"),
    (r"response_format\.json_schema\.schema", "text.format.schema"),
    (r"response_format", "text.format"),
    (r"reasoning_effort", "reasoning.effort"),
)

# Efforts beyond ours map to the nearest: minimal → low, xhigh / max → high (all the budget).
_EFFORTS = {"minimal": "low", "low": "low", "medium": "medium", "high": "high",
            "xhigh": "high", "max": "high"}
_TEXT_PARTS = ("input_text", "output_text", "text")


def input_items(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's own input as plain items (``input.N`` names any bad one)."""
    if isinstance(req.input, str):
        return [{"type": "message", "role": "user",
                 "content": [{"type": "input_text", "text": req.input}]}]
    if not req.input:
        raise InvalidRequest("input: must be a non-empty string or list of items", "input")
    return [_item(f"input.{i}", it) for i, it in enumerate(req.input)]


def _item(where: str, it: InputItem) -> dict[str, Any]:
    kind = it.type or "message"
    if kind == "message":
        if it.role not in ("user", "assistant", "system", "developer"):
            raise InvalidRequest(f"{where}.role: must be user, assistant, system or developer, "
                                 f"got {it.role!r}", f"{where}.role")
        return {"type": "message", "role": it.role,
                "content": [{"type": "output_text" if it.role == "assistant" else "input_text",
                             "text": _text(f"{where}.content", it.content)}]}
    if kind == "function_call":
        for name in ("call_id", "name", "arguments"):
            if getattr(it, name) is None:
                raise InvalidRequest(f"{where}.{name}: field required", f"{where}.{name}")
        return {"type": "function_call", "call_id": it.call_id, "name": it.name,
                "arguments": it.arguments}
    if kind == "function_call_output":
        if it.call_id is None:
            raise InvalidRequest(f"{where}.call_id: field required", f"{where}.call_id")
        return {"type": "function_call_output", "call_id": it.call_id,
                "output": _text(f"{where}.output", it.output)}
    if kind == "reasoning":
        return {"type": "reasoning", "content": [
            {"type": "reasoning_text", "text": _text(f"{where}.content", it.content)}]}
    raise InvalidRequest(f"{where}.type: must be message, function_call, function_call_output "
                         f"or reasoning, got {kind!r}", f"{where}.type")


def _text(where: str, content: str | list[InputContent] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for j, part in enumerate(content):
        if part.type not in (*_TEXT_PARTS, "reasoning_text") or part.text is None:
            raise InvalidRequest(f"{where}.{j}.type: only text parts are served (got "
                                 f"{part.type!r})", f"{where}.{j}.type")
        parts.append(part.text)
    return "".join(parts)


def item_messages(items: list[dict[str, Any]]) -> list[ChatMessage]:
    """Plain input / output items (``input_items``' or a response's ``output``) as chat
    messages."""
    out: list[ChatMessage] = []
    reasoning: str | None = None
    for it in items:
        kind = it["type"]
        if kind == "reasoning":
            reasoning = "".join(c.get("text", "") for c in it.get("content") or [])
        elif kind == "message":
            role = "system" if it["role"] == "developer" else it["role"]
            text = "".join(c.get("text", "") for c in it["content"])
            msg = ChatMessage(role=role, content=text)
            if role == "assistant" and reasoning:
                msg.reasoning_content, reasoning = reasoning, None
            out.append(msg)
        elif kind == "function_call":
            call = MessageToolCall(id=it["call_id"], function=MessageToolCallFunction(
                name=it["name"], arguments=it["arguments"]))
            if out and out[-1].role == "assistant":  # the calls of one assistant turn
                out[-1].tool_calls = [*(out[-1].tool_calls or []), call]
            else:
                out.append(ChatMessage(role="assistant", content="", tool_calls=[call],
                                       reasoning_content=reasoning))
                reasoning = None
        elif kind == "function_call_output":
            out.append(ChatMessage(role="tool", content=it["output"],
                                   tool_call_id=it["call_id"]))
    return out


def to_chat_request(req: ResponsesRequest, items: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request serving ``req`` over the conversation ``items``."""
    refuse_unsupported(req, _UNSUPPORTED)
    if req.reasoning is not None:
        refuse_unsupported(req.reasoning, _UNSUPPORTED_REASONING, "reasoning.")
    messages = item_messages(items)
    if req.instructions:
        messages.insert(0, ChatMessage(role="system", content=req.instructions))
    fields: dict[str, Any] = {
        "model": req.model, "messages": messages, "max_tokens": req.max_output_tokens,
        "temperature": req.temperature, "top_p": req.top_p, "stream": req.stream,
        "parallel_tool_calls": req.parallel_tool_calls, "speculative": req.speculative,
        "adapter": req.adapter,
    }
    if req.tools:
        fields["tools"] = [_tool(i, t) for i, t in enumerate(req.tools)]
    if req.tool_choice is not None:
        fields["tool_choice"] = _tool_choice(req.tool_choice)
    effort = req.reasoning.effort if req.reasoning else None
    if effort is not None:
        if effort == "none":
            fields["enable_thinking"] = False
        elif effort in _EFFORTS:
            fields["reasoning_effort"] = _EFFORTS[effort]
        else:
            raise InvalidRequest(f"reasoning.effort: must be one of none, "
                                 f"{', '.join(_EFFORTS)}, got {effort!r}", "reasoning.effort")
    fmt = req.text.format if req.text else None
    if fmt is not None:
        fields["response_format"] = _response_format(fmt)
    return ChatCompletionRequest(**fields)


def _tool(i: int, t: FunctionTool) -> dict[str, Any]:
    if t.type != "function":
        raise InvalidRequest(f"tools.{i}.type: only function tools are served, got {t.type!r}",
                             f"tools.{i}.type")
    fn = {"name": t.name, "parameters": t.parameters}
    if t.description is not None:
        fn["description"] = t.description
    return {"type": "function", "function": fn}


def _tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice
    if choice.get("type") != "function":
        raise InvalidRequest("tool_choice: must be auto, none, required or {\"type\": "
                             "\"function\", \"name\": ...}", "tool_choice")
    return {"type": "function", "function": {"name": choice.get("name")}}


def _response_format(fmt: TextFormat) -> ResponseFormat:
    if fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise InvalidRequest("text.format.schema: required when type is 'json_schema'",
                                 "text.format.schema")
        return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(
            name=fmt.name, schema=fmt.schema_, strict=fmt.strict))
    if fmt.type not in ("text", "json_object"):
        raise InvalidRequest(f"text.format.type: must be text, json_object or json_schema, got "
                             f"{fmt.type!r}", "text.format.type")
    return ResponseFormat(type=fmt.type)
