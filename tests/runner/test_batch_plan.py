"""The batch policy the engine decides once (met.runner.batch_plan.BatchPolicy): how a step's
scheduled requests become batch rows."""

from __future__ import annotations

from met.runner.batch_plan import BatchPolicy, ScheduledRequest
from met.sampling.params import SamplingParams
from met.scheduler.request import Request


def _item(rid: str, prompt: int, generated: int, computed: int, n: int) -> ScheduledRequest:
    req = Request(rid, list(range(prompt)), SamplingParams(max_tokens=8), frozenset())
    req.all_token_ids.extend([1] * generated)
    req.num_computed_tokens = computed
    return ScheduledRequest(req, n)


def _step() -> list[ScheduledRequest]:
    return [_item("decode", 10, 2, 11, 1), _item("prefill", 30, 0, 16, 14),
            _item("recompute-output", 20, 4, 20, 4), _item("first-chunk", 40, 0, 0, 16)]


def test_by_default_rows_keep_the_schedulers_order_and_no_row_is_a_prompt_row():
    step = _step()
    policy = BatchPolicy()
    assert not policy.split_chunks_at_prompt_end and not policy.hash_generated_apart
    assert policy.order(step) == (step, 0)


def test_prompt_rows_first_puts_prompt_chunks_first_and_counts_their_rows():
    step = _step()
    policy = BatchPolicy(prompt_rows_first=True)
    assert policy.split_chunks_at_prompt_end and policy.hash_generated_apart
    items, prompt_rows = policy.order(step)
    assert [i.request.request_id for i in items] == [
        "prefill", "first-chunk", "decode", "recompute-output"]  # stable within each kind
    assert prompt_rows == 14 + 16
