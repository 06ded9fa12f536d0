"""The LoRA delta of a step's rows: y[rows of slot s] += (x A_sᵀ) B_sᵀ, per resident slot.

The reference path (PyTorch ops) runs one shrink and one expand matrix multiply per slot
present in the step, over that slot's rows gathered together (the SGMV shape: rows grouped
by adapter), so the number of calls grows with the adapters in the step, never the rows.
"""

from __future__ import annotations

import torch


def add_lora(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             groups: list[tuple[int, torch.Tensor | None]]) -> torch.Tensor:
    """y [M, N] plus each group's delta: ``groups`` are (slot, rows) with rows a long
    tensor of row indices (None: every row); a [S, R, K] and b [S, N, R] float32 (the
    adapter's scaling folded into b). The sums run in float32; y keeps its dtype."""
    out = y
    for slot, rows in groups:
        xs = x if rows is None else x.index_select(0, rows)
        delta = (xs.float() @ a[slot].T) @ b[slot].T
        if rows is None:
            out = out + delta.to(out.dtype)
        else:
            out = out.index_add(0, rows, delta.to(out.dtype))
    return out
