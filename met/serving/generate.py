"""One API request's choices running on the AsyncEngine: text deltas, stops, timeout, abort.

All detokenization happens here, on the event loop (the thread that also tokenizes), so the
tokenizer is never used from two threads. A stop string found in the text finishes the
choice at once and aborts its engine request; tokens that raced the abort are dropped.
"""

from __future__ import annotations

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

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


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
        engine_id = uuid.uuid4().hex
        for p in range(len(self.prompts)):
            for j in range(self.n):
                index = p * self.n + j
                self.choices.append(ChoiceState(
                    index, f"{engine_id}-{index}", p,
                    IncrementalDetokenizer(self.tokenizer, self.options.skip_special_tokens),
                    StopStringMatcher(self.options.stop, self.options.include_stop_str_in_output),
                ))
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
                        text, stop = self._final_text(c)
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
        c.num_tokens += len(u.new_token_ids)
        if u.prompt_logprobs is not None:
            c.prompt_logprobs = u.prompt_logprobs
        if u.embedding is not None:
            c.embedding = u.embedding
        if u.new_logprobs:
            c.logprobs.extend(zip(u.new_token_ids, u.new_logprobs, strict=True))
        check = c.num_tokens >= self.options.min_tokens
        text, stop = c.matcher.feed(c.detok.push(u.new_token_ids), check)
        if stop is None and u.finished:
            tail, stop = self._final_text(c)
            text += tail
        if stop is not None:
            self.engine.abort_request(c.request_id)  # no-op when the engine already finished
            c.stop_reason = stop
            return self._finish(c, text, "stop")
        if u.finished:
            c.stop_reason = u.stop_reason
            return self._finish(c, text, u.finish_reason or "stop")
        return ChoiceDelta(c.index, text, logprobs=self._take_logprobs(c)) if text else None

    @staticmethod
    def _take_logprobs(c: ChoiceState) -> tuple[tuple[int, dict[int, float]], ...]:
        """Logprobs not yet sent: a delta carries those of every token since the last one
        (tokens whose text is held back wait for the delta that releases it)."""
        new = tuple(c.logprobs[c.num_logprobs_sent:])
        c.num_logprobs_sent = len(c.logprobs)
        return new

    def _final_text(self, c: ChoiceState) -> tuple[str, str | None]:
        """The generation ended: release held text (it can no longer grow into a stop)."""
        text, stop = c.matcher.feed(c.detok.flush(), c.num_tokens >= self.options.min_tokens)
        if stop is None:
            text += c.matcher.flush()
        return text, stop

    def _finish(self, c: ChoiceState, text: str, reason: str) -> ChoiceDelta:
        c.finish_reason = reason
        self._done(c)
        return ChoiceDelta(c.index, text, reason, self._take_logprobs(c))

    def _done(self, c: ChoiceState) -> None:
        if self.on_choice_done is not None:
            self.on_choice_done(self, c)
