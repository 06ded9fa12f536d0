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


GENERATED = "generated"  # the extra key of a block that holds generated tokens


def extend_block_hashes(
    hashes: list[BlockHash], tokens: Sequence[int], block_size: int, extra_keys: tuple = (),
    prompt_len: int | None = None,
) -> None:
    """Append the hashes of every full block of ``tokens`` not hashed yet (in place).

    With ``prompt_len``, a block reaching past the prompt (it holds generated tokens) also
    gets the key `GENERATED`: where prompt and generated positions are computed differently,
    one must not be served from the other's KV.
    """
    for start in range(len(hashes) * block_size, len(tokens) - block_size + 1, block_size):
        parent = hashes[-1] if hashes else None
        keys = extra_keys
        if prompt_len is not None and start + block_size > prompt_len:
            keys = (*extra_keys, GENERATED)
        hashes.append(hash_block(parent, tokens[start : start + block_size], keys))
