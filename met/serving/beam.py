"""Beam search behind the HTTP API: a ``Generation`` whose choices are the best beams.

Each step posts one-token engine requests for every live beam of every prompt (the prefix
cache serves the shared history) and feeds their top-K logprobs to the prompt's
``BeamSearchState``; when all searches are done, choice j of a prompt is its j-th best beam.
Beams cannot stream (the best beam is known only at the end), so the whole text comes in one
delta per choice.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from met.engine.async_engine import RequestFailed
from met.engine.core import RequestUpdate
from met.sampling.beam_search import (
    Beam,
    BeamSearchState,
    beam_state,
    live_beam_requests,
    top_pairs,
)
from met.serving.generate import ChoiceDelta, Generation, GenerationFailed


class BeamGeneration(Generation):
    """``n`` best beams for each prompt (``params[p].num_beams`` > 1, n <= num_beams)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._pending: set[str] = set()

    async def __aenter__(self) -> BeamGeneration:
        return self  # engine requests are posted step by step in deltas()

    async def __aexit__(self, *exc: object) -> None:
        for rid in list(self._pending):
            self.engine.abort_request(rid)
        self._pending.clear()
        for c in self.choices:
            if not c.finished:
                c.finish_reason = "error" if self._failed else "abort"
                self._done(c)

    async def deltas(self) -> AsyncIterator[ChoiceDelta]:
        core = self.engine.core
        assert core is not None
        eos = core.loaded.eos_token_ids
        searches = [beam_state(p, eos, self.n) for p in self.params]
        deadline = None if self.timeout_s is None else self.arrival + self.timeout_s
        while not all(s.done for s in searches):
            tops = await self._step(searches, deadline)
            if tops is None:  # timed out: the best beams so far
                break
            for s, pairs in zip(searches, tops, strict=True):
                if pairs:
                    s.step(pairs)
        for p, search in enumerate(searches):
            for j, beam in enumerate(search.results()):
                yield self._finish_beam(self.choices[p * self.n + j], beam, search)

    async def _step(self, searches: list[BeamSearchState], deadline: float | None
                    ) -> list[list[list[tuple[int, float]]]] | None:
        """One token for every live beam: per search, each beam's top-K (token, logprob)."""
        slots: dict[str, tuple[int, int]] = {}
        for i, b, ids, params in live_beam_requests(searches,
                                                    [p.token_ids for p in self.prompts]):
            rid = f"{uuid.uuid4().hex}-beam"
            slots[rid] = (i, b)
            self._pending.add(rid)
            self.engine.add_request(rid, ids, params, self._stream)
        tops: list[list[list[tuple[int, float]]]] = [
            [[] for _ in s.running] if not s.done else [] for s in searches]
        while self._pending:
            remaining = None if deadline is None else deadline - time.monotonic()
            try:
                item = await self._stream.get(remaining)
            except TimeoutError:
                return None
            if isinstance(item, RequestFailed):
                self._failed = True
                raise GenerationFailed(item.message, item.is_client_error)
            assert isinstance(item, RequestUpdate)
            if item.request_id not in self._pending or not item.finished:
                continue
            self._pending.discard(item.request_id)
            i, b = slots[item.request_id]
            tops[i][b] = top_pairs(item.new_logprobs[0], searches[i].candidates_per_beam)
        return tops

    def _finish_beam(self, c, beam: Beam, search: BeamSearchState) -> ChoiceDelta:
        tokens = list(beam.tokens)
        c.num_tokens = len(tokens)
        ended = bool(tokens) and tokens[-1] in search.eos_token_ids
        text, stop = c.matcher.feed(c.detok.push(tokens) + c.detok.flush(), True)
        if stop is None:
            text += c.matcher.flush()
        if stop is not None:
            c.stop_reason = stop
        elif ended and tokens[-1] in self.params[c.prompt_index].stop_token_ids:
            c.stop_reason = tokens[-1]
        reason = "stop" if stop is not None or ended else "length"
        return self._finish(c, text, reason)
