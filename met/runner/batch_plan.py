"""What the runner takes each step, as plain data: the scheduler's output (`SchedulerOutput`)
and the batch policy the engine decides once (`BatchPolicy`). The scheduler fills the one and
never reads the other; it imports this module, never the runner's."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from met.sampling.params import SamplingParams


class StepRequest(Protocol):
    """What the runner reads of a scheduled request (`met.scheduler.request.Request` is one)."""

    @property
    def request_id(self) -> str: ...
    @property
    def params(self) -> SamplingParams: ...  # prompt_logprobs: every prompt row's logits
    @property
    def all_token_ids(self) -> Sequence[int]: ...
    num_computed_tokens: int  # the engine advances it after the step
    @property
    def num_tokens(self) -> int: ...
    @property
    def num_prompt_tokens(self) -> int: ...


@dataclass(frozen=True)
class ScheduledRequest:
    request: StepRequest
    num_new_tokens: int  # tokens to compute this step, starting at num_computed_tokens
    # Draft tokens verified this step after the request's last token (counted in
    # num_new_tokens): the step computes its tokens [num_computed_tokens:] + these.
    spec_token_ids: tuple[int, ...] = ()
    # Hybrid models (met.cache.state_slots): the request's state slot; the snapshot row that
    # restores it before this step (a prefix hit at admission), or -1; and (tokens into this
    # step's chunk, snapshot row) at each block boundary whose state this step saves.
    state_slot: int = -1
    state_restore: int = -1
    state_saves: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    preempted: Sequence[StepRequest]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


@dataclass(frozen=True)
class BatchPolicy:
    """How a step's rows are grouped for the machine's kernels: decided once by the engine
    from the prepared model (`CausalLM.prompt_rows_first`) and passed down.

    With ``prompt_rows_first`` prompt positions and generated positions run through
    different kernels (w4a8 with AMX-BF16), so a position's kernel must follow from the
    position alone: the runner puts prompt chunks first (`ForwardBatch.prompt_rows`), no
    chunk holds both kinds (`split_chunks_at_prompt_end`, for the scheduler) and the prefix
    cache never serves one kind from the other's KV (`hash_generated_apart`, for the cache).
    """

    prompt_rows_first: bool = False

    @property
    def split_chunks_at_prompt_end(self) -> bool:
        return self.prompt_rows_first

    @property
    def hash_generated_apart(self) -> bool:
        return self.prompt_rows_first

    def order(self, scheduled: list[ScheduledRequest]) -> tuple[list[ScheduledRequest], int]:
        """The step's requests in batch order, and how many rows of prompt chunks lead it:
        as scheduled (0), or with ``prompt_rows_first`` prompt chunks first (no chunk mixes
        prompt and generated tokens under this policy)."""
        if not self.prompt_rows_first:
            return scheduled, 0
        prompt: list[ScheduledRequest] = []
        generated: list[ScheduledRequest] = []
        for item in scheduled:
            req = item.request
            (prompt if req.num_computed_tokens < req.num_prompt_tokens else generated).append(item)
        return prompt + generated, sum(item.num_new_tokens for item in prompt)
