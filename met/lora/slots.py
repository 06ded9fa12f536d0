"""Resident adapter slots: every target projection holds ``max_loras`` slots of stacked
LoRA matrices; a request pins its adapter's slot while it runs (refcounted), and a free or
least-recently-used unpinned slot takes the next adapter asked for.

Fused projections (q/k/v as ``qkv_proj``, gate/up as ``gate_up_proj``) hold their parts'
A matrices stacked (``[slot, parts · R, in]``) and B block-diagonal (``[slot, out, parts · R]``),
so one shrink and one expand run the whole fused projection.
"""

from __future__ import annotations

import itertools
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from torch import nn

from met.kernels.lora import add_lora
from met.layers.linear import Linear
from met.lora.adapter import AdapterError, LoRAAdapter
from met.lora.load import load_adapter

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp)\.(\w+)$")
# The Linear modules slots attach to: the fused projections and the unfused ones.
_PROJECTIONS = frozenset({"qkv_proj", "gate_up_proj", "q_proj", "k_proj", "v_proj", "o_proj",
                          "gate_proj", "up_proj", "down_proj"})


@dataclass
class StepMapping:
    """Which rows of this step run which slot: (slot, row indices or None for all rows)."""

    groups: list[tuple[int, torch.Tensor | None]] = field(default_factory=list)


class LoRAProjection:
    """The slots of one (possibly fused) projection; `add` is its step's delta."""

    def __init__(self, parts: list[tuple[str, int, int]], fan_in: int, fan_out: int,
                 slots: int, rank: int, step: StepMapping):
        self.parts = parts  # (target, first output row, rows)
        self.rank = rank
        self.step = step
        self.a = torch.zeros(slots, len(parts) * rank, fan_in)
        self.b = torch.zeros(slots, fan_out, len(parts) * rank)

    def write(self, slot: int, layer: int, adapter: LoRAAdapter | None) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()
        if adapter is None:
            return
        r = self.rank
        for p, (target, first, rows) in enumerate(self.parts):
            ab = adapter.weights.get((layer, target))
            if ab is None:
                continue
            a, b = ab
            self.a[slot, p * r:p * r + a.shape[0]] = a
            self.b[slot, first:first + rows, p * r:p * r + a.shape[0]] = b

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        groups = self.step.groups
        if not groups:
            return y
        return add_lora(y, x.reshape(-1, x.shape[-1]), self.a, self.b, groups)


