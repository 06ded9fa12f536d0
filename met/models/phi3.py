"""Phi-3 / Phi-4 (Phi3ForCausalLM): the Llama decoder with the checkpoint's projections
already fused (``qkv_proj`` = q|k|v rows, ``gate_up_proj`` = gate|up rows) and, for
Phi-4-mini, rope on part of each head (``partial_rotary_factor``, see
met.layers.partial_rotary).

The fused tensors are split into the decoder's q/k/v and gate/up parameters at load, so
LoRA targets, GGUF mapping and `prepare`'s fusion stay those of every Llama-family model;
`prepare` concatenates them back into one matmul, bit for bit the checkpoint's rows.
"""

from __future__ import annotations

from typing import Any

import torch

from met.kernels.gguf_blocks import Blocks
from met.layers.linear import attach_blocks
from met.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 decoder; its fused checkpoint tensors fill the split parameters."""

    def load_special_weight(self, name: str, tensor: torch.Tensor, params: dict[str, Any]
                            ) -> list[str]:
        if name.endswith(".self_attn.qkv_proj.weight"):
            prefix = name[: -len("qkv_proj.weight")]
            parts = [f"{prefix}{p}_proj.weight" for p in ("q", "k", "v")]
        elif name.endswith(".mlp.gate_up_proj.weight"):
            prefix = name[: -len("gate_up_proj.weight")]
            parts = [f"{prefix}gate_proj.weight", f"{prefix}up_proj.weight"]
        else:
            return super().load_special_weight(name, tensor, params)
        rows = [params[p].shape[0] for p in parts]
        want = (sum(rows), params[parts[0]].shape[1])
        blocks = isinstance(tensor, Blocks)  # kept quantized (`--quantization gguf`)
        shape = (tensor.rows, tensor.cols) if blocks else tuple(tensor.shape)
        if shape != want:
            raise ValueError(f"checkpoint tensor {name!r} has shape {shape}, the model "
                             f"expects {want}")
        first = 0
        for p, n in zip(parts, rows, strict=True):
            if blocks:  # whole rows of blocks: each part keeps the file's bytes
                attach_blocks(params[p], [Blocks(tensor.kind, tensor.data[first:first + n],
                                                 tensor.cols)])
            else:
                params[p].data.copy_(tensor[first:first + n])
                # A GGUF Q4 tensor's integers, for an exact int4 layer (as load_weights does).
                q4 = getattr(tensor, "q4_blocks", None)
                params[p].q4_blocks = None if q4 is None else type(q4)(
                    *(x[first:first + n] for x in q4))
            first += n
        return parts
