"""Per-request block tables on top of the block pool, with prefix-cache lookups."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from met.cache.block_pool import BlockPool
from met.cache.prefix_hash import BlockHash, extend_block_hashes


@dataclass(frozen=True)
class KVStats:
    """KV accounting, in blocks: what a test or /metrics reads to prove nothing leaks."""

    num_blocks_total: int
    num_blocks_in_use: int  # referenced by live requests
    num_blocks_cached: int  # holding a reusable prefix (in use or free)
    num_blocks_free: int
    block_size: int


class KVCacheManager:
    """Maps request ids to their block lists; allocates lazily as tokens are scheduled.

    A request holds blocks for the tokens computed so far plus the ones scheduled this
    step — never a reservation for max_model_len.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool,
                 separate_generated: bool = False):
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # Blocks holding generated tokens hash apart from prompt blocks of the same tokens
        # (`extend_block_hashes`' prompt_len): set by the engine from its batch policy.
        self.separate_generated = separate_generated
        self._blocks: dict[str, list[int]] = {}
        self._hashes: dict[str, list[BlockHash]] = {}
        self._num_committed: dict[str, int] = {}

    def find_prefix(self, request_id: str, tokens: Sequence[int], extra_keys: tuple,
                    prompt_len: int | None = None) -> list[int]:
        """Cached blocks matching the start of ``tokens`` (not yet acquired); ``tokens``'
        first ``prompt_len`` are the request's prompt (None: all of them).

        The hit never covers the last token: that token must run to produce logits.
        """
        if not self.enable_prefix_caching:
            return []
        hashes = self._hashes.setdefault(request_id, [])
        extend_block_hashes(hashes, tokens, self.block_size, extra_keys,
                            self._prompt_len(tokens, prompt_len))
        max_blocks = (len(tokens) - 1) // self.block_size
        hit: list[int] = []
        for h in hashes[:max_blocks]:
            block = self.pool.lookup(h)
            if block is None:
                break
            hit.append(block)
        return hit

    def allocate(
        self, request_id: str, num_tokens: int, prefix_blocks: Sequence[int] = ()
    ) -> bool:
        """Make the request's table cover num_tokens tokens; False (nothing changed) if short."""
        blocks = self._blocks.get(request_id, [])
        have = len(blocks) + len(prefix_blocks)
        need_new = max(0, -(-num_tokens // self.block_size) - have)
        # Hit blocks sitting in the free queue leave it when taken, so they count as spent.
        revived = sum(1 for b in prefix_blocks if self.pool.ref_count[b] == 0)
        if need_new + revived > self.pool.num_free:
            return False
        for b in prefix_blocks:
            self.pool.acquire(b)
        blocks = self._blocks.setdefault(request_id, [])
        blocks.extend(prefix_blocks)
        blocks.extend(self.pool.allocate(need_new))
        self._num_committed.setdefault(request_id, len(prefix_blocks))
        return True

    def commit(
        self, request_id: str, tokens: Sequence[int], num_computed: int, extra_keys: tuple,
        prompt_len: int | None = None,
    ) -> None:
        """Index the request's newly completed full blocks so later requests can share them
        (``prompt_len`` as for `find_prefix`)."""
        if not self.enable_prefix_caching:
            return
        hashes = self._hashes.setdefault(request_id, [])
        extend_block_hashes(hashes, tokens[:num_computed], self.block_size, extra_keys,
                            self._prompt_len(tokens, prompt_len))
        blocks = self._blocks[request_id]
        done = self._num_committed.get(request_id, 0)
        full = num_computed // self.block_size
        for i in range(done, full):
            self.pool.cache(blocks[i], hashes[i])
        self._num_committed[request_id] = max(done, full)

    def _prompt_len(self, tokens: Sequence[int], prompt_len: int | None) -> int | None:
        if not self.separate_generated:
            return None
        return len(tokens) if prompt_len is None else prompt_len

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Release the request's blocks past those ``num_tokens`` tokens need (tail first):
        what speculative drafts that verification rejected had taken. They were never
        committed to the prefix cache (commits stop at the request's real tokens)."""
        blocks = self._blocks.get(request_id)
        keep = -(-num_tokens // self.block_size)
        if blocks and len(blocks) > keep:
            tail = blocks[keep:]
            del blocks[keep:]
            self.pool.release(tail[::-1])

    def block_hash(self, request_id: str, index: int) -> BlockHash | None:
        """The hash of the request's block ``index`` once committed (None before, or with
        prefix caching off)."""
        hashes = self._hashes.get(request_id, [])
        return hashes[index] if index < len(hashes) else None

    def block_table(self, request_id: str) -> list[int]:
        return self._blocks.get(request_id, [])

    def free(self, request_id: str) -> None:
        """Release every block of the request (tail first) and forget its hashes."""
        blocks = self._blocks.pop(request_id, [])
        self.pool.release(blocks[::-1])
        self._hashes.pop(request_id, None)
        self._num_committed.pop(request_id, None)

    def stats(self) -> KVStats:
        pool = self.pool
        return KVStats(
            num_blocks_total=pool.num_blocks,
            num_blocks_in_use=pool.num_blocks - pool.num_free,
            num_blocks_cached=pool.num_cached,
            num_blocks_free=pool.num_free,
            block_size=self.block_size,
        )
