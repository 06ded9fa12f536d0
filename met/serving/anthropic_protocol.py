"""Anthropic's Messages API: request bodies (pydantic) and their conversion to the chat
request the engine serves.

The response's content blocks are built in ``met.serving.anthropic_output``.

Conversion: ``system`` becomes a system message; user ``tool_result`` blocks become tool
messages (before the user's text); assistant ``tool_use`` blocks become tool calls and
``thinking`` blocks the message's reasoning; ``tool_choice`` ``any`` is OpenAI's
``required``, ``tool`` a named choice; ``thinking`` enabled turns the template's
``enable_thinking`` on with ``budget_tokens`` as the engine's thinking budget (omitted or
disabled: off, as Anthropic's default); ``output_config.format`` is a json_schema
``response_format``; a final assistant message with text is a prefill the model continues.
"""

from __future__ import annotations

import json
from typing import Any, Literal

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


class ContentBlock(_Body):
    """Any content block; which fields a type needs is checked in the conversion."""

    type: str
    text: str | None = None
    source: dict[str, Any] | None = None  # image
    id: str | None = None  # tool_use
    name: str | None = None  # tool_use
    input: Any = None  # tool_use
    tool_use_id: str | None = None  # tool_result
    content: str | list[ContentBlock] | None = None  # tool_result
    is_error: bool | None = None  # tool_result
    thinking: str | None = None  # thinking
    signature: str | None = None  # thinking
    # A prompt-caching breakpoint: met's prefix cache keeps every prompt prefix already.
    cache_control: dict[str, Any] | None = None


class InputMessage(_Body):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class Tool(_Body):
    """A client tool: ``{"name", "description", "input_schema"}``."""

    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: str | None = None  # "custom" or absent; server tools are not served
    cache_control: dict[str, Any] | None = None  # as on ContentBlock: cached anyway


class ToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(_Body):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class Metadata(_Body):
    user_id: str | None = None  # accepted, unused


class OutputFormat(_Body):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Body):
    """Structured output: ``{"format": {"type": "json_schema", "schema": {...}}}``."""

    format: OutputFormat | None = None
    effort: str | None = None  # the thinking budget's share when thinking is on


