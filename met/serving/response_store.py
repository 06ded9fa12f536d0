"""Stored Responses-API responses (``store: true``), in memory and bounded: at most
``max_entries`` (the oldest go first) and each for ``ttl_s`` seconds (``met serve
--responses-store-max`` / ``--responses-store-ttl``). A stored response keeps the whole
conversation it answered, so ``previous_response_id`` can continue it."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

DEFAULT_STORE_MAX = 1000
DEFAULT_STORE_TTL_S = 3600.0


@dataclass(frozen=True)
class StoredResponse:
    """A response object and the input items (earlier turns included) it answered."""

    response: dict[str, Any]
    input_items: list[dict[str, Any]]
    stored_at: float


class ResponseStore:
    """Responses by id, bounded by count and age (one event loop uses it: no locking)."""

    def __init__(self, max_entries: int = DEFAULT_STORE_MAX, ttl_s: float = DEFAULT_STORE_TTL_S,
                 clock: Callable[[], float] = time.monotonic):
        if max_entries < 0:
            raise ValueError(f"--responses-store-max: must be >= 0 (0 = store nothing), got "
                             f"{max_entries}")
        if not ttl_s > 0:
            raise ValueError(f"--responses-store-ttl: must be > 0 seconds, got {ttl_s}")
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._clock = clock
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, response: dict[str, Any], input_items: list[dict[str, Any]]) -> None:
        """Store ``response`` under its ``id`` (nothing when the store holds 0 entries)."""
        self._expire()
        if self.max_entries == 0:
            return
        rid = response["id"]
        self._items.pop(rid, None)
        self._items[rid] = StoredResponse(response, input_items, self._clock())
        while len(self._items) > self.max_entries:
            self._items.popitem(last=False)

    def get(self, rid: str) -> StoredResponse | None:
        self._expire()
        return self._items.get(rid)

    def delete(self, rid: str) -> bool:
        """Whether ``rid`` was stored (and is now gone)."""
        self._expire()
        return self._items.pop(rid, None) is not None

    def __len__(self) -> int:
        self._expire()
        return len(self._items)

    def _expire(self) -> None:
        cutoff = self._clock() - self.ttl_s
        while self._items:
            oldest = next(iter(self._items.values()))
            if oldest.stored_at > cutoff:
                break
            self._items.popitem(last=False)