def _parts(name: str, module: nn.Module, attn: nn.Module | None) -> list[tuple[str, int, int]]:
    """The targets one Linear computes, with their output rows."""
    out = module.out_features
    if name == "qkv_proj":
        q = attn.num_heads * attn.head_dim
        kv = attn.num_kv_heads * attn.head_dim
        return [("q_proj", 0, q), ("k_proj", q, kv), ("v_proj", q + kv, kv)]
    if name == "gate_up_proj":
        return [("gate_proj", 0, out // 2), ("up_proj", out // 2, out // 2)]
    return [(name, 0, out)]


class LoRAManager:
    """The adapters a server knows (name -> path, loaded and checked at registration) and
    the ``max_loras`` slots resident in the model's projections. ``model_type``: the base's
    HF model_type, which a GGUF adapter's architecture must match."""

    def __init__(self, model: nn.Module, max_loras: int, max_lora_rank: int,
                 model_type: str | None = None):
        self.max_loras, self.max_rank = max_loras, max_lora_rank
        self.model_type = model_type
        self.head_dim: int | None = None  # a GGUF adapter's q/k rows are reordered by heads
        self.step = StepMapping()
        self.projections: list[tuple[int, LoRAProjection]] = []
        self.shapes: dict[tuple[int, str], tuple[int, int]] = {}
        modules = dict(model.named_modules())
        for name, module in modules.items():
            m = _LAYER.search(name)
            if m is None or not isinstance(module, Linear):
                continue
            layer, target = int(m.group(1)), m.group(3)
            if target not in _PROJECTIONS:
                continue
            attn = modules.get(name.rsplit(".", 1)[0]) if target == "qkv_proj" else None
            if target in ("qkv_proj", "q_proj"):
                self.head_dim = getattr(modules.get(name.rsplit(".", 1)[0]), "head_dim", None)
            parts = _parts(target, module, attn)
            for t, _, rows in parts:
                self.shapes[(layer, t)] = (module.in_features, rows)
            proj = LoRAProjection(parts, module.in_features, module.out_features,
                                  max_loras, max_lora_rank, self.step)
            module.lora = proj
            self.projections.append((layer, proj))
        if not self.projections:
            raise ValueError("enable_lora: this model has no projections LoRA can target")
        self.adapters: dict[str, LoRAAdapter] = {}
        self._ids = itertools.count(1)
        self.slot_of: OrderedDict[str, int] = OrderedDict()  # resident, LRU first
        self.refs = [0] * max_loras
        self.loads = 0  # slot writes since start (swaps): /metrics
        # register / unregister come from the API's threads while the engine acquires.
        self._lock = threading.Lock()

    # Registration ---------------------------------------------------------------------
    def register(self, name: str, path: str) -> LoRAAdapter:
        """Load and check the adapter at ``path`` under ``name`` (`AdapterError` if bad)."""
        if not name:
            raise AdapterError("lora: an adapter needs a name")
        if name in self.adapters:
            raise AdapterError(f"lora {name}: an adapter of that name is already loaded")
        adapter = load_adapter(name, path, self.shapes, self.max_rank, head_dim=self.head_dim,
                               model_type=self.model_type)
        with self._lock:
            if name in self.adapters:
                raise AdapterError(f"lora {name}: an adapter of that name is already loaded")
            adapter.lora_id = next(self._ids)
            self.adapters[name] = adapter
        return adapter

    def unregister(self, name: str) -> None:
        """Forget ``name``; refused (`AdapterError`) while running requests use it."""
        with self._lock:
            self._unregister(name)

    def _unregister(self, name: str) -> None:
        if name not in self.adapters:
            raise AdapterError(f"lora {name}: no adapter of that name is loaded")
        slot = self.slot_of.get(name)
        if slot is not None and self.refs[slot]:
            raise AdapterError(f"lora {name}: {self.refs[slot]} running request(s) use it; "
                               "unload it once they finish")
        if slot is not None:
            del self.slot_of[name]
            for layer, proj in self.projections:
                proj.write(slot, layer, None)
        del self.adapters[name]

    # Slots --------------------------------------------------------------------------
    def acquire(self, name: str) -> int | None:
        """Pin ``name``'s slot (writing it into a free or unpinned slot first); None when
        every slot is pinned by other adapters' running requests."""
        with self._lock:
            return self._acquire(name)

    def _acquire(self, name: str) -> int | None:
        slot = self.slot_of.get(name)
        if slot is None:
            used = set(self.slot_of.values())
            free = [s for s in range(self.max_loras) if s not in used]
            if free:
                slot = free[0]
            else:
                victim = next((n for n, s in self.slot_of.items() if not self.refs[s]), None)
                if victim is None:
                    return None
                slot = self.slot_of.pop(victim)
            adapter = self.adapters[name]
            for layer, proj in self.projections:
                proj.write(slot, layer, adapter)
            self.loads += 1
            self.slot_of[name] = slot
        self.slot_of.move_to_end(name)
        self.refs[slot] += 1
        return slot

    def release(self, slot: int) -> None:
        self.refs[slot] -= 1

    def set_rows(self, row_slots: list[int], device: torch.device) -> None:
        """This step's rows' slots (-1: the base model alone)."""
        groups: list[tuple[int, torch.Tensor | None]] = []
        present = sorted(set(row_slots) - {-1})
        for slot in present:
            if len(present) == 1 and -1 not in row_slots:
                groups.append((slot, None))
            else:
                rows = [i for i, s in enumerate(row_slots) if s == slot]
                groups.append((slot, torch.tensor(rows, dtype=torch.long, device=device)))
        self.step.groups = groups

    def clear_rows(self) -> None:
        self.step.groups = []

    def resident_bytes(self) -> int:
        """Bytes of every projection's slot matrices."""
        return sum(p.a.nbytes + p.b.nbytes for _, p in self.projections)


__all__ = ["AdapterError", "LoRAManager"]
