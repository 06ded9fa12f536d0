"""State slots and prefix snapshots (met.cache.state_slots): bookkeeping a user relies on
for correct hybrid-model prefix hits and for nothing leaking."""

from __future__ import annotations

import pytest

from met.cache.block_pool import BlockPool
from met.cache.state_slots import StateSlots


def test_slots_are_taken_and_given_back():
    s = StateSlots(num_slots=2, num_snapshots=2)
    a, b = s.acquire("a"), s.acquire("b")
    assert {a, b} == {0, 1} and s.acquire("a") == a
    assert s.num_free_slots == 0
    with pytest.raises(RuntimeError, match="state slots exhausted"):
        s.acquire("c")
    s.free("a")
    s.free("never-admitted")  # a waiting request finishing holds none
    assert s.stats().num_slots_in_use == 1 and s.acquire("c") == a


def test_snapshot_is_usable_only_after_its_step():
    s = StateSlots(num_slots=1, num_snapshots=2)
    row = s.reserve(b"h1")
    assert row is not None and row >= 1  # snapshot rows follow the slots
    assert s.restore_row(b"h1") is None  # being written this step: not readable yet
    assert s.reserve(b"h1") is None  # and not reserved twice
    s.commit()
    assert s.restore_row(b"h1") == row and s.reserve(b"h1") is None


def test_failed_step_discards_its_snapshots():
    s = StateSlots(num_slots=1, num_snapshots=1)
    s.reserve(b"h1")
    s.discard_pending()
    s.commit()
    assert s.restore_row(b"h1") is None and s.reserve(b"h2") is not None


def test_snapshots_are_bounded_lru():
    s = StateSlots(num_slots=1, num_snapshots=2)
    for h in (b"h1", b"h2"):
        s.reserve(h)
    s.commit()
    s.restore_row(b"h1")  # h1 becomes the most recently used: h2 goes first
    s.reserve(b"h3")
    s.commit()
    assert s.restore_row(b"h2") is None
    assert s.restore_row(b"h1") is not None and s.restore_row(b"h3") is not None
    assert s.stats().num_snapshots == 2


def test_snapshot_goes_with_its_evicted_block():
    pool = BlockPool(2)
    s = StateSlots(num_slots=1, num_snapshots=2)
    pool.on_evict = s.forget
    (block,) = pool.allocate(1)
    pool.cache(block, b"h1")
    s.reserve(b"h1")
    s.commit()
    pool.release([block])
    pool.allocate(2)  # hands the cached block out again: its hash is evicted
    assert s.restore_row(b"h1") is None and s.stats().num_snapshots == 0


def test_reset_prefix_cache_drops_every_snapshot():
    pool = BlockPool(2)
    s = StateSlots(num_slots=1, num_snapshots=2)
    pool.on_evict = s.forget
    for block, h in zip(pool.allocate(2), (b"h1", b"h2"), strict=True):
        pool.cache(block, h)
        s.reserve(h)
    s.commit()
    pool.reset_prefix_cache()
    assert s.stats().num_snapshots == 0
