"""Request bodies of the OpenAI-compatible API (pydantic). Every field OpenAI defines is
here: it works, or ``met.serving.validation`` refuses it with a 400 naming it. Fields no
model defines are accepted and reported (vLLM's rule: ``ignored_fields`` finds them, the
server logs a warning and names them in the ``x-met-ignored-fields`` header). Value ranges
are checked in ``met.serving.validation`` so that every message names the field and the
allowed range."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from met.serving.errors import InvalidRequest


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage (so far) on every chunk


class ContentPart(_Body):
    type: str
    text: str | None = None


class MessageToolCallFunction(_Body):
    name: str
    arguments: str | dict[str, Any] = "{}"  # JSON text, as OpenAI sends it


class MessageToolCall(_Body):
    """An assistant message's ``tool_calls`` entry (history of an agent loop)."""

    id: str | None = None
    type: str = "function"
    function: MessageToolCallFunction


class ChatMessage(_Body):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # role assistant
    tool_call_id: str | None = None  # role tool
    reasoning_content: str | None = None  # role assistant: thinking some templates re-render


class FunctionDefinition(_Body):
    name: Any = None  # checked in met.serving.tools (400s naming the field)
    description: str | None = None
    parameters: Any = None
    strict: bool | None = None


class ToolDefinition(_Body):
    """``{"type": "function", "function": {"name", "description", "parameters"}}``."""

    type: Any = None
    function: FunctionDefinition | None = None


class RepetitionDetectionField(_Body):
    min_pattern_size: int = 1
    max_pattern_size: int = 32
    min_count: int = 4


class JsonSchemaFormat(_Body):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    """OpenAI's ``response_format``: text, json_object, or json_schema."""

    type: str
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(_Body):
    """vLLM's ``structured_outputs``: exactly one of these."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: dict[str, Any] | str | None = None


class SamplingFields(_Body):
    """Fields shared by /v1/chat/completions and /v1/completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    min_p: float | None = None
    top_n_sigma: float | None = None
    repetition_penalty: float | None = None
    repetition_penalty_window: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    lz_penalty: float | None = None
    dry_multiplier: float | None = None
    dry_base: float | None = None
    dry_allowed_length: int | None = None
    dry_sequence_breakers: list[str] | None = None
    logit_bias: dict[str, float] | None = None  # JSON keys are strings: token id → bias
    bad_words: list[str | list[int]] | None = None  # strings (tokenized here) or token ids
    allowed_token_ids: list[int] | None = None
    repetition_detection: RepetitionDetectionField | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    # vLLM's older names for structured_outputs' fields
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    num_beams: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    user: str | None = None  # a label for the caller's own records: logged, no effect
    speculative: bool = True  # false: this request never speculates (met's own field)
    # A LoRA adapter by name (the reference's field; `model` naming an adapter does the same)
    adapter: str | None = None
    cache_salt: str | None = None  # vLLM's: only requests with the same salt share prefix KV

    @property
    def include_usage(self) -> bool:
        """A usage chunk at the end of the stream (continuous_usage_stats implies it)."""
        return bool(self.stream and self.stream_options
                    and (self.stream_options.include_usage
                         or self.stream_options.continuous_usage_stats))

    @property
    def continuous_usage(self) -> bool:
        """Usage so far on every chunk of the stream."""
        return bool(self.stream and self.stream_options
                    and self.stream_options.continuous_usage_stats)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    tools: list[ToolDefinition] | None = None
    tool_choice: str | dict[str, Any] | None = None  # auto, none, required, or named
    parallel_tool_calls: bool | None = None
    enable_thinking: bool | None = None  # → chat_template_kwargs (templates that support it)
    thinking_token_budget: int | None = None
    max_thinking_tokens: int | None = None  # alias of thinking_token_budget
    thinking_budget: int | None = None  # alias of thinking_token_budget
    reasoning_effort: str | None = None  # low / medium / high of --max-thinking-budget
    prompt_logprobs: int | None = None  # vLLM's: logprobs of the rendered prompt's tokens
    # OpenAI fields met has no machinery for: a 400 naming them when set to anything but
    # their no-op value (met.serving.validation.check_unsupported)
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    functions: Any = None
    function_call: Any = None
    web_search_options: Any = None
    verbosity: Any = None
    service_tier: Any = None
    store: Any = None
    # Labels for the caller's own records (no behaviour to implement): accepted
    metadata: dict[str, Any] | None = None
    prompt_cache_key: str | None = None  # met's prefix cache needs no routing key
    safety_identifier: str | None = None


