"""``quantization="auto"``: decide, once the weights are loaded, whether int4 pays.

int4 weight-only reproduces a Q4_0 / Q4_1 GGUF's own integers exactly (the loader keeps them
as ``q4_blocks`` on each weight; see met/layers/linear.py ``Int4Weight``), so for such a file
it computes with the same weights as the file, and on the CPU it is the fastest path at low
concurrency. Any other checkpoint would be re-quantized (lossy), so auto leaves it alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from met.layers.linear import Linear


@dataclass(frozen=True)
class QuantizationChoice:
    """What auto chose (None = no quantization) and the reason, for the log and the API."""

    quantization: str | None
    reason: str


def choose_quantization(net: nn.Module, dtype: torch.dtype,
                        device: torch.device) -> QuantizationChoice:
    """int4 when every linear layer of the loaded (not yet prepared) model holds Q4_0 / Q4_1
    integers from its GGUF, activations are bfloat16 and the device is the CPU; else none."""
    linears = [m for name, m in net.named_modules()
               if isinstance(m, Linear) and name != "lm_head"]  # the head is int8 either way
    q4 = sum(getattr(m.weight, "q4_blocks", None) is not None for m in linears)
    if not linears or q4 < len(linears):
        return QuantizationChoice(None, f"none: not a Q4_0/Q4_1 GGUF ({q4} of {len(linears)} "
                                        f"linear weights are Q4_0/Q4_1)")
    if dtype != torch.bfloat16:
        name = str(dtype).removeprefix("torch.")
        return QuantizationChoice(None, f"none: the int4 kernels take bfloat16 activations and "
                                        f"the dtype is {name}")
    if device.type != "cpu":
        return QuantizationChoice(None, "none: the int4 kernels run on the CPU only")
    return QuantizationChoice("int4", f"int4: all {q4} linear weights are Q4_0/Q4_1 in the "
                                      f"GGUF and the dtype is bfloat16, so int4 keeps the "
                                      f"file's own integers exactly")
