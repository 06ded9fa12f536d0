"""A LoRA adapter as met serves it: read, checked against the base model, kept on the CPU.

This module reads PEFT directories; met.lora.gguf_adapter reads llama.cpp's GGUF LoRA files
into the same `LoRAAdapter`, and met.lora.load picks between them.

PEFT writes ``adapter_config.json`` (rank ``r``, ``lora_alpha``, ``target_modules``,
``use_rslora``) and ``adapter_model.safetensors`` with, per target projection,
``...layers.N.<module>.lora_A.weight`` [r, in] and ``lora_B.weight`` [out, r]. The delta is
``scaling · x Aᵀ Bᵀ`` with scaling = alpha / r (alpha / √r under rsLoRA).

Models whose checkpoints fuse projections (Phi-3: ``qkv_proj``, ``gate_up_proj``) get
adapters on the fused modules; B's rows split into the parts' (A shared), which is the same
delta, so such an adapter fills the same slots as one on the separate projections.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

# The projections an adapter may target: attention q/k/v/o and the dense MLP's gate/up/down
# (the MLP is "feed_forward" in hybrids such as Bamba).
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Fused targets (as Phi-3's checkpoint names them) -> the parts their B rows hold, in order.
FUSED_TARGETS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"),
                 "gate_up_proj": ("gate_proj", "up_proj")}
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp|feed_forward)\.(\w+)"
                  r"\.lora_([AB])(?:\.default)?\.weight$")


class AdapterError(ValueError):
    """An adapter that cannot be served on this base model (the message names why)."""


def _put(pairs: dict, name: str, key: str, layer: int, target: str, which: str,
         t: torch.Tensor) -> None:
    """Record one lora_A / lora_B matrix; a target given twice (fused and alone) is an
    error, not a silent overwrite."""
    slot = pairs.setdefault((layer, target), {})
    if which in slot:
        raise AdapterError(f"lora {name}: layer {layer} {target} has lora_{which} twice "
                           f"(a fused module and the projection itself; {key})")
    slot[which] = t


@dataclass
class LoRAAdapter:
    """One adapter's matrices, float32 on the CPU, scaling folded into B."""

    name: str
    path: str
    rank: int
    # (layer index, target) -> (A [r, in], scaling · B [out, r]); None while evicted from
    # memory by --max-cpu-loras (read from ``path`` again when a request needs it)
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] | None = field(repr=False)
    lora_id: int = 0  # unique per registration: part of the prefix-cache key
    nbytes: int = 0  # the matrices' bytes when in memory

    def __post_init__(self) -> None:
        if self.weights is not None:
            self.nbytes = sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def load_peft(name: str, path: str, shapes: dict[tuple[int, str], tuple[int, int]],
              max_rank: int) -> LoRAAdapter:
    """Read the PEFT adapter in directory ``path``. ``shapes`` maps (layer, target) to the
    base projection's (in, out) features; anything the base lacks, a rank above
    ``max_rank`` or a matrix of the wrong shape is an `AdapterError` naming it."""
    root = Path(path)
    config_file, weights_file = root / "adapter_config.json", root / "adapter_model.safetensors"
    if not root.is_dir():
        raise AdapterError(f"lora {name}: {path} is not a directory")
    for f in (config_file, weights_file):
        if not f.is_file():
            raise AdapterError(f"lora {name}: missing file {f}")
    try:
        cfg = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise AdapterError(f"lora {name}: {config_file} is not JSON ({e})") from e
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"lora {name}: peft_type {cfg.get('peft_type')!r} is not LORA")
    rank = int(cfg.get("r", 8))
    if rank > max_rank:
        raise AdapterError(f"lora {name}: rank {rank} exceeds --max-lora-rank {max_rank}")
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise AdapterError(f"lora {name}: {key} (per-module ranks) is not supported")
    if cfg.get("modules_to_save"):
        raise AdapterError(f"lora {name}: modules_to_save {cfg['modules_to_save']} "
                           "(fully trained modules) is not supported")
    alpha = float(cfg.get("lora_alpha", rank))
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank

    from safetensors.torch import load_file

    tensors = load_file(str(weights_file))
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.search(key)
        if m is None:
            raise AdapterError(f"lora {name}: tensor {key} is not a LoRA A/B matrix of a "
                               f"decoder layer's {'/'.join(TARGETS)}")
        layer, target, which = int(m.group(1)), m.group(2), m.group(3)
        if target in FUSED_TARGETS:
            parts = FUSED_TARGETS[target]
            if not all((layer, p) in shapes for p in parts):
                raise AdapterError(f"lora {name}: the base model has no layer {layer} "
                                   f"{'/'.join(parts)} for {target} ({key})")
            if which == "B":
                rows = [shapes[(layer, p)][1] for p in parts]
                if t.shape[0] != sum(rows):
                    raise AdapterError(
                        f"lora {name}: layer {layer} {target}: lora_B has {t.shape[0]} rows, "
                        f"the base's {'/'.join(parts)} have {sum(rows)}")
                pieces = t.split(rows, dim=0)
            else:
                pieces = [t] * len(parts)
            for p, piece in zip(parts, pieces, strict=True):
                _put(pairs, name, key, layer, p, which, piece)
            continue
        if target not in TARGETS:
            raise AdapterError(f"lora {name}: unknown target module {target!r} ({key}); "
                               f"met applies adapters to {', '.join(TARGETS)}")
        if (layer, target) not in shapes:
            raise AdapterError(f"lora {name}: the base model has no layer {layer} {target} "
                               f"({key})")
        _put(pairs, name, key, layer, target, which, t)
    weights = {}
    for (layer, target), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"lora {name}: layer {layer} {target} has lora_{''.join(ab)} "
                               "without its pair")
        fan_in, fan_out = shapes[(layer, target)]
        a, b = ab["A"], ab["B"]
        if tuple(a.shape) != (rank, fan_in) or tuple(b.shape) != (fan_out, rank):
            raise AdapterError(
                f"lora {name}: layer {layer} {target}: shape mismatch, lora_A "
                f"{tuple(a.shape)} and lora_B {tuple(b.shape)}, the base needs "
                f"({rank}, {fan_in}) and ({fan_out}, {rank})")
        weights[(layer, target)] = (a.float().contiguous(), (b.float() * scaling).contiguous())
    if not weights:
        raise AdapterError(f"lora {name}: {weights_file} holds no LoRA matrices")
    return LoRAAdapter(name, str(root), rank, weights)
