"""The pool of KV blocks: reference counts, a free queue in LRU order, and the hash index.

A freed block keeps its hash, so a later request with the same prefix can take it back;
it is only forgotten when the free queue hands it out again (lazy LRU eviction).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from met.cache.prefix_hash import BlockHash


class BlockPool:
    """Owns block ids 0..num_blocks-1; never touches tensors."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.ref_count = [0] * num_blocks
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        # Free blocks, least recently freed first; values unused (OrderedDict as ordered set).
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._by_hash: dict[BlockHash, int] = {}
        # Told each hash the index forgets (a hybrid model's state snapshots go with it).
        self.on_evict: Callable[[BlockHash], None] | None = None

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Blocks that hold a reusable prefix (in use or free)."""
        return len(self._by_hash)

    def lookup(self, block_hash: BlockHash) -> int | None:
        return self._by_hash.get(block_hash)

    def allocate(self, n: int) -> list[int]:
        """Take n blocks from the front of the free queue, evicting their cached hashes."""
        if n > len(self._free):
            raise RuntimeError(f"KV pool exhausted: need {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            self._evict(block)
            self.ref_count[block] = 1
            out.append(block)
        return out

    def acquire(self, block: int) -> None:
        """Take a reference on a cached block (a prefix hit); pulls it off the free queue."""
        if self.ref_count[block] == 0:
            del self._free[block]
        self.ref_count[block] += 1

    def release(self, blocks: list[int]) -> None:
        """Drop one reference on each block; blocks reaching zero join the free queue's end.

        Callers pass a request's blocks tail first, so its prefix outlives its suffix.
        """
        for block in blocks:
            self.ref_count[block] -= 1
            if self.ref_count[block] == 0:
                self._free[block] = None

    def cache(self, block: int, block_hash: BlockHash) -> None:
        """Record that ``block`` holds the KV of the full block named ``block_hash``."""
        if self.block_hash[block] is not None or block_hash in self._by_hash:
            return  # already indexed, or an identical block is (keep the first)
        self.block_hash[block] = block_hash
        self._by_hash[block_hash] = block

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (blocks in use keep their contents)."""
        if self.on_evict is not None:
            for h in self._by_hash:
                self.on_evict(h)
        self._by_hash.clear()
        self.block_hash = [None] * self.num_blocks

    def drop_unreferenced_hashes(self) -> int:
        """Forget the hash of every block in the free queue (blocks in use keep theirs);
        how many were forgotten."""
        dropped = 0
        for block in self._free:
            if self.block_hash[block] is not None:
                self._evict(block)
                dropped += 1
        return dropped

    def _evict(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None:
            self.block_hash[block] = None
            if self._by_hash.get(h) == block:
                del self._by_hash[h]
                if self.on_evict is not None:
                    self.on_evict(h)
