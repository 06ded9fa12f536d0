"""State slots of a hybrid model: per-request recurrent state rows, and prefix-cache
snapshots of that state at block boundaries.

A hybrid model (attention + state-space layers) keeps, per mixer layer, one state row per
running request (conv and SSM state, `met.layers.mamba`). A request takes a slot at
admission and gives it back at finish, abort or preemption, so admission counts free slots
beside free KV blocks.

Attention layers can reuse a cached prefix from its KV blocks alone; a mixer layer needs
its state after that prefix. So when a request computes through a block boundary whose block
goes into the prefix cache, the state there is also copied into a snapshot row, keyed by the
block's hash. A prefix hit is then cut back to its last block with a snapshot, which
restores the request's slot. Snapshots are bounded (``num_snapshots`` rows, least recently
used evicted first) and dropped when the block pool evicts their block. A snapshot written
during a step is usable only after that step ran (`commit`): a request admitted in the same
step cannot read it.

Rows: slots are rows [0, num_slots), snapshots rows [num_slots, num_slots + num_snapshots)
of the runner's state tensors. Bookkeeping only; never touches tensors.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from met.cache.prefix_hash import BlockHash


@dataclass(frozen=True)
class StateStats:
    """State-slot accounting: what a test or /metrics reads to prove nothing leaks."""

    num_slots_total: int
    num_slots_in_use: int
    num_snapshots: int  # usable snapshots held
    num_snapshot_rows: int
    num_restores: int  # prefix hits that restored a snapshot, since start


class StateSlots:
    def __init__(self, num_slots: int, num_snapshots: int):
        if num_slots < 1:
            raise ValueError(f"max_num_seqs: a hybrid model needs >= 1 state slot, got "
                             f"{num_slots}")
        if num_snapshots < 0:
            raise ValueError(f"state_snapshots: must be >= 0, got {num_snapshots}")
        self.num_slots = num_slots
        self.num_snapshot_rows = num_snapshots
        self._free_slots = list(range(num_slots - 1, -1, -1))  # pop() gives the lowest
        self._slot_of: dict[str, int] = {}
        self._free_rows = list(range(num_slots + num_snapshots - 1, num_slots - 1, -1))
        self._snapshots: OrderedDict[BlockHash, int] = OrderedDict()  # LRU first
        self._pending: dict[BlockHash, int] = {}
        self.num_restores = 0

    @property
    def num_rows(self) -> int:
        return self.num_slots + self.num_snapshot_rows

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def acquire(self, request_id: str) -> int:
        """The request's slot (taking a free one on first call)."""
        slot = self._slot_of.get(request_id)
        if slot is not None:
            return slot
        if not self._free_slots:
            raise RuntimeError("state slots exhausted: the scheduler admitted a request "
                               "without a free slot")
        slot = self._free_slots.pop()
        self._slot_of[request_id] = slot
        return slot

    def free(self, request_id: str) -> None:
        slot = self._slot_of.pop(request_id, None)
        if slot is not None:
            self._free_slots.append(slot)

    def restore_row(self, block_hash: BlockHash | None) -> int | None:
        """The snapshot row holding the state after the block ``block_hash``, or None;
        a found one becomes the most recently used."""
        row = self._snapshots.get(block_hash) if block_hash is not None else None
        if row is not None:
            self._snapshots.move_to_end(block_hash)
        return row

    def note_restore(self) -> None:
        self.num_restores += 1

    def reserve(self, block_hash: BlockHash) -> int | None:
        """A row to snapshot the state after block ``block_hash`` into during this step;
        None when one exists (or is being written) already, or no row can be had."""
        if block_hash in self._snapshots or block_hash in self._pending:
            return None
        if self._free_rows:
            row = self._free_rows.pop()
        elif self._snapshots:
            _, row = self._snapshots.popitem(last=False)
        else:
            return None
        self._pending[block_hash] = row
        return row

    def commit(self) -> None:
        """The step that wrote the reserved snapshots ran: they become usable."""
        for block_hash, row in self._pending.items():
            self._snapshots[block_hash] = row
        self._pending.clear()

    def discard_pending(self) -> None:
        """The step failed: what it was to write cannot be trusted."""
        self._free_rows.extend(self._pending.values())
        self._pending.clear()

    def forget(self, block_hash: BlockHash) -> None:
        """The block pool evicted this block: its snapshot goes with it. One being written
        this step stays (its row is a save target already; unindexed, it ages out)."""
        row = self._snapshots.pop(block_hash, None)
        if row is not None:
            self._free_rows.append(row)

    def clear(self) -> None:
        """Forget every snapshot (the prefix cache was reset)."""
        self._free_rows.extend(self._snapshots.values())
        self._free_rows.extend(self._pending.values())
        self._snapshots.clear()
        self._pending.clear()

    def stats(self) -> StateStats:
        return StateStats(self.num_slots, len(self._slot_of), len(self._snapshots),
                          self.num_snapshot_rows, self.num_restores)
