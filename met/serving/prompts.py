"""Prompts → token ids: chat messages through the model's Jinja chat template, and the four
completions prompt forms (string, list of strings, token ids, list of token-id lists)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from met.serving.errors import InvalidRequest
from met.serving.protocol import ChatMessage
from met.serving.tool_parsers import ToolParser
from met.serving.tools import call_arguments, prepare_conversation

# chat_template_kwargs may not override the arguments we pass ourselves.
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "chat_template", "tokenize", "add_generation_prompt",
    "return_dict", "return_tensors", "padding", "truncation", "max_length", "tokenizer_kwargs",
    "tools",
})


@dataclass(frozen=True)
class Prompt:
    """One prompt as the engine sees it, plus its text (for echo)."""

    token_ids: list[int]
    text: str | None


def load_chat_template(arg: str | None) -> str | None:
    """--chat-template: a file holding a Jinja template, or the template text itself."""
    if arg is None:
        return None
    path = Path(arg).expanduser()
    if path.is_file():
        return path.read_text()
    if "{" not in arg:
        raise ValueError(f"--chat-template: {arg!r} is neither a file nor a Jinja template")
    return arg


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the template expects them; content parts are joined to plain text."""
    if not messages:
        raise InvalidRequest("messages: must contain at least one message", "messages")
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise InvalidRequest(
                        f"messages.{i}.content.{j}: only text parts are supported "
                        f"(got type {part.type!r})", f"messages.{i}.content.{j}.type")
                texts.append(part.text)
            content = "".join(texts)
        d: dict[str, Any] = {"role": m.role, "content": content or ""}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_calls:
            d["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": call_arguments(c.function.arguments)}}
                for c in m.tool_calls]
        if m.role == "tool":
            if m.tool_call_id is None:
                raise InvalidRequest(f"messages.{i}.tool_call_id: required for role 'tool'",
                                     f"messages.{i}.tool_call_id")
            d["tool_call_id"] = m.tool_call_id
        if m.reasoning_content:
            d["reasoning_content"] = m.reasoning_content
        out.append(d)
    return out


def render_chat(tokenizer: Any, template: str | None, messages: list[ChatMessage],
                add_generation_prompt: bool = True,
                template_kwargs: dict[str, Any] | None = None,
                tools: list[dict[str, Any]] | None = None,
                tool_parser: ToolParser | None = None) -> Prompt:
    """Apply the chat template (Jinja via transformers) and tokenize the result.

    ``tools`` go to the template's ``tools`` variable; a template that never reads it gets
    them as a system message in ``tool_parser``'s format instead, and tool history as text
    (``met.serving.tools.prepare_conversation``)."""
    if tokenizer is None:
        raise InvalidRequest("messages: this model has no tokenizer; use /v1/completions with "
                             "token ids", "messages")
    if not template:
        raise InvalidRequest("messages: this model has no chat template; start the server with "
                             "--chat-template", "messages")
    conv, tools = prepare_conversation(template, message_dicts(messages), tools, tool_parser)
    kwargs = dict(template_kwargs or {})
    bad = sorted(_RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if bad:
        raise InvalidRequest(f"chat_template_kwargs: may not set {bad}", "chat_template_kwargs")
    if tools:
        kwargs["tools"] = tools
    try:
        text = tokenizer.apply_chat_template(
            conv, chat_template=template, add_generation_prompt=add_generation_prompt,
            tokenize=False, **kwargs,
        )
    except Exception as e:  # jinja2 errors, raise_exception() in templates, bad kwargs
        raise InvalidRequest(f"messages: the chat template failed: {e}", "messages") from None
    # The template already placed BOS and friends; add no more (what transformers does too).
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return Prompt(ids, text)


def completion_prompts(tokenizer: Any, prompt: Any, param: str = "prompt") -> list[Prompt]:
    """The four OpenAI prompt forms → one Prompt each (a string or token list is one prompt).
    ``param``: the field they came in (``input`` for embeddings)."""
    if isinstance(prompt, str):
        return [_encode(tokenizer, prompt, param)]
    if not isinstance(prompt, list) or not prompt:
        raise InvalidRequest(f"{param}: must be a non-empty string or list", param)
    if all(isinstance(p, int) for p in prompt):
        return [Prompt([int(t) for t in prompt], None)]
    if all(isinstance(p, str) for p in prompt):
        return [_encode(tokenizer, p, f"{param}.{i}") for i, p in enumerate(prompt)]
    if all(isinstance(p, list) for p in prompt):
        return [Prompt([int(t) for t in p], None) for p in prompt]
    raise InvalidRequest(f"{param}: do not mix strings and token ids in one list", param)


def _encode(tokenizer: Any, text: str, param: str) -> Prompt:
    if tokenizer is None:
        raise InvalidRequest(f"{param}: this model has no tokenizer; send token ids", param)
    return Prompt(list(tokenizer(text)["input_ids"]), text)


# Fill-in-the-middle tokens (prefix, suffix, middle), as the model families spell them:
# Qwen2.5-Coder / DeepSeek-style <|fim_*|>, StarCoder <fim_*>, SantaCoder <fim-*>.
FIM_SPELLINGS = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
    ("<fim-prefix>", "<fim-suffix>", "<fim-middle>"),
)


def fim_tokens(tokenizer: Any) -> tuple[int, int, int] | None:
    """The tokenizer's (prefix, suffix, middle) FIM token ids, or None when it has none."""
    if tokenizer is None:
        return None
    vocab = tokenizer.get_vocab()
    for spelling in FIM_SPELLINGS:
        ids = [vocab.get(t) for t in spelling]
        if all(i is not None for i in ids):
            return ids[0], ids[1], ids[2]  # type: ignore[return-value]
    return None


def fim_prompts(tokenizer: Any, prompts: list[Prompt], suffix: str) -> list[Prompt]:
    """``suffix`` (completions): each prompt becomes prefix-suffix-middle (PSM) order,
    ``<fim_prefix>{prompt}<fim_suffix>{suffix}<fim_middle>``, and the model writes the middle.
    A 400 naming ``suffix`` when the model's tokenizer has no FIM tokens."""
    ids = fim_tokens(tokenizer)
    if ids is None:
        raise InvalidRequest("suffix: this model's tokenizer has no fill-in-the-middle tokens "
                             f"({', '.join(s[0] for s in FIM_SPELLINGS)} and their suffix / "
                             "middle partners); send the prompt alone", "suffix")
    pre, suf, mid = ids
    tail = list(tokenizer.encode(suffix, add_special_tokens=False))
    out = []
    for p in prompts:
        body = (list(tokenizer.encode(p.text, add_special_tokens=False))
                if p.text is not None else p.token_ids)
        out.append(Prompt([pre, *body, suf, *tail, mid], p.text))
    return out
