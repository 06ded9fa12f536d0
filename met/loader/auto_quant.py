"""``quantization="auto"``: decide, once the weights are loaded, whether int4 pays.

int4 weight-only reproduces a Q4_0 / Q4_1 GGUF's own integers exactly (the loader keeps them
as ``q4_blocks`` on each weight; see met/layers/linear.py ``Int4Weight``), so for such a file
it computes with the same weights as the file. On the CPU it is the fastest path while a step
decodes at most ``GEMV_MAX_ROWS`` sequences (its GEMV kernels read a quarter of bfloat16's
bytes); with more rows both run the same bfloat16 matrix units and int4 only adds its integer
copy. And on the embedded 135M model bfloat16 activations over the 4-bit weights answer some
prompts worse than bfloat16 weights do (docs/benchmarks.md, quality). So auto picks int4 only
for a server that never decodes more than GEMV_MAX_ROWS sequences at once (``max_num_seqs``),
the single-user case it wins outright. Any other checkpoint would be re-quantized (lossy), so
auto leaves it alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from met.layers.linear import GEMV_MAX_ROWS, Linear


@dataclass(frozen=True)
class QuantizationChoice:
    """What auto chose (None = no quantization) and the reason, for the log and the API."""

    quantization: str | None
    reason: str


def choose_quantization(net: nn.Module, dtype: torch.dtype, device: torch.device,
                        max_num_seqs: int = 64) -> QuantizationChoice:
    """int4 when every linear layer of the loaded (not yet prepared) model holds Q4_0 / Q4_1
    integers from its GGUF, activations are bfloat16, the device is the CPU and at most
    GEMV_MAX_ROWS sequences decode at once; else none."""
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
    if max_num_seqs > GEMV_MAX_ROWS:
        return QuantizationChoice(None, f"none: up to {max_num_seqs} sequences decode at once "
                                        f"(max_num_seqs), where bfloat16 weights are as fast "
                                        f"and answer better; int4 is chosen for a Q4_0/Q4_1 "
                                        f"GGUF with max_num_seqs <= {GEMV_MAX_ROWS}")
    return QuantizationChoice("int4", f"int4: all {q4} linear weights are Q4_0/Q4_1 in the "
                                      f"GGUF and the dtype is bfloat16, so int4 keeps the "
                                      f"file's own integers exactly")
