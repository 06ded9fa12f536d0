"""``quantization="auto"``: decide, once the weights are loaded, whether quantization pays.

Only for a Q4_0 / Q4_1 GGUF: its weights are already 4-bit, so the user has chosen a lossy
model; any other checkpoint would be re-quantized, and auto leaves it alone. For such a file,
in bfloat16 on the CPU, with at most W4A8_MAX_SEQS sequences decoding at once:

- w4a8 where the CPU has AVX512-VNNI: the file's own 4-bit integers and scales times
  activations quantized to int8 in 32-value blocks (met/layers/w4a8.py), the arithmetic
  llama.cpp runs such a file with. Decode at those batch sizes is memory-bound and its
  kernel reads half a byte per weight with no float conversion of the weights: on the
  embedded model ~1.3x w8a8's and ~1.7x int4 weight-only's speed at 1 stream, logprobs
  ~0.10 nats from float32's on average (docs/benchmarks.md); outputs are bitwise
  batch-invariant. Above W4A8_MAX_SEQS rows bfloat16 weights on the matrix units are faster.
- else int4 weight-only with at most GEMV_MAX_ROWS sequences (the file's own integers, few-
  row GEMV kernel).
- else none.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from met.layers import w4a8
from met.layers.linear import GEMV_MAX_ROWS, Linear

# Sequences up to which w4a8 decodes faster than bfloat16 weights (measured: 16 streams
# 1.1x, docs/benchmarks.md).
W4A8_MAX_SEQS = 16


@dataclass(frozen=True)
class QuantizationChoice:
    """What auto chose (None = no quantization) and the reason, for the log and the API."""

    quantization: str | None
    reason: str


def choose_quantization(net: nn.Module, dtype: torch.dtype, device: torch.device,
                        max_num_seqs: int = 64) -> QuantizationChoice:
    """w4a8 (or int4 without AVX512-VNNI) when every linear layer of the loaded (not yet
    prepared) model holds Q4_0 / Q4_1 integers from its GGUF, activations are bfloat16, the
    device is the CPU and few sequences decode at once; else none."""
    linears = [m for name, m in net.named_modules()
               if isinstance(m, Linear) and name != "lm_head"]  # the head is int8 either way
    q4 = sum(getattr(m.weight, "q4_blocks", None) is not None for m in linears)
    if not linears or q4 < len(linears):
        return QuantizationChoice(None, f"none: not a Q4_0/Q4_1 GGUF ({q4} of {len(linears)} "
                                        f"linear weights are Q4_0/Q4_1)")
    if dtype != torch.bfloat16:
        name = str(dtype).removeprefix("torch.")
        return QuantizationChoice(None, f"none: the quantized kernels take bfloat16 "
                                        f"activations and the dtype is {name}")
    if device.type != "cpu":
        return QuantizationChoice(None, "none: the quantized kernels run on the CPU only")
    vnni = w4a8.available()
    limit = W4A8_MAX_SEQS if vnni else GEMV_MAX_ROWS
    if max_num_seqs > limit:
        return QuantizationChoice(None, f"none: up to {max_num_seqs} sequences decode at once "
                                        f"(max_num_seqs), where bfloat16 weights are as fast "
                                        f"and answer closer to float32; auto quantizes a "
                                        f"Q4_0/Q4_1 GGUF with max_num_seqs <= {limit}")
    if vnni:
        return QuantizationChoice("w4a8", f"w4a8: all {q4} linear weights are Q4_0/Q4_1 in "
                                          f"the GGUF, the dtype is bfloat16, at most "
                                          f"{max_num_seqs} sequences decode at once and the "
                                          f"CPU has AVX512-VNNI: the file's 4-bit integers "
                                          f"times int8 activations")
    return QuantizationChoice("int4", f"int4: all {q4} linear weights are Q4_0/Q4_1 in the "
                                      f"GGUF and the dtype is bfloat16, so int4 keeps the "
                                      f"file's own integers exactly (no AVX512-VNNI for w4a8)")