class CompletionRequest(SamplingFields):
    # A string, a list of strings, a list of token ids, or a list of token-id lists.
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    suffix: str | None = None  # fill-in-the-middle, where the tokenizer has FIM tokens
    best_of: int | None = None  # best_of candidates, the n with the highest logprob sum


class EmbeddingRequest(_Body):
    """POST /v1/embeddings (OpenAI's fields, plus met's ``pooling`` and ``normalize``)."""

    model: str | None = None
    # A string, a list of strings, a list of token ids, or a list of token-id lists.
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: str = "float"
    dimensions: int | None = None
    user: str | None = None
    pooling: str | None = None  # "last" or "mean"; None: the server's --pooling
    normalize: bool | None = None  # None: the server's (--no-normalize-embeddings)


class RerankDocument(_Body):
    text: str


class RerankRequest(_Body):
    """POST /v1/rerank (Cohere/Jina's fields as vLLM takes them, plus met's
    ``instruction`` for the yes/no reranker prompt)."""

    model: str | None = None
    query: str
    documents: list[str | RerankDocument]
    top_n: int | None = None
    return_documents: bool = True
    instruction: str | None = None


class ScoreRequest(_Body):
    """POST /v1/score (vLLM's): text_1 against text_2, 1-to-N or N-to-N."""

    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    instruction: str | None = None


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


_PROMPT_FORMS = ("a string, a list of strings, a list of token ids, or a list of token-id "
                 "lists")


_FIELD_NAMES = frozenset(
    name
    for m in (StreamOptions, ContentPart, ChatMessage, ChatCompletionRequest, CompletionRequest,
              EmbeddingRequest, RerankDocument, RerankRequest, ScoreRequest, TokenizeRequest,
              DetokenizeRequest, RepetitionDetectionField,
              ResponseFormat, JsonSchemaFormat, StructuredOutputsField, MessageToolCall,
              MessageToolCallFunction, ToolDefinition, FunctionDefinition)
    for name in (*m.model_fields, *(f.alias for f in m.model_fields.values() if f.alias))
)


# A field an API defines that met has no machinery for: the values that ask for nothing
# (accepted), and why any other value is refused.
Unsupported = dict[str, tuple[tuple[object, ...], str]]


def refuse_unsupported(req: BaseModel, table: Unsupported, prefix: str = "") -> None:
    """A 400 naming the first field of ``table`` set to a value that asks for something."""
    for name, (accepted, why) in table.items():
        value = getattr(req, name, None)
        if not any(value == ok and type(value) is type(ok) for ok in accepted):
            raise InvalidRequest(f"{prefix}{name}: not supported by this server ({why}), got "
                                 f"{value!r}"[:300], f"{prefix}{name}")


def ignored_fields(obj: Any, raw: Any, prefix: str = "") -> list[str]:
    """The keys of ``raw`` (the decoded JSON body) that no field of ``obj`` (its validated
    model) took, nested ones as dotted paths (``messages.0.foo``)."""
    out: list[str] = []
    if isinstance(obj, BaseModel) and isinstance(raw, dict):
        known: dict[str, str] = {}
        for name, f in type(obj).model_fields.items():
            known[name] = name
            if f.alias:
                known[f.alias] = name
        for key, value in raw.items():
            name = known.get(key)
            if name is None:
                out.append(f"{prefix}{key}")
            else:
                out += ignored_fields(getattr(obj, name), value, f"{prefix}{key}.")
    elif isinstance(obj, list) and isinstance(raw, list):
        for i, (o, r) in enumerate(zip(obj, raw, strict=False)):
            out += ignored_fields(o, r, f"{prefix}{i}.")
    return out


def parse_body(model: type[BaseModel], body: Any,
               field_names: frozenset[str] = _FIELD_NAMES) -> Any:
    """Validate a decoded JSON body; the first problem becomes an InvalidRequest naming it.
    ``field_names``: every field name of the body's models (another API passes its own)."""
    if not isinstance(body, dict):
        raise InvalidRequest("request body: must be a JSON object", None, "invalid_request")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = max(e.errors(), key=lambda x: len(x["loc"]))  # the most specific one
        loc = [str(p) for p in err["loc"]]
        # Union members show up in loc ('prompt', 'str'); keep the user's field path only.
        path = [p for p in loc if p.isdigit() or p in field_names]
        param = ".".join(path) or None
        if loc and loc[0] in ("prompt", "input"):
            raise InvalidRequest(f"{loc[0]}: must be {_PROMPT_FORMS}", loc[0]) from None
        if err["type"] == "missing":
            raise InvalidRequest(f"{param}: field required", param) from None
        raise InvalidRequest(f"{param}: {err['msg']} (got {err.get('input')!r})"[:500],
                             param) from None
