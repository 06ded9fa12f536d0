"""Resident adapter slots: every target projection holds ``max_loras`` slots of stacked
LoRA matrices; a request pins its adapter's slot while it runs (refcounted), and a free or
least-recently-used unpinned slot takes the next adapter asked for.

Fused projections (q/k/v as ``qkv_proj``, gate/up as ``gate_up_proj``) hold their parts'
A matrices stacked (``[slot, parts · R, in]``) and B transposed, block-diagonal
(``[slot, parts · R, out]``), so one shrink and one expand run the whole fused projection.
"""

from __future__ import annotations

import itertools
import logging
import re
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

import torch
from torch import nn

from met.kernels.lora import add_lora, add_lora_native
from met.layers.linear import Linear
from met.lora.adapter import AdapterError, LoRAAdapter
from met.lora.load import load_adapter

log = logging.getLogger(__name__)

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp|feed_forward)\.(\w+)$")
# The Linear modules slots attach to: the fused projections and the unfused ones.
_PROJECTIONS = frozenset({"qkv_proj", "gate_up_proj", "q_proj", "k_proj", "v_proj", "o_proj",
                          "gate_proj", "up_proj", "down_proj"})


@dataclass
class StepMapping:
    """Which rows of this step run which slot: for the torch backend (slot, row indices or
    None for all rows), for the native one each row's slot (int32, -1: none)."""

    groups: list[tuple[int, torch.Tensor | None]] = field(default_factory=list)
    row_slots: torch.Tensor | None = None
    native: bool = False

    @property
    def active(self) -> bool:
        """Whether any row of this step runs an adapter."""
        return self.row_slots is not None if self.native else bool(self.groups)