class CountTokensRequest(_Body):
    """``POST /v1/messages/count_tokens``: what the prompt is made of."""

    model: str
    messages: list[InputMessage]
    system: str | list[ContentBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None


class MessagesRequest(CountTokensRequest):
    """``POST /v1/messages``."""

    max_tokens: int
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: Metadata | None = None
    output_config: OutputConfig | None = None
    stream: bool = False
    speculative: bool = True  # false: this request never speculates (met's own field)
    adapter: str | None = None  # a LoRA adapter by name (or `model` naming one)
    # Anthropic fields met has no machinery for (_UNSUPPORTED: a 400 unless the no-op value)
    service_tier: Any = None
    container: Any = None
    mcp_servers: Any = None
    context_management: Any = None


_UNSUPPORTED: Unsupported = {
    "service_tier": ((None, "auto", "standard_only"), "there is one service tier"),
    "container": ((None,), "code-execution containers are not served"),
    "mcp_servers": ((None, []), "MCP servers are not called by this server"),
    "context_management": ((None,), "context editing is not served"),
}
# Anthropic's effort → the chat request's reasoning_effort (low / medium / high of the
# thinking budget, --max-thinking-budget).
_EFFORTS = {"low": "low", "medium": "medium", "high": "high", "max": "high"}


FIELD_NAMES = model_field_names(ContentBlock, InputMessage, Tool, ToolChoice, ThinkingConfig,
                                Metadata, OutputFormat, OutputConfig, MessagesRequest)

# Internal chat-request fields → the Anthropic fields they came from (for 400s).
RENAMES = (
    (r"tools\.(\d+)\.function\.parameters", r"tools.\1.input_schema"),
    (r"tools\.(\d+)\.function\.name", r"tools.\1.name"),
    (r"tools\.(\d+)\.function", r"tools.\1"),
    (r"tool_choice\.function\.name", "tool_choice.name"),
    (r"thinking_token_budget", "thinking.budget_tokens"),
    (r"stop", "stop_sequences"),
    (r"max_completion_tokens", "max_tokens"),
    (r"response_format\.json_schema\.schema", "output_config.format.schema"),
    (r"response_format", "output_config.format"),
)


def to_chat_request(req: CountTokensRequest) -> ChatCompletionRequest:
    """The chat request that serves ``req`` (a MessagesRequest, or a count_tokens body)."""
    messages = _messages(req)
    fields: dict[str, Any] = {"model": req.model, "messages": messages}
    last = messages[-1]
    if last.role == "assistant" and last.content and not last.tool_calls:
        # A prefilled reply: the model continues the assistant's text (the template renders
        # it unclosed), and the response holds only what it adds.
        fields.update(add_generation_prompt=False,
                      chat_template_kwargs={"continue_final_message": True})
    if req.tools:
        fields["tools"] = [_tool(i, t) for i, t in enumerate(req.tools)]
    if req.tool_choice is not None:
        fields.update(_tool_choice(req.tool_choice, bool(req.tools)))
    fields.update(_thinking(req))
    if isinstance(req, MessagesRequest):
        refuse_unsupported(req, _UNSUPPORTED)
        effort = req.output_config.effort if req.output_config else None
        if effort is not None:
            if effort not in _EFFORTS:
                raise InvalidRequest(f"output_config.effort: must be one of "
                                     f"{', '.join(_EFFORTS)}, got {effort!r}",
                                     "output_config.effort")
            if not fields.get("enable_thinking"):
                raise InvalidRequest("output_config.effort: this server spends effort on "
                                     "thinking only; send thinking {type: adaptive} or "
                                     "{type: enabled}", "output_config.effort")
            if "thinking_token_budget" not in fields:
                fields["reasoning_effort"] = _EFFORTS[effort]
        fields.update(max_tokens=req.max_tokens, stop=req.stop_sequences,
                      temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                      stream=req.stream, speculative=req.speculative,
                      adapter=req.adapter)
        fmt = req.output_config.format if req.output_config else None
        if fmt is not None:
            fields["response_format"] = ResponseFormat(
                type="json_schema", json_schema=JsonSchemaFormat(schema=fmt.schema_))
    return ChatCompletionRequest(**fields)


def _messages(req: CountTokensRequest) -> list[ChatMessage]:
    if not req.messages:
        raise InvalidRequest("messages: must contain at least one message", "messages")
    out: list[ChatMessage] = []
    system = _system_text(req.system)
    if system:
        out.append(ChatMessage(role="system", content=system))
    for i, m in enumerate(req.messages):
        if isinstance(m.content, str):
            out.append(ChatMessage(role=m.role, content=m.content))
        elif m.role == "user":
            out.extend(_user_message(i, m.content))
        else:
            out.append(_assistant_message(i, m.content))
    return out


def _system_text(system: str | list[ContentBlock] | None) -> str:
    if system is None or isinstance(system, str):
        return system or ""
    for j, b in enumerate(system):
        if b.type != "text" or b.text is None:
            raise InvalidRequest(f"system.{j}.type: system blocks must be text blocks (got "
                                 f"{b.type!r})", f"system.{j}.type")
    return "\n".join(b.text or "" for b in system)


def _text(where: str, b: ContentBlock) -> str:
    if b.text is None:
        raise InvalidRequest(f"{where}.text: field required", f"{where}.text")
    return b.text


def _unsupported(where: str, b: ContentBlock, role: str) -> InvalidRequest:
    if b.type == "image":
        return InvalidRequest(f"{where}.type: image blocks need a vision model; this model "
                              f"reads text only", f"{where}.type")
    return InvalidRequest(f"{where}.type: a {role} message cannot hold a {b.type!r} block",
                          f"{where}.type")


def _user_message(i: int, blocks: list[ContentBlock]) -> list[ChatMessage]:
    """Tool results first (as tool messages, in order), then the user's text."""
    results: list[ChatMessage] = []
    texts: list[str] = []
    for j, b in enumerate(blocks):
        where = f"messages.{i}.content.{j}"
        if b.type == "text":
            texts.append(_text(where, b))
        elif b.type == "tool_result":
            if not b.tool_use_id:
                raise InvalidRequest(f"{where}.tool_use_id: field required",
                                     f"{where}.tool_use_id")
            content = _result_text(where, b.content)
            if b.is_error:
                content = "Error: " + content
            results.append(ChatMessage(role="tool", content=content, tool_call_id=b.tool_use_id))
        else:
            raise _unsupported(where, b, "user")
    if texts or not results:
        return [*results, ChatMessage(role="user", content="".join(texts))]
    return results


def _result_text(where: str, content: str | list[ContentBlock] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for k, b in enumerate(content):
        if b.type != "text":
            raise _unsupported(f"{where}.content.{k}", b, "tool_result")
        parts.append(_text(f"{where}.content.{k}", b))
    return "".join(parts)


def _assistant_message(i: int, blocks: list[ContentBlock]) -> ChatMessage:
    texts: list[str] = []
    thinking: list[str] = []
    calls: list[MessageToolCall] = []
    for j, b in enumerate(blocks):
        where = f"messages.{i}.content.{j}"
        if b.type == "text":
            texts.append(_text(where, b))
        elif b.type == "thinking":
            thinking.append(b.thinking or "")
        elif b.type == "redacted_thinking":
            continue  # encrypted elsewhere: nothing this model can read
        elif b.type == "tool_use":
            for name in ("id", "name"):
                if not getattr(b, name):
                    raise InvalidRequest(f"{where}.{name}: field required", f"{where}.{name}")
            args = b.input if b.input is not None else {}
            if not isinstance(args, dict):
                raise InvalidRequest(f"{where}.input: must be an object", f"{where}.input")
            calls.append(MessageToolCall(id=b.id, function=MessageToolCallFunction(
                name=b.name or "", arguments=json.dumps(args, ensure_ascii=False))))
        else:
            raise _unsupported(where, b, "assistant")
    return ChatMessage(role="assistant", content="".join(texts), tool_calls=calls or None,
                       reasoning_content="\n".join(thinking) or None)


def _tool(i: int, t: Tool) -> dict[str, Any]:
    if t.type not in (None, "custom"):
        raise InvalidRequest(f"tools.{i}.type: only client tools (name, description, "
                             f"input_schema) are served, got {t.type!r}", f"tools.{i}.type")
    fn: dict[str, Any] = {"name": t.name, "parameters": t.input_schema}
    if t.description is not None:
        fn["description"] = t.description
    return {"type": "function", "function": fn}


def _tool_choice(choice: ToolChoice, has_tools: bool) -> dict[str, Any]:
    if choice.type in ("any", "tool") and not has_tools:
        raise InvalidRequest(f"tool_choice: type {choice.type!r} needs tools", "tool_choice")
    out: dict[str, Any] = {}
    if choice.disable_parallel_tool_use is not None:
        out["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    if choice.type == "tool":
        if not choice.name:
            raise InvalidRequest("tool_choice.name: required when type is 'tool'",
                                 "tool_choice.name")
        out["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    else:
        out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    return out


def _thinking(req: CountTokensRequest) -> dict[str, Any]:
    t = req.thinking
    if t is None or t.type == "disabled":
        return {"enable_thinking": False}
    if t.type == "adaptive":
        return {"enable_thinking": True}
    if t.budget_tokens is None:
        raise InvalidRequest("thinking.budget_tokens: required when type is 'enabled'",
                             "thinking.budget_tokens")
    if t.budget_tokens < 1:
        raise InvalidRequest(f"thinking.budget_tokens: must be >= 1, got {t.budget_tokens}",
                             "thinking.budget_tokens")
    max_tokens = getattr(req, "max_tokens", None)
    if max_tokens is not None and t.budget_tokens >= max_tokens:
        raise InvalidRequest(f"thinking.budget_tokens: must be less than max_tokens "
                             f"({max_tokens}), got {t.budget_tokens}", "thinking.budget_tokens")
    return {"enable_thinking": True, "thinking_token_budget": t.budget_tokens}
