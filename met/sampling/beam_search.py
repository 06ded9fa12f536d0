"""Beam search, step by step, with transformers' rules (so its output equals
``generate(num_beams=…)`` on the same model).

Each step, every live beam's next-token log-probabilities (the raw model distribution) come
in as its top-K (token, logprob) pairs, with K = max(2, 1 + #EOS) · num_beams: the best K
continuations over all beams are always among the per-beam top-K. Of those K, a candidate
that ends in EOS (or reaches max_tokens) and ranks in the first num_beams becomes a finished
hypothesis with score ``sum_logprobs / generated_len ** length_penalty``; the best num_beams
unfinished candidates are the next beams. The search ends per ``early_stopping``: True → as
soon as num_beams hypotheses are finished; False → when the best running beam, at its current
length, cannot beat the worst finished one; "never" → the same bound taken at the longest
possible length when length_penalty > 0.

The engine side (``LLM.generate``, the HTTP routes) turns each step into one-token requests
for the live beams; the prefix cache serves the prompt and the beams' shared history, so a
step recomputes at most a block's worth of tokens per beam.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from met.sampling.params import SamplingParams

_BLOCKED = -1.0e9  # transformers' "not a candidate" score


@dataclass(frozen=True)
class Beam:
    tokens: tuple[int, ...]
    score: float  # sum of the tokens' logprobs (running); length-penalised (finished)


@dataclass
class BeamSearchState:
    """One prompt's beam search. Feed ``step`` the top-K logprobs of each live beam until
    ``done``; then ``results()`` are the best hypotheses, best first."""

    num_beams: int
    max_tokens: int
    eos_token_ids: frozenset[int]
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    num_results: int = 1
    running: list[Beam] = field(init=False)
    finished: list[Beam] = field(init=False, default_factory=list)
    num_generated: int = 0
    done: bool = False
    _may_improve: bool = True

    def __post_init__(self) -> None:
        if self.num_beams < 1:
            raise ValueError(f"num_beams: must be >= 1, got {self.num_beams}")
        if not 1 <= self.num_results <= self.num_beams:
            raise ValueError(f"n: must be in [1, num_beams={self.num_beams}] with beam search, "
                             f"got {self.num_results}")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping: must be true, false or \"never\", got "
                             f"{self.early_stopping!r}")
        # Beam 0 is the prompt; the others start blocked so step 1 expands beam 0 only.
        self.running = [Beam((), 0.0)]

    @property
    def candidates_per_beam(self) -> int:
        return max(2, 1 + len(self.eos_token_ids)) * self.num_beams

    def step(self, top_logprobs: list[list[tuple[int, float]]]) -> None:
        """Advance one token. ``top_logprobs[b]``: beam b's best (token, logprob) pairs (at
        least ``candidates_per_beam`` of them, or the whole vocabulary)."""
        if self.done:
            raise RuntimeError("beam search already finished")
        if len(top_logprobs) != len(self.running):
            raise ValueError(f"expected logprobs for {len(self.running)} beams, got "
                             f"{len(top_logprobs)}")
        k = self.candidates_per_beam
        cands = sorted(
            ((beam.score + lp, beam.tokens + (tok,)) for beam, pairs in
             zip(self.running, top_logprobs, strict=True) for tok, lp in pairs),
            key=lambda c: c[0], reverse=True)[:k]
        at_limit = self.num_generated + 1 >= self.max_tokens
        hits = [at_limit or c[1][-1] in self.eos_token_ids for c in cands]

        # Finished hypotheses: only from the first num_beams candidates, and only while the
        # search may still improve (transformers blocks them otherwise).
        full = len(self.finished) == self.num_beams
        if self._may_improve and not (full and self.early_stopping is True):
            length = (self.num_generated + 1) ** self.length_penalty
            new = [Beam(tokens, score / length) for (score, tokens), hit, rank in
                   zip(cands, hits, range(len(cands)), strict=True)
                   if hit and rank < self.num_beams]
            merged = self.finished + new
            merged.sort(key=lambda b: b.score, reverse=True)  # stable: older wins ties
            self.finished = merged[: self.num_beams]

        live = [Beam(tokens, score) for (score, tokens), hit in zip(cands, hits, strict=True)
                if not hit]
        self.running = live[: self.num_beams]
        self.num_generated += 1

        self._may_improve = self._may_improve and self._can_improve()
        all_finished = len(self.finished) == self.num_beams
        self.done = (not self._may_improve or (all_finished and self.early_stopping is True)
                     or not self.running or at_limit)

    def _can_improve(self) -> bool:
        if len(self.finished) < self.num_beams:
            return True
        if not self.running:
            return False
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_len = self.max_tokens
        else:
            best_len = self.num_generated
        best_possible = self.running[0].score / (best_len ** self.length_penalty)
        return best_possible > min(b.score for b in self.finished)

    def results(self) -> list[Beam]:
        """The best ``num_results`` hypotheses (finished first; running beams fill in when
        the search stopped before enough finished)."""
        pool = list(self.finished)
        if len(pool) < self.num_results:
            length = max(self.num_generated, 1) ** self.length_penalty
            pool += [Beam(b.tokens, b.score / length) for b in self.running]
            pool.sort(key=lambda b: b.score, reverse=True)
        return pool[: self.num_results]


def top_pairs(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    """The k most likely (token, logprob) pairs of an engine logprobs entry."""
    return sorted(entry.items(), key=lambda kv: kv[1], reverse=True)[:k]


def beam_state(params: SamplingParams, eos_token_ids: frozenset[int],
               num_results: int = 1) -> BeamSearchState:
    """A search for ``params`` (num_beams, length_penalty, early_stopping, max_tokens; with
    ignore_eos, EOS does not finish a hypothesis; stop_token_ids finish one like EOS)."""
    stops = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos
                                                else eos_token_ids)
    return BeamSearchState(params.num_beams, params.max_tokens, stops, params.length_penalty,
                           params.early_stopping, num_results)


def step_params(state: BeamSearchState) -> SamplingParams:
    """What each live beam's one-token engine request asks for: the top-K raw logprobs."""
    return SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True,
                          logprobs=state.candidates_per_beam)


def live_beam_requests(searches: Sequence[BeamSearchState],
                       prompts: Sequence[list[int]]
                       ) -> Iterator[tuple[int, int, list[int], SamplingParams]]:
    """One step's engine requests: (search index, beam index, prompt + the beam's tokens,
    params) for every live beam of every search still running."""
    for i, (state, prompt) in enumerate(zip(searches, prompts, strict=True)):
        if state.done:
            continue
        params = step_params(state)
        for b, beam in enumerate(state.running):
            yield i, b, prompt + list(beam.tokens), params
