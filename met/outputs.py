"""Result objects, shaped like vLLM's so code written against it reads the same."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None
    error: str | None = None  # why, when finish_reason is "error" (e.g. a grammar dead end)
    # Beam search: the hypothesis' score (sum of logprobs / generated_len ** length_penalty).
    # Sampling: the sum of the chosen tokens' logprobs, where logprobs were computed (asked
    # for, or best_of ranking by it).
    cumulative_logprob: float | None = None
    # LLM.chat with tools: the parsed calls ({"name", "arguments": JSON text}, as the server's
    # message.tool_calls[i].function) and ``text`` without their markup.
    tool_calls: list[dict[str, str]] | None = None
    # LLM.chat with a reasoning parser: the thinking, split out of ``text``.
    reasoning_content: str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    # With SamplingParams.prompt_logprobs: per prompt token, None for the first.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # With SamplingParams.pooling (an embedding request): the pooled float32 vector.
    embedding: list[float] | None = None
    metrics: dict[str, float] = field(default_factory=dict)
