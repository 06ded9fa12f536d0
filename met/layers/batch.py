"""The flat batch one engine step hands to the model."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SeqSpan:
    """One request's slice of the flat batch.

    Its query tokens are rows [q_start, q_start + q_len) of the batch; they sit at the
    end of a context of ctx_len tokens whose KV lives in the blocks of block_table.
    """

    q_start: int
    q_len: int
    ctx_len: int
    block_table: torch.Tensor  # long [num_blocks_for_ctx]


@dataclass(frozen=True)
class ForwardBatch:
    """All tokens of one step, from every scheduled request, as one flat tensor."""

    input_ids: torch.Tensor  # long [T]
    positions: torch.Tensor  # long [T]
    slot_mapping: torch.Tensor  # long [T]: flat KV slot (block * block_size + offset) per token
    seqs: tuple[SeqSpan, ...]
    block_size: int
