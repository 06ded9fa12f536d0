"""The engine's speculation: which requests draft this step, with which proposer, and the
counters /metrics and `met bench` report (drafted, accepted, per method)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from met.config import SpeculativeConfig
from met.spec.gate import ThroughputGate
from met.spec.ngram import NgramProposer
from met.spec.suffix import SuffixProposer


class Proposer(Protocol):
    name: str

    def propose(self, request_id: str, tokens: Sequence[int], k: int) -> list[int]: ...
    def finished(self, request_id: str, tokens: Sequence[int]) -> None: ...


@dataclass(frozen=True)
class SpecStats:
    """Totals since start, for one method."""

    method: str
    drafted: int = 0  # draft tokens verified
    accepted: int = 0  # of them, accepted
    verifies: int = 0  # (request, step) pairs that verified at least one draft

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verifying request gained per step: accepted drafts + the target's own."""
        return 1 + self.accepted / self.verifies if self.verifies else 0.0


def make_proposer(config: SpeculativeConfig) -> Proposer:
    """The proposer of a method that needs no model (the engine builds model drafters)."""
    if config.method in ("draft_model", "self"):
        raise ValueError(f"speculative_config.method: {config.method} drafts with a model; "
                         "the engine builds its proposer")
    if config.method == "suffix":
        return SuffixProposer(config.prompt_lookup_min, config.prompt_lookup_max,
                              config.suffix_cache_requests)
    return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)


class SpecDecoder:
    """Drafts for the requests that speculate this step; counts what verification kept."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer | None = None):
        self.config = config
        self.proposer = proposer or make_proposer(config)
        self.gate = ThroughputGate(config.gate)
        self._drafted = self._accepted = self._verifies = 0

    def stats(self) -> SpecStats:
        return SpecStats(self.proposer.name, self._drafted, self._accepted, self._verifies)

    def record(self, drafted: int, accepted: int) -> None:
        if drafted:
            self._drafted += drafted
            self._accepted += accepted
            self._verifies += 1

    def propose(self, items: Sequence[tuple[str, Sequence[int], int]]) -> dict[str, list[int]]:
        """Drafts per (request id, its tokens, room): up to num_speculative_tokens, no more
        than ``room`` (tokens the request may still emit, less the one the target adds
        itself). A proposer with ``propose_batch`` drafts for all of them at once."""
        asks = [(rid, tokens, min(self.config.num_speculative_tokens, room))
                for rid, tokens, room in items]
        asks = [a for a in asks if a[2] >= 1]
        batch = getattr(self.proposer, "propose_batch", None)
        if batch is not None:
            drafts = batch(asks) if asks else {}
        else:
            drafts = {rid: self.proposer.propose(rid, tokens, k) for rid, tokens, k in asks}
        return {rid: d[:k] for rid, _, k in asks if (d := drafts.get(rid))}

    def finished(self, request_id: str, tokens: Sequence[int]) -> None:
        self.proposer.finished(request_id, tokens)
