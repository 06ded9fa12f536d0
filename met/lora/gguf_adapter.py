"""A LoRA adapter in llama.cpp's GGUF format, read into the same `LoRAAdapter` PEFT gives.

llama.cpp's ``convert_lora_to_gguf.py`` writes ``general.type = "adapter"``,
``adapter.type = "lora"``, ``adapter.lora.alpha`` (float32) and, per target projection, the
base GGUF tensor's name plus ``.lora_a`` / ``.lora_b`` (``blk.N.attn_q.weight.lora_a``):
PEFT's A [r, in] and B [out, r] as they are, ggml listing the dimensions innermost first.
llama.cpp scales by alpha / r, r from the pair itself, and by 1 when alpha is 0 or absent
(src/llama-graph.cpp). For llama-family files the converter permutes B's rows of q/k like the
base's attn_q/attn_k (rope halves interleaved per head); met runs the HF row order, so that
is undone here as met/loader/gguf.py undoes it for the base.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import gguf
import numpy as np
import torch

from met.lora.adapter import AdapterError, LoRAAdapter

log = logging.getLogger(__name__)

# GGUF tensor part -> met target, as llama.cpp names the base model's projections.
_PARTS = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj",
          "ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}
_NAME = re.compile(r"^blk\.(\d+)\.(\w+)\.weight\.lora_([ab])$")
# The GGUF architectures whose q/k rows llama.cpp permutes (met/loader/gguf.py's list; lora
# may not import the loader).
_QK_PERMUTED = frozenset({"llama", "mistral"})
# HF model_type -> the GGUF architectures llama.cpp writes for it (MistralForCausalLM
# converts as "llama"); an adapter for another architecture is refused.
_GGUF_ARCHS = {"llama": {"llama"}, "mistral": {"llama", "mistral"}, "qwen2": {"qwen2"},
               "qwen3": {"qwen3"}, "qwen3_moe": {"qwen3moe"}, "gemma3": {"gemma3"},
               "gemma3_text": {"gemma3"}}


def load_gguf_lora(name: str, path: str, shapes: dict[tuple[int, str], tuple[int, int]],
                   max_rank: int, *, head_dim: int | None = None,
                   model_type: str | None = None) -> LoRAAdapter:
    """Read the GGUF LoRA file ``path``. ``shapes`` maps (layer, target) to the base
    projection's (in, out) features; ``head_dim`` (the base's attention head width) undoes the
    q/k permutation; ``model_type`` (the base's HF model_type), when known, must match the
    file's architecture. Anything else wrong is an `AdapterError` naming it."""
    file = Path(path)
    if not file.is_file():
        raise AdapterError(f"lora {name}: missing file {path}")
    try:
        reader = gguf.GGUFReader(str(file))
    except (ValueError, OSError) as e:
        raise AdapterError(f"lora {name}: {path} is not a GGUF file ({e})") from e
    general_type = _string(reader, gguf.Keys.General.TYPE)
    if general_type != "adapter":
        raise AdapterError(f"lora {name}: {path} is not a LoRA adapter GGUF (general.type is "
                           f"{general_type!r}, not 'adapter'; a model GGUF is a base, not an "
                           "adapter)")
    adapter_type = _string(reader, gguf.Keys.Adapter.TYPE)
    if adapter_type != "lora":
        raise AdapterError(f"lora {name}: adapter.type {adapter_type!r} is not 'lora'")
    if gguf.Keys.Adapter.ALORA_INVOCATION_TOKENS in reader.fields:
        raise AdapterError(f"lora {name}: an activated LoRA (adapter.alora.invocation_tokens) "
                           "is not supported")
    arch = _string(reader, gguf.Keys.General.ARCHITECTURE)
    wanted = _GGUF_ARCHS.get(model_type or "")
    if wanted is not None and arch not in wanted:
        raise AdapterError(f"lora {name}: the adapter is for architecture {arch!r}, the base "
                           f"model is {model_type!r}")
    alpha_field = reader.fields.get(gguf.Keys.Adapter.LORA_ALPHA)
    alpha = float(alpha_field.contents()) if alpha_field is not None else 0.0

    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for tensor in reader.tensors:
        if tensor.name.endswith("_norm.weight"):
            # mergekit-extract-lora's norm vectors: llama.cpp skips them too.
            log.warning("lora %s: ignoring %s (not a LoRA matrix)", name, tensor.name)
            continue
        m = _NAME.match(tensor.name)
        target = _PARTS.get(m.group(2)) if m else None
        if target is None:
            raise AdapterError(f"lora {name}: tensor {tensor.name} is not a LoRA matrix of a "
                               f"decoder layer's {'/'.join(_PARTS)}")
        layer = int(m.group(1))
        if (layer, target) not in shapes:
            raise AdapterError(f"lora {name}: the base model has no layer {layer} {target} "
                               f"({tensor.name})")
        pairs.setdefault((layer, target), {})[m.group(3)] = _matrix(name, tensor)

    weights = {}
    for (layer, target), ab in sorted(pairs.items()):
        if set(ab) != {"a", "b"}:
            raise AdapterError(f"lora {name}: layer {layer} {target} has lora_{''.join(ab)} "
                               "without its pair")
        a, b = ab["a"], ab["b"]
        rank = a.shape[0]
        if rank > max_rank:
            raise AdapterError(f"lora {name}: rank {rank} exceeds --max-lora-rank {max_rank}")
        fan_in, fan_out = shapes[(layer, target)]
        if a.shape != (rank, fan_in) or b.shape != (fan_out, rank):
            raise AdapterError(
                f"lora {name}: layer {layer} {target}: shape mismatch, lora_a "
                f"{tuple(a.shape)} and lora_b {tuple(b.shape)}, the base needs "
                f"({rank}, {fan_in}) and ({fan_out}, {rank})")
        if arch in _QK_PERMUTED and target in ("q_proj", "k_proj"):
            if head_dim is None:
                raise AdapterError(f"lora {name}: a {arch} adapter needs the base's head_dim "
                                   "to undo llama.cpp's q/k row order")
            b = _unpermute_rows(b, head_dim)
        scaling = alpha / rank if alpha else 1.0
        weights[(layer, target)] = (a.contiguous(), (b * scaling).contiguous())
    if not weights:
        raise AdapterError(f"lora {name}: {path} holds no LoRA matrices")
    return LoRAAdapter(name, str(file), max(a.shape[0] for a, _ in weights.values()), weights)


def _string(reader: gguf.GGUFReader, key: str) -> str | None:
    field = reader.fields.get(key)
    if field is None:
        return None
    value = field.contents()
    return value if isinstance(value, str) else None


def _matrix(name: str, tensor) -> torch.Tensor:
    """The tensor as float32 [rows, cols] (ggml's shape reversed), dequantized if need be."""
    if len(tensor.shape) != 2:
        raise AdapterError(f"lora {name}: tensor {tensor.name} has shape "
                           f"{tuple(int(d) for d in tensor.shape)}, a LoRA matrix is 2-D")
    try:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as e:
        raise AdapterError(f"lora {name}: tensor {tensor.name} is {tensor.tensor_type.name}, "
                           "which met cannot read") from e
    shape = tuple(int(d) for d in reversed(tensor.shape))
    # Copied: the reader's arrays are views of its memory map of the file.
    return torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape))


def _unpermute_rows(b: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Per head, llama.cpp's row 2i is HF's row i and row 2i + 1 is HF's row i + head_dim/2;
    put them back in HF's order."""
    heads = b.shape[0] // head_dim
    return b.reshape(heads, head_dim // 2, 2, -1).transpose(1, 2).reshape(b.shape)
