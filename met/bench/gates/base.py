"""What every gate gets (a client on its own server, its floors table) and gives back."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import httpx

from met.bench.loadgen import Target
from met.bench.records import Check


@dataclass
class GateContext:
    """A running `met serve` for one gate."""

    gate: str
    target: Target
    client: httpx.AsyncClient
    max_model_len: int | None
    progress: TextIO | None = None
    model: str | None = None  # what the server serves (None: the embedded model)


@dataclass
class GateOutcome:
    """Measurements (JSON-ready) and the checks that make the verdict."""

    metrics: dict[str, Any] = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)


@dataclass(frozen=True)
class Gate:
    """A named gate. ``configure`` reads and validates its floors table before any server
    starts (a ValueError naming the key); ``run`` measures against the server."""

    name: str
    description: str
    configure: Callable[[dict[str, Any], Path | None], Any]
    run: Callable[[GateContext, Any], Awaitable[GateOutcome]]
    needs_floors: bool = True
    # Start the server with an empty native-kernel build cache (what a machine that never
    # built them sees): the server must build them before it reports ready.
    fresh_kernels: bool = False


def require(section: dict[str, Any], key: str, path: Path | None, gate: str) -> Any:
    """A key the gate cannot run without (ValueError naming the file, table and key)."""
    if key not in section:
        raise ValueError(f"{path}: [{gate}] needs `{key}`")
    return section[key]


def per_key_floats(section: dict[str, Any], key: str, path: Path | None,
                   gate: str) -> dict[int, float]:
    """A ``{"1" = 20.0, "4" = 60.0}`` table keyed by concurrency or prompt length."""
    table = section.get(key, {})
    if not isinstance(table, dict):
        raise ValueError(f"{path}: [{gate}] {key} must be a table like {{\"1\" = 20.0}}")
    try:
        return {int(k): float(v) for k, v in table.items()}
    except (TypeError, ValueError):
        raise ValueError(f"{path}: [{gate}] {key}: keys must be integers and values numbers, "
                         f"got {table!r}") from None
