"""The LoRA delta of a step's rows: y[row] += (x[row] A_sᵀ) B_s with s the row's slot.

Two backends, chosen once per engine in the registry (`registry.LORA_BACKENDS`):

- ``cpu-native`` (csrc/lora.cpp): every row alone with its own slot (the BGMV shape), float32
  sums in one fixed order, so a row's delta does not depend on its batch mates;
- ``torch`` (the reference): one shrink and one expand matrix multiply per slot present in
  the step, over that slot's rows gathered together (the SGMV shape).

Both take the slots' matrices as a [S, R, K] and bt [S, R, N] (float32, or bfloat16 for a
bfloat16 model), the adapter's scaling folded into bt; both sum in float32.
"""

from __future__ import annotations

import torch

from met.kernels.native import native_op


def add_lora(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor,
             groups: list[tuple[int, torch.Tensor | None]]) -> torch.Tensor:
    """y [M, N] plus each group's delta: ``groups`` are (slot, rows) with rows a long
    tensor of row indices (None: every row). The sums run in float32; y keeps its dtype."""
    out = y
    for slot, rows in groups:
        xs = x if rows is None else x.index_select(0, rows)
        delta = (xs.float() @ a[slot].float().T) @ bt[slot].float()
        if rows is None:
            out = out + delta.to(out.dtype)
        else:
            out = out.index_add(0, rows, delta.to(out.dtype))
    return out


def add_lora_native(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor,
                    row_slots: torch.Tensor) -> torch.Tensor:
    """The same with csrc/lora.cpp, in place on y (contiguous [M, N], float32 or
    bfloat16; x of y's dtype); row_slots int32 [M], -1 for rows without an adapter."""
    if x.dtype != y.dtype:
        x = x.to(y.dtype)
    native_op("lora", "lora_add_")(y, x.contiguous(), a, bt, row_slots)
    return y
