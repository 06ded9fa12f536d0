"""One API request's choices running on the AsyncEngine: text deltas, stops, timeout, abort.

All detokenization happens here, on the event loop (the thread that also tokenizes), so the
tokenizer is never used from two threads. A stop string found in the text finishes the
choice at once and aborts its engine request; tokens that raced the abort are dropped.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from met.engine.async_engine import AsyncEngine, OutputStream, RequestFailed
from met.engine.core import RequestUpdate
from met.sampling.params import SamplingParams
from met.serving.detokenizer import IncrementalDetokenizer, StopStringMatcher
from met.serving.prompts import Prompt
from met.serving.validation import OutputOptions, choice_params


class GenerationFailed(Exception):
    """The engine could not finish a request (a fault, or input it rejected late)."""

    def __init__(self, message: str, is_client_error: bool):
        super().__init__(message)
        self.message = message
        self.is_client_error = is_client_error


@dataclass(frozen=True)
class ChoiceDelta:
    """New text for one choice; ``finish_reason`` is set on the choice's last delta."""

    index: int
    text: str
    finish_reason: str | None = None
    # (token id, {token id: logprob}) for the tokens this delta covers, when asked for.
    logprobs: tuple[tuple[int, dict[int, float]], ...] = ()


@dataclass
class ChoiceState:
    index: int
    request_id: str
    prompt_index: int
    detok: IncrementalDetokenizer
    matcher: StopStringMatcher
    num_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    logprobs: list[tuple[int, dict[int, float]]] = field(default_factory=list)
    num_logprobs_sent: int = 0  # how many of ``logprobs`` a delta has carried
    # Per prompt token (None for the first) when prompt logprobs were asked for.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    embedding: list[float] | None = None  # set when a pooling request finishes
    token_ids: list[int] = field(default_factory=list)  # the output tokens received
    error: str | None = None  # why, when the engine failed this request alone

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def cumulative_logprob(self) -> float:
        """Sum of the chosen tokens' logprobs (needs logprobs; best_of ranks by it)."""
        return sum(entry[t] for t, entry in self.logprobs)

    def step(self, u: RequestUpdate, min_tokens: int) -> tuple[str, str | None, bool]:
        """Record engine update ``u``: the text it releases, the finish reason when the choice
        ended (None: still running), and whether a stop string ended it (the caller then
        aborts the engine request). The server and met.LLM both go through here."""
        if u.prompt_logprobs is not None:
            self.prompt_logprobs = u.prompt_logprobs
        if u.embedding is not None:
            self.embedding = u.embedding
        self.num_tokens += len(u.new_token_ids)
        self.token_ids.extend(u.new_token_ids)
        if u.new_logprobs:
            self.logprobs.extend(zip(u.new_token_ids, u.new_logprobs, strict=True))
        text, stop = self.matcher.feed(self.detok.push(u.new_token_ids),
                                       self.num_tokens >= min_tokens)
        if stop is None and u.finished:
            tail, stop = self.final_text(min_tokens)
            text += tail
        if stop is not None:
            self.stop_reason = stop
            return text, "stop", True
        if u.finished:
            self.stop_reason = u.stop_reason
            self.error = u.error
            return text, u.finish_reason or "stop", False
        return text, None, False

    def final_text(self, min_tokens: int) -> tuple[str, str | None]:
        """The generation ended: release held text (it can no longer grow into a stop)."""
        text, stop = self.matcher.feed(self.detok.flush(), self.num_tokens >= min_tokens)
        if stop is None:
            text += self.matcher.flush()
        return text, stop


def new_choices(tokenizer: Any, num_prompts: int, n: int, options: OutputOptions,
                engine_id: str) -> list[ChoiceState]:
    """``n`` choices per prompt (prompt-major), each with its detokenizer and stop matcher."""
    return [ChoiceState(p * n + j, f"{engine_id}-{p * n + j}", p,
                        IncrementalDetokenizer(tokenizer, options.skip_special_tokens),
                        StopStringMatcher(options.stop, options.include_stop_str_in_output))
            for p in range(num_prompts) for j in range(n)]


def ranked_params(params: SamplingParams, n: int, candidates: int) -> SamplingParams:
    """best_of ranks candidates by cumulative logprob: then every candidate carries logprobs
    (the caller shows them only where they were asked for)."""
    if candidates == n:
        return params
    return dataclasses.replace(params, logprobs=params.logprobs or 0)


