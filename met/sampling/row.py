"""What the sampler reads of one row's request: its parameters, its tokens so far and its
per-request state. `met.scheduler.request.Request` is one; the sampler never imports it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from met.sampling.grammar import GrammarState
    from met.sampling.params import SamplingParams
    from met.sampling.thinking import ThinkingState


class SamplingRow(Protocol):
    @property
    def params(self) -> SamplingParams: ...
    @property
    def eos_token_ids(self) -> frozenset[int]: ...  # masked until min_tokens
    @property
    def all_token_ids(self) -> Sequence[int]: ...  # prompt + output (repetition, LZ, DRY)
    @property
    def output_token_ids(self) -> Sequence[int]: ...
    @property
    def num_output_tokens(self) -> int: ...
    @property
    def generator(self) -> torch.Generator | None: ...  # a seeded request's own stream
    @property
    def dry_breaker_ids(self) -> frozenset[int]: ...
    @property
    def grammar(self) -> GrammarState | None: ...
    @property
    def thinking(self) -> ThinkingState | None: ...

    def grammar_applies(self) -> bool:
        """Whether the grammar masks this row now (a grammar, and not inside thinking)."""
        ...
