"""``quantization="auto"``: decide, once the weights are loaded, whether quantization pays.

Only for a Q4_0 / Q4_1 GGUF: its weights are already 4-bit, so the user has chosen a lossy
model; any other checkpoint would be re-quantized, and auto leaves it alone. For such a file,
in bfloat16 on the CPU:

- w4a8 where the CPU has AVX512-VNNI, for any number of sequences: the file's own 4-bit
  integers and scales times activations quantized to int8 in 32-value blocks, an 8-bit head
  in blocks (met/layers/w4a8.py), the arithmetic llama.cpp runs such a file with. Measured
  on the embedded model, same run against both peers (docs/benchmarks.md): 2.1x llama.cpp
  at 1 stream and ahead of llama.cpp and vLLM at every concurrency up to 64; with AMX-BF16
  its prompt rows run on bfloat16 tiles (prefill ~2.4x faster than int8 activations at
  many rows); logprobs ~0.04 nats from float32's on average; outputs bitwise
  batch-invariant. bfloat16 weights (``--quantization none``) are ~2.3x slower at 1 stream,
  slower up to 32 streams and about even at 64 (decode at many rows on the matrix units,
  where w4a8's per-block scaling costs more).
- else int4 weight-only with at most GEMV_MAX_ROWS sequences (the file's own integers, few-
  row GEMV kernel).
- else none.

In float32 (what ``--dtype auto`` picks on a CPU without native bfloat16, e.g. AMD Zen 2/3):
w4a8 where a kernel runs (AVX2 is enough: csrc/w4a8_avx2.cpp), quantizing the float32 rows
directly, the same arithmetic as llama.cpp on such a CPU; the rest of the model stays
float32. Only when the dtype came from auto: ``--dtype float32`` asked for by name is the
exact reference and keeps its float32 weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from met.kernels import gguf_blocks, w4a8
from met.layers.linear import GEMV_MAX_ROWS, Linear


@dataclass(frozen=True)
class QuantizationChoice:
    """What auto chose (None = no quantization) and the reason, for the log and the API."""

    quantization: str | None
    reason: str


def choose_quantization(net: nn.Module, dtype: torch.dtype, device: torch.device,
                        max_num_seqs: int = 64, dtype_from_auto: bool = False
                        ) -> QuantizationChoice:
    """w4a8 (or, without a w4a8 kernel and with few sequences at once, int4) when every
    linear layer of the loaded (not yet prepared) model holds Q4_0 / Q4_1 integers from its
    GGUF, activations are bfloat16 (or float32 that ``--dtype auto`` chose: then w4a8 only)
    and the device is the CPU; else none."""
    linears = [m for name, m in net.named_modules()
               if isinstance(m, Linear) and name != "lm_head"]  # the head is 8-bit either way
    q4 = sum(getattr(m.weight, "q4_blocks", None) is not None for m in linears)
    if not linears or q4 < len(linears):
        return QuantizationChoice(None, f"none: not a Q4_0/Q4_1 GGUF ({q4} of {len(linears)} "
                                        f"linear weights are Q4_0/Q4_1)")
    if device.type != "cpu":
        return QuantizationChoice(None, "none: the quantized kernels run on the CPU only")
    if dtype == torch.float32 and dtype_from_auto and w4a8.available():
        return QuantizationChoice("w4a8", f"w4a8: all {q4} linear weights are Q4_0/Q4_1 in "
                                          f"the GGUF and this CPU has no native bfloat16, so "
                                          f"the model runs in float32 and its rows are "
                                          f"quantized to int8 per 32 values for the file's "
                                          f"4-bit integers ({w4a8.kernel_isa()} kernel; "
                                          f"--dtype float32 keeps float32 weights, the exact "
                                          f"reference)")
    if dtype != torch.bfloat16:
        name = str(dtype).removeprefix("torch.")
        why = (" (asked for by name: the exact reference)"
               if dtype == torch.float32 and not dtype_from_auto else "")
        return QuantizationChoice(None, f"none: the quantized kernels take bfloat16 "
                                        f"activations and the dtype is {name}{why}")
    if w4a8.available():
        return QuantizationChoice("w4a8", f"w4a8: all {q4} linear weights are Q4_0/Q4_1 in "
                                          f"the GGUF, the dtype is bfloat16 and the CPU has "
                                          f"{w4a8.kernel_isa()}: the file's 4-bit integers "
                                          f"times int8 activations (--quantization none: "
                                          f"bfloat16 weights, slower up to ~32 streams, about "
                                          f"even at 64)")
    if max_num_seqs > GEMV_MAX_ROWS:
        return QuantizationChoice(None, f"none: up to {max_num_seqs} sequences decode at once "
                                        f"(max_num_seqs) and this CPU has no w4a8 kernel "
                                        f"(AVX512-VNNI or AVX2); int4 weight-only pays "
                                        f"with max_num_seqs <= {GEMV_MAX_ROWS}")
    return QuantizationChoice("int4", f"int4: all {q4} linear weights are Q4_0/Q4_1 in the "
                                      f"GGUF and the dtype is bfloat16, so int4 keeps the "
                                      f"file's own integers exactly (no AVX512-VNNI or AVX2 "
                                      f"for w4a8)")


def choose_gguf_blocks(formats: dict[str, str], device: torch.device, dtype: torch.dtype
                       ) -> QuantizationChoice | None:
    """For a GGUF whose projections are in other kept formats than Q4_0 / Q4_1 (a Q4_K_M,
    Q5_K_M, Q6_K or Q8_0 file), decided from its tensor table before loading: ``gguf`` (the
    blocks as they are, float32 sums: the float32 model's values at about the file's size)
    in float32, where it is also faster than float32 weights; in bfloat16, none: bfloat16
    weights on oneDNN decode faster than the block kernel (docs/benchmarks.md), at ~3.5x the
    memory. None leaves the choice to `choose_quantization` after loading (Q4_0 / Q4_1
    files, float files)."""
    linear = {n: f for n, f in formats.items() if n.endswith("proj.weight")}
    kept = {n: f for n, f in linear.items()
            if gguf_blocks.kind_of(f) in gguf_blocks.KEPT_FORMATS}
    if not linear or not kept or set(kept.values()) <= {"Q4_0", "Q4_1"}:
        return None
    counts = ", ".join(f"{n} {f}" for f, n in sorted(_count(kept.values()).items()))
    rest = len(linear) - len(kept)
    what = f"{counts} of {len(linear)} projections" + (f"; {rest} dequantized" if rest else "")
    if device.type != "cpu" or not gguf_blocks.available():
        return QuantizationChoice(None, "none: the GGUF block kernel runs on x86 CPUs with "
                                        "AVX2 only")
    if dtype != torch.float32:
        return QuantizationChoice(None, f"none: K-quant GGUF ({what}); bfloat16 weights "
                                        f"decode faster than its blocks here "
                                        f"(--quantization gguf keeps them: weights at the "
                                        f"file's size)")
    return QuantizationChoice("gguf", f"gguf: the file's blocks stay as they are ({what}), "
                                      f"float32 sums over the file's values (--quantization "
                                      f"none: float32 weights, ~4x the memory)")


def _count(values) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return out
