"""Chained block hashes: a block's identity is its parent's hash, its tokens and extra keys."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BlockHash = bytes


def hash_block(
    parent: BlockHash | None, tokens: Sequence[int], extra_keys: tuple = ()
) -> BlockHash:
    """Hash one full block. extra_keys carry what else changes its KV: adapter id, cache salt.

    blake2b over a fixed encoding: cheap for 16 tokens and, unlike hash(), stable across
    processes and practically collision-free.
    """
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"\0" * 16)
    h.update(array("q", tokens).tobytes())
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()


def extend_block_hashes(
    hashes: list[BlockHash], tokens: Sequence[int], block_size: int, extra_keys: tuple = ()
) -> None:
    """Append the hashes of every full block of ``tokens`` not hashed yet (in place)."""
    for start in range(len(hashes) * block_size, len(tokens) - block_size + 1, block_size):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block(parent, tokens[start : start + block_size], extra_keys))
