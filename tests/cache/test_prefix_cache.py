"""Block pool and prefix cache: sharing, LRU eviction, salts, the last-token rule."""

from __future__ import annotations

from met.cache.kv_manager import KVCacheManager
from met.cache.prefix_hash import hash_block

BS = 4


def _run_request(kv: KVCacheManager, rid: str, tokens: list[int], salt: tuple = ()) -> int:
    """Admit, 'compute' all tokens, commit and free; returns how many tokens hit the cache."""
    hit = kv.find_prefix(rid, tokens, salt)
    assert kv.allocate(rid, len(tokens), hit)
    kv.commit(rid, tokens, len(tokens), salt)
    kv.free(rid)
    return len(hit) * BS


def test_hit_covers_full_blocks_but_never_the_last_token():
    kv = KVCacheManager(num_blocks=16, block_size=BS, enable_prefix_caching=True)
    tokens = list(range(12))  # exactly 3 blocks
    assert _run_request(kv, "a", tokens) == 0
    # Same 12 tokens: only 2 blocks may hit, so the last token is recomputed for logits.
    assert _run_request(kv, "b", tokens) == 8
    # A longer prompt sharing the prefix hits all 3 blocks.
    assert _run_request(kv, "c", tokens + [99, 98]) == 12
    assert kv.stats().num_blocks_in_use == 0


def test_hash_chains_parent_so_equal_blocks_at_different_offsets_differ():
    a = hash_block(None, [1, 2, 3, 4])
    b = hash_block(hash_block(None, [9, 9, 9, 9]), [1, 2, 3, 4])
    assert a != b
    assert hash_block(None, [1, 2, 3, 4], ("salt",)) != a


def test_cache_salt_isolates_requests():
    kv = KVCacheManager(num_blocks=16, block_size=BS, enable_prefix_caching=True)
    tokens = list(range(10))
    _run_request(kv, "a", tokens, ("tenant-1",))
    assert _run_request(kv, "b", tokens, ("tenant-2",)) == 0
    assert _run_request(kv, "c", tokens, ("tenant-1",)) == 8


def test_lru_evicts_least_recently_freed_prefix_first():
    kv = KVCacheManager(num_blocks=4, block_size=BS, enable_prefix_caching=True)
    old = [1] * 8 + [0]
    new = [2] * 8 + [0]
    _run_request(kv, "old", old)  # 3 blocks, freed first
    _run_request(kv, "new", new)  # takes the last free block, then 2 of old's
    # Old's blocks were freed earlier, so they were handed out first; new's survive.
    assert _run_request(kv, "probe-new", new) == 8
    assert _run_request(kv, "probe-old", old) == 0


def test_shared_blocks_are_refcounted_not_copied():
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=True)
    prefix = list(range(8))
    _run_request(kv, "seed", prefix + [50])
    hit_a = kv.find_prefix("a", prefix + [60], ())
    hit_b = kv.find_prefix("b", prefix + [70], ())
    assert hit_a == hit_b and len(hit_a) == 2
    assert kv.allocate("a", 9, hit_a) and kv.allocate("b", 9, hit_b)
    assert kv.block_table("a")[:2] == kv.block_table("b")[:2]
    assert kv.stats().num_blocks_in_use == 4  # 2 shared + 1 tail each
    kv.free("a")
    kv.free("b")
    assert kv.stats().num_blocks_in_use == 0


def test_allocation_fails_cleanly_when_pool_is_short():
    kv = KVCacheManager(num_blocks=2, block_size=BS, enable_prefix_caching=False)
    assert kv.allocate("a", 8)
    assert not kv.allocate("b", 1)
    assert kv.block_table("b") == []
    kv.free("a")
    assert kv.allocate("b", 1)
