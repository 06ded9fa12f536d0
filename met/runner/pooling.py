"""The hidden-state rows a step hands back for pooling requests (embeddings).

A pooling request's rows ride in the flat batch like any prefill chunk; it has no logits
row. The runner returns, per pooling request, the final-norm hidden states its pooling needs
from this step: every computed prompt row for mean pooling, the last prompt row (once the
chunk reaches the prompt's end) for last-token pooling; for a score request (kind "score"),
that last row's logits of the request's ``token_ids`` (through the model's own head, so
soft-capping and scaling apply as in generation).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from met.runner.batch_plan import ScheduledRequest


def pooling_rows(items: list[ScheduledRequest], hidden: torch.Tensor,
                 compute_logits: Callable[[torch.Tensor], torch.Tensor] | None = None
                 ) -> dict[str, tuple[int, torch.Tensor]]:
    """Request id → (position of the first row, float32 rows [n, hidden]) for each pooling
    request in the step's batch order ``items``; a score request's row is its chosen
    tokens' logits ([1, len(token_ids)], from ``compute_logits``)."""
    out: dict[str, tuple[int, torch.Tensor]] = {}
    q_start = 0
    for item in items:
        req, n = item.request, item.num_new_tokens
        pooling = req.params.pooling
        if pooling is not None:
            start = req.num_computed_tokens
            end = min(start + n, req.num_prompt_tokens)
            if pooling.pooling == "mean" and start < end:
                out[req.request_id] = (start, hidden[q_start:q_start + end - start].float())
            elif end == req.num_prompt_tokens and start < end:
                row = q_start + end - 1 - start
                vec = hidden[row:row + 1]
                if pooling.kind == "score":
                    if compute_logits is None:
                        raise RuntimeError("pooling: a score request needs the model's head")
                    vec = compute_logits(vec)[:, list(pooling.token_ids)]
                out[req.request_id] = (end - 1, vec.float())
        q_start += n
    return out
