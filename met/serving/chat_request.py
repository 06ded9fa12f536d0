"""A chat request rendered and its tool grammar decided: shared by the HTTP chat route and
the offline ``met.LLM.chat``, so both render, constrain and parse alike."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from met.sampling.params import SamplingParams, StructuredOutputs
from met.serving.chat_output import ChoiceOutput
from met.serving.errors import InvalidRequest
from met.serving.prompts import Prompt, render_chat
from met.serving.protocol import ChatMessage
from met.serving.reasoning import ThinkParser, get_reasoning_parser
from met.serving.tool_grammar import request_tool_grammar
from met.serving.tool_parsers import ToolParser, get_tool_parser
from met.serving.tools import ToolRequest, tool_request


@dataclass(frozen=True)
class ChatPrompt:
    """A chat request rendered: its prompt, tools, tool-call parser and reasoning parser."""

    prompt: Prompt
    tools: ToolRequest
    tool_parser: ToolParser
    reasoning: ThinkParser | None

    def outputs(self, count: int) -> list[ChoiceOutput]:
        """One output (reasoning split, then tool calls parsed) per choice."""
        return [ChoiceOutput(self.reasoning, self.tool_parser if self.tools.active else None)
                for _ in range(count)]


def render_chat_prompt(tokenizer: Any, template: str | None,
                       messages: list[ChatMessage] | list[dict[str, Any]],
                       tools: list[Any] | None, tool_choice: Any,
                       parallel_tool_calls: bool | None, tool_call_parser: str,
                       reasoning_parser: str | None, add_generation_prompt: bool = True,
                       template_kwargs: dict[str, Any] | None = None) -> ChatPrompt:
    """Messages and tools through the chat template, with the tool-call parser
    (``tool_call_parser``: a name or ``auto``) and reasoning parser that apply (InvalidRequest
    naming the field)."""
    msgs = [m if isinstance(m, ChatMessage) else _message(m, i)
            for i, m in enumerate(messages)]
    req_tools = tool_request(tools, tool_choice, parallel_tool_calls)
    parser = get_tool_parser(tool_call_parser, template, req_tools.tools)
    prompt = render_chat(tokenizer, template, msgs, add_generation_prompt, template_kwargs,
                         list(req_tools.tools) if req_tools.active else None, parser)
    reasoning = get_reasoning_parser(reasoning_parser, template, prompt.text)
    return ChatPrompt(prompt, req_tools, parser, reasoning)


def tool_grammar(chat: ChatPrompt, params: SamplingParams) -> StructuredOutputs | None:
    """The grammar holding tool calls to their schemas, to compile and attach (None: none;
    the request's own grammar wins for tool_choice auto, and required / named cannot be
    combined with one)."""
    # With a thinking budget the engine pauses the grammar while thinking: hold only the answer.
    thinking = chat.reasoning if params.thinking_budget is None else None
    spec = request_tool_grammar(chat.tools, chat.tool_parser, thinking)
    if spec is None:
        return None
    if params.structured_outputs is not None:
        if chat.tools.choice == "auto":
            return None  # the response_format / structured_outputs constraint rules
        raise InvalidRequest("tool_choice: 'required' or a named tool cannot be combined with "
                             "response_format / structured_outputs", "tool_choice")
    return spec


def with_spec(params: SamplingParams, spec: StructuredOutputs | None) -> SamplingParams:
    return params if spec is None else dataclasses.replace(params, structured_outputs=spec)


def _message(m: Any, i: int) -> ChatMessage:
    try:
        return ChatMessage.model_validate(m)
    except Exception as e:  # pydantic's ValidationError
        raise InvalidRequest(f"messages.{i}: {e}", f"messages.{i}") from None
