"""The token-budget rule: decodes first, chunks on block boundaries, preemption newest first."""

from __future__ import annotations

from met.cache.kv_manager import KVCacheManager
from met.sampling.params import SamplingParams
from met.scheduler.request import Request, RequestStatus
from met.scheduler.scheduler import Scheduler

BS = 16


def _req(rid: str, n: int) -> Request:
    return Request(rid, list(range(n)), SamplingParams(max_tokens=8), frozenset())


def _advance(sched: Scheduler) -> dict[str, int]:
    """One step: schedule, then pretend the model ran (and sampled where caught up)."""
    out = sched.schedule()
    for item in out.scheduled:
        item.request.num_computed_tokens += item.num_new_tokens
        if item.request.num_computed_tokens == item.request.num_tokens:
            item.request.all_token_ids.append(1)
    return {s.request.request_id: s.num_new_tokens for s in out.scheduled}


def test_non_final_chunks_end_on_block_boundaries():
    kv = KVCacheManager(64, BS, enable_prefix_caching=False)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=40)
    sched.add(_req("a", 100))
    sizes = []
    while sched.running or sched.waiting:
        step = _advance(sched)
        sizes.append(step["a"])
        if sum(sizes) >= 100:
            break
    # 40-token budget: non-final chunks round down to 32 (2 blocks); the final 36 fit whole.
    assert sizes == [32, 32, 36]


def test_decodes_go_first_then_prefill_chunks_share_the_budget():
    kv = KVCacheManager(64, BS, enable_prefix_caching=False)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=36)
    sched.add(_req("a", 10))
    assert _advance(sched) == {"a": 10}
    sched.add(_req("b", 100))
    # a decodes 1 token; b gets the rest of the budget rounded down to a block: 32.
    assert _advance(sched) == {"a": 1, "b": 32}


def test_preemption_picks_newest_and_requeues_it_first():
    kv = KVCacheManager(4, BS, enable_prefix_caching=False)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=512)
    old, new = _req("old", 32), _req("new", 31)
    sched.add(old)
    sched.add(new)
    assert _advance(sched) == {"old": 32, "new": 31}  # 2 + 2 blocks: pool full
    # old's decode needs a 3rd block: the newest request (new) is preempted to make room.
    assert _advance(sched) == {"old": 1}
    assert new.status is RequestStatus.PREEMPTED and new.num_computed_tokens == 0
    assert sched.waiting[0] is new and sched.num_preemptions == 1
    assert kv.stats().num_blocks_in_use == 3


def test_no_admission_past_max_num_seqs():
    kv = KVCacheManager(64, BS, enable_prefix_caching=False)
    sched = Scheduler(kv, max_num_seqs=2, max_num_batched_tokens=512)
    for i in range(3):
        sched.add(_req(f"r{i}", 5))
    assert set(_advance(sched)) == {"r0", "r1"}
    sched.finish(sched.running[0], "stop")
    assert set(_advance(sched)) == {"r1", "r2"}


def test_split_at_prompt_end_recomputes_prompt_and_output_as_separate_chunks():
    """The engine's batch policy may ask that no chunk hold both prompt and generated
    tokens (`BatchPolicy.split_chunks_at_prompt_end`): a preempted request's recompute then
    runs its prompt, then its generated tokens; without it, one chunk holds both."""
    for split, recompute in ((True, [20, 4]), (False, [24])):
        kv = KVCacheManager(64, BS, enable_prefix_caching=False)
        sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=512,
                          split_at_prompt_end=split)
        req = _req("a", 20)
        sched.add(req)
        for _ in range(4):  # the prompt, then 3 decodes: 4 tokens generated
            _advance(sched)
        assert req.num_tokens == 24
        sched.running.remove(req)  # as schedule() pops its victim
        sched._preempt(req)
        assert [_advance(sched)["a"] for _ in recompute] == recompute, split
