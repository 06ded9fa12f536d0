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
        if tuple(tensor.shape) != (sum(rows), params[parts[0]].shape[1]):
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                             f"the model expects {(sum(rows), params[parts[0]].shape[1])}")
        for p, piece in zip(parts, tensor.split(rows, dim=0), strict=True):
            params[p].data.copy_(piece)
        return parts