class LoRAProjection:
    """The slots of one (possibly fused) projection; `add` is its step's delta."""

    def __init__(self, parts: list[tuple[str, int, int]], fan_in: int, fan_out: int,
                 slots: int, rank: int, step: StepMapping, dtype: torch.dtype):
        self.parts = parts  # (target, first output row, rows)
        self.rank = rank
        self.step = step
        self.a = torch.zeros(slots, len(parts) * rank, fan_in, dtype=dtype)
        self.bt = torch.zeros(slots, len(parts) * rank, fan_out, dtype=dtype)

    def write(self, slot: int, layer: int, adapter: LoRAAdapter | None) -> None:
        self.a[slot].zero_()
        self.bt[slot].zero_()
        if adapter is None:
            return
        r = self.rank
        for p, (target, first, rows) in enumerate(self.parts):
            ab = adapter.weights.get((layer, target))
            if ab is None:
                continue
            a, b = ab
            self.a[slot, p * r:p * r + a.shape[0]] = a
            self.bt[slot, p * r:p * r + a.shape[0], first:first + rows] = b.T

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        step = self.step
        if not step.active:
            return y
        x2 = x.reshape(-1, x.shape[-1])
        if step.native:
            return add_lora_native(y.reshape(-1, y.shape[-1]).contiguous(), x2, self.a,
                                   self.bt, step.row_slots).view(y.shape)
        return add_lora(y, x2, self.a, self.bt, step.groups)


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
    """The adapters a server knows (name -> path, read and checked at registration), the
    ``max_cpu_loras`` most recently used of them kept in memory, and the ``max_loras``
    slots resident in the model's projections. ``model_type``: the base's HF model_type,
    which a GGUF adapter's architecture must match.

    A request holds its adapter in memory from `hold` (when it is queued) to `unhold` (when
    it ends), and pins a slot while it runs; an adapter evicted from memory is read from its
    path again by the next `hold`. Held adapters are never evicted, so memory can exceed
    ``max_cpu_loras`` while queued requests name more adapters than that."""

    def __init__(self, model: nn.Module, max_loras: int, max_lora_rank: int,
                 backend: str = "torch", max_cpu_loras: int | None = None,
                 dtype: torch.dtype = torch.float32, model_type: str | None = None):
        self.max_loras, self.max_rank = max_loras, max_lora_rank
        self.model_type = model_type
        self.head_dim: int | None = None  # a GGUF adapter's q/k rows are reordered by heads
        # Slots hold bfloat16 for a bfloat16 model (what peft computes in there too, and half
        # the bytes each step reads), else float32; the sums run in float32 either way.
        slot_dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
        self.max_cpu = max_cpu_loras  # None: every registered adapter stays in memory
        self.backend = backend  # a `registry.LORA_BACKENDS` name
        self.step = StepMapping(native=backend == "cpu-native")
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
                                  max_loras, max_lora_rank, self.step, slot_dtype)
            module.lora = proj
            self.projections.append((layer, proj))
        if not self.projections:
            raise ValueError("enable_lora: this model has no projections LoRA can target")
        self.adapters: dict[str, LoRAAdapter] = {}
        self._ids = itertools.count(1)
        self.slot_of: OrderedDict[str, int] = OrderedDict()  # resident, LRU first
        self.refs = [0] * max_loras
        self.in_memory: OrderedDict[str, None] = OrderedDict()  # weights read, LRU first
        self.holds: Counter[str] = Counter()  # queued + running requests per adapter
        self.loads = 0  # slot writes since start (swaps): /metrics
        self.reads = 0  # adapters read from disk again after an eviction: /metrics
        # register / unregister come from the API's threads while the engine acquires.
        self._lock = threading.Lock()

    # Registration ---------------------------------------------------------------------
    def register(self, name: str, path: str) -> LoRAAdapter:
        """Load and check the adapter at ``path`` under ``name`` (`AdapterError` if bad)."""
        if not name:
            raise AdapterError("lora: an adapter needs a name")
        if name in self.adapters:
            raise AdapterError(f"lora {name}: an adapter of that name is already loaded")
        adapter = self._read(name, path)
        with self._lock:
            if name in self.adapters:
                raise AdapterError(f"lora {name}: an adapter of that name is already loaded")
            adapter.lora_id = next(self._ids)
            self.adapters[name] = adapter
            self.in_memory[name] = None
            self._trim(keep=name)
        return adapter

    def _read(self, name: str, path: str) -> LoRAAdapter:
        return load_adapter(name, path, self.shapes, self.max_rank, head_dim=self.head_dim,
                            model_type=self.model_type)

    def hold(self, name: str) -> LoRAAdapter:
        """A request queued under ``name``: its weights in memory (read again if evicted;
        an `AdapterError` if that fails) until the matching `unhold`."""
        with self._lock:
            adapter = self._in_memory(name)
            self.holds[name] += 1
            self.in_memory[name] = None
            self.in_memory.move_to_end(name)
            self._trim(keep=name)
            return adapter

    def _in_memory(self, name: str) -> LoRAAdapter:
        adapter = self.adapters[name]
        if adapter.weights is None:
            fresh = self._read(name, adapter.path)
            adapter.weights, adapter.nbytes = fresh.weights, fresh.nbytes
            self.reads += 1
            log.info("lora %s: read again from %s (%.1f MiB)", name, adapter.path,
                     adapter.nbytes / 2**20)
        return adapter

    def unhold(self, name: str) -> None:
        with self._lock:
            self.holds[name] -= 1
            if self.holds[name] <= 0:
                del self.holds[name]
            self._trim()

    def _trim(self, keep: str | None = None) -> None:
        """Drop the least recently used unheld adapters' weights down to max_cpu_loras (a
        resident slot keeps its own copy)."""
        if self.max_cpu is None:
            return
        for victim in list(self.in_memory):
            if len(self.in_memory) <= self.max_cpu:
                break
            if victim != keep and not self.holds[victim]:
                del self.in_memory[victim]
                self.adapters[victim].weights = None

    def unregister(self, name: str) -> None:
        """Forget ``name``; refused (`AdapterError`) while queued or running requests use
        it."""
        with self._lock:
            self._unregister(name)

    def _unregister(self, name: str) -> None:
        if name not in self.adapters:
            raise AdapterError(f"lora {name}: no adapter of that name is loaded")
        if self.holds[name]:
            raise AdapterError(f"lora {name}: {self.holds[name]} queued or running "
                               "request(s) use it; unload it once they finish")
        slot = self.slot_of.get(name)
        if slot is not None:
            del self.slot_of[name]
            for layer, proj in self.projections:
                proj.write(slot, layer, None)
        del self.adapters[name]
        self.in_memory.pop(name, None)

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
            adapter = self._in_memory(name)
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
        present = sorted(set(row_slots) - {-1})
        if self.step.native:  # the kernel reads each row's slot
            self.step.row_slots = torch.tensor(row_slots, dtype=torch.int32) if present else None
            return
        groups: list[tuple[int, torch.Tensor | None]] = []
        for slot in present:
            if len(present) == 1 and -1 not in row_slots:
                groups.append((slot, None))
            else:
                rows = [i for i, s in enumerate(row_slots) if s == slot]
                groups.append((slot, torch.tensor(rows, dtype=torch.long, device=device)))
        self.step.groups = groups

    def clear_rows(self) -> None:
        self.step.groups = []
        self.step.row_slots = None

    def snapshot(self) -> dict:
        """For /metrics: each adapter's state (resident in a slot, in memory, or on disk
        only) and queued + running requests, and the manager's totals."""
        with self._lock:
            adapters = {
                name: {"state": "resident" if name in self.slot_of else
                       "in_memory" if ad.weights is not None else "on_disk",
                       "requests": self.holds[name], "bytes": ad.nbytes}
                for name, ad in self.adapters.items()}
            return {"adapters": adapters, "slots": self.max_loras,
                    "slots_pinned": sum(r > 0 for r in self.refs), "slot_loads": self.loads,
                    "disk_reads": self.reads, "slot_bytes": self.resident_bytes()}

    def resident_bytes(self) -> int:
        """Bytes of every projection's slot matrices."""
        return sum(p.a.nbytes + p.bt.nbytes for _, p in self.projections)


__all__ = ["AdapterError", "LoRAManager"]
