"""Pooling (embedding) requests in the engine: their hidden rows are gathered as prefill
chunks run, and once the prompt is done the pooled vector finishes the request. A score
request (kind "score") gathers its last position's logits of the chosen tokens instead, and
finishes with their softmax.

Rows of positions already gathered (a chunk recomputed after a preemption) are skipped, as
prompt logprobs skip theirs, so a mean never counts a position twice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from met.sampling.pooling import PoolingParams


@dataclass
class PoolState:
    """What a pooling request has gathered so far: the sum of its rows (mean) or its last
    row (last), and how many prompt positions that covers."""

    params: PoolingParams
    total: torch.Tensor | None = None
    count: int = 0

    def add(self, start: int, rows: torch.Tensor) -> None:
        """Rows of positions start.. (float32 [n, hidden])."""
        if self.params.pooling == "last":
            self.total, self.count = rows[-1].clone(), start + len(rows)
            return
        skip = self.count - start
        if skip < 0:
            raise RuntimeError(f"pooling: rows from position {start} after {self.count} "
                               "positions (a prompt position was never pooled)")
        rows = rows[skip:]
        if len(rows):
            part = rows.sum(dim=0)
            self.total = part if self.total is None else self.total + part
            self.count += len(rows)

    def vector(self) -> list[float]:
        """The pooled vector: mean or last row, truncated to ``dimensions``, normalized."""
        if self.total is None:
            raise RuntimeError("pooling: the request finished before any row was pooled")
        p = self.params
        if p.kind == "score":
            return torch.softmax(self.total.double(), dim=0).tolist()
        v = self.total / self.count if p.pooling == "mean" else self.total
        if p.dimensions is not None:
            v = v[:p.dimensions]
        if p.normalize:
            v = torch.nn.functional.normalize(v, dim=0)
        return v.tolist()


def check_pooling(params: PoolingParams, num_prompt_tokens: int, hidden_size: int,
                  max_model_len: int) -> None:
    """ValueErrors naming the field for a pooling request that can never be served."""
    if params.dimensions is not None and params.dimensions > hidden_size:
        raise ValueError(f"dimensions: must be at most the model's hidden size ({hidden_size}), "
                         f"got {params.dimensions}")
    if num_prompt_tokens > max_model_len:
        raise ValueError(f"input: {num_prompt_tokens} tokens exceed max_model_len "
                         f"({max_model_len})")