def best_choices(choices: list[ChoiceState], n: int, candidates: int) -> list[ChoiceState]:
    """Per prompt, the ``n`` of its ``candidates`` with the highest cumulative logprob
    (best_of, as vLLM ranks them), best first; every choice when there are no extra."""
    if candidates == n:
        return choices
    out: list[ChoiceState] = []
    for start in range(0, len(choices), candidates):
        group = choices[start:start + candidates]
        group.sort(key=lambda c: -c.cumulative_logprob)
        out += group[:n]
    return out


@dataclass
class Generation:
    """Runs ``n`` choices for each prompt. Use as ``async with``; exiting aborts what is left
    (a client that went away), and iterate ``deltas()`` for the output."""

    engine: AsyncEngine
    tokenizer: Any
    prompts: list[Prompt]
    params: list[SamplingParams]  # one per prompt
    n: int
    options: OutputOptions
    timeout_s: float | None = None
    on_choice_done: Callable[[Generation, ChoiceState], None] | None = None
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    arrival: float = field(default_factory=time.monotonic)
    choices: list[ChoiceState] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        # Engine ids are always fresh: clients may reuse their x-request-id.
        self.choices = new_choices(self.tokenizer, len(self.prompts), self.n, self.options,
                                   uuid.uuid4().hex)
        self._by_rid = {c.request_id: c for c in self.choices}
        self._stream = OutputStream()
        self._failed = False

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p.token_ids) for p in self.prompts)

    @property
    def completion_tokens(self) -> int:
        return sum(c.num_tokens for c in self.choices)

    @property
    def cached_tokens(self) -> int:
        per_prompt: dict[int, int] = {}
        for c in self.choices:
            per_prompt[c.prompt_index] = max(per_prompt.get(c.prompt_index, 0),
                                             c.num_cached_tokens)
        return sum(per_prompt.values())

    async def __aenter__(self) -> Generation:
        try:
            for c in self.choices:
                params = choice_params(self.params[c.prompt_index], c.index % self.n)
                self.engine.add_request(c.request_id, self.prompts[c.prompt_index].token_ids,
                                        params, self._stream)
        except BaseException:
            await self.__aexit__()  # take back the choices already queued
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        for c in self.choices:
            if not c.finished:
                self.engine.abort_request(c.request_id)
                c.finish_reason = "error" if self._failed else "abort"
                self._done(c)

    async def deltas(self) -> AsyncIterator[ChoiceDelta]:
        """Text as it is produced, then one delta with finish_reason per choice."""
        deadline = None if self.timeout_s is None else self.arrival + self.timeout_s
        while not all(c.finished for c in self.choices):
            remaining = None if deadline is None else deadline - time.monotonic()
            try:
                item = await self._stream.get(remaining)
            except TimeoutError:
                for c in self.choices:
                    if not c.finished:
                        self.engine.abort_request(c.request_id)
                        text, stop = c.final_text(self.options.min_tokens)
                        if stop is not None:
                            c.stop_reason = stop
                        yield self._finish(c, text, "stop" if stop else "timeout")
                return
            if isinstance(item, RequestFailed):
                self._failed = True
                raise GenerationFailed(item.message, item.is_client_error)
            choice = self._by_rid[item.request_id]
            if choice.finished:
                continue
            delta = self._on_update(choice, item)
            if delta is not None:
                yield delta

    def _on_update(self, c: ChoiceState, u: RequestUpdate) -> ChoiceDelta | None:
        now = time.monotonic()
        if c.first_token_at is None:
            c.first_token_at = now
            c.num_cached_tokens = u.num_cached_tokens
        c.last_token_at = now
        text, reason, stopped = c.step(u, self.options.min_tokens)
        if stopped:
            self.engine.abort_request(c.request_id)  # no-op when the engine already finished
        if reason is not None:
            return self._finish(c, text, reason)
        return ChoiceDelta(c.index, text, logprobs=self._take_logprobs(c)) if text else None

    @staticmethod
    def _take_logprobs(c: ChoiceState) -> tuple[tuple[int, dict[int, float]], ...]:
        """Logprobs not yet sent: a delta carries those of every token since the last one
        (tokens whose text is held back wait for the delta that releases it)."""
        new = tuple(c.logprobs[c.num_logprobs_sent:])
        c.num_logprobs_sent = len(c.logprobs)
        return new

    def _finish(self, c: ChoiceState, text: str, reason: str) -> ChoiceDelta:
        c.finish_reason = reason
        self._done(c)
        return ChoiceDelta(c.index, text, reason, self._take_logprobs(c))

    def _done(self, c: ChoiceState) -> None:
        if self.on_choice_done is not None:
            self.on_choice_done(self, c)
