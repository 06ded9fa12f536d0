"""Grouped matrix multiply for routed experts: rows sorted by expert, one weight per group.

``grouped_mm(x, w, offsets)``: x [N, K] with the rows of group g in
``offsets[g-1]:offsets[g]``, w [G, out, K]; returns [N, out], row n times its group's
weight transposed. On the CPU torch's ``_grouped_mm`` runs every group in one call (it
multiplies each group as one dense matmul, so the result is bitwise the per-expert loop's);
elsewhere a padded batched matmul over the groups does it. Which one applies is decided
here from the tensors, never by the caller.
"""

from __future__ import annotations

import torch


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x [N, K] grouped by ``offsets`` (int32 [G], cumulative row ends) times w [G, out, K]ᵀ."""
    if x.device.type == "cpu" and hasattr(torch, "_grouped_mm"):
        return torch._grouped_mm(x, w.transpose(1, 2), offs=offsets)
    return padded_bmm(x, w, offsets)


def padded_bmm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """`grouped_mm` as one batched matmul over the groups that have rows, each padded to the
    largest group's row count (the portable path, and the benchmark's peer)."""
    ends = offsets.long()
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    active = torch.nonzero(counts).squeeze(1)
    n = x.shape[0]
    if n == 0:
        return x.new_empty(0, w.shape[1])
    group = torch.repeat_interleave(torch.arange(counts.numel(), device=x.device), counts)
    row_in_group = torch.arange(n, device=x.device) - (ends - counts)[group]
    slot = torch.full_like(counts, -1)
    slot[active] = torch.arange(active.numel(), device=x.device)
    m = int(counts.max())
    buf = x.new_zeros(active.numel(), m, x.shape[1])
    buf[slot[group], row_in_group] = x
    y = torch.bmm(buf, w[active].transpose(1, 2))
    return y[slot[group], row_in_group]
