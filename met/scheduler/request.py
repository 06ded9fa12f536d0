"""A request's state as the scheduler and engine core see it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from met.sampling.params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """Prompt + generated tokens, and how far the KV cache has caught up with them.

    The scheduler's one rule: num_computed_tokens catches up to len(all_token_ids).
    Prefill, chunking, prefix hits and recompute after preemption are all that rule.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int]
    cache_salt: str | None = None
    # What the model's rope makes this prompt's KV depend on besides its tokens (a
    # length-dependent rope: met.layers.rotary.rope_prefix_key); () for most models.
    rope_key: tuple = ()
    # A LoRA adapter (met.lora): its name, its load's unique id (the prefix-cache key) and,
    # while the request runs, the resident slot it pins (-1: none).
    lora_name: str | None = None
    lora_id: int = 0
    lora_slot: int = -1
    arrival_time: float = field(default_factory=time.monotonic)
    all_token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    num_cached_tokens: int | None = None  # prompt tokens served by the prefix cache
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # stop token id, or "repetition"
    num_preemptions: int = 0
    generator: torch.Generator | None = None
    logprobs: list[dict[int, float]] = field(default_factory=list)
    # Per prompt token when params.prompt_logprobs is set: None for the first, then filled
    # in as prefill chunks run (recomputed chunks after a preemption are not added twice).
    prompt_logprobs: list[dict[int, float] | None] = field(default_factory=lambda: [None])
    dry_breaker_ids: frozenset[int] = frozenset()  # DRY sequence breakers as token ids
    grammar: Any = None  # a GrammarState when params.structured_outputs is set
    thinking: Any = None  # a ThinkingState when params.thinking_budget is set
    pooled: Any = None  # a PoolState (met.engine.pooling) when params.pooling is set
    # Draft tokens proposed for the next step (speculative decoding): verified after
    # all_token_ids, never part of them until the target accepts them.
    spec_token_ids: list[int] = field(default_factory=list)

    def grammar_applies(self) -> bool:
        """A grammar holds the output only outside thinking (a budgeted reasoning model's
        thinking is free text)."""
        return self.grammar is not None and (self.thinking is None
                                             or not self.thinking.in_thinking)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def cache_extra_keys(self) -> tuple:
        """What besides the tokens makes this request's KV different: a salt, an adapter."""
        keys: tuple = (self.cache_salt,) if self.cache_salt else ()
        keys += self.rope_key
        return keys + (("lora", self.lora_id),) if self.lora_id else keys

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
