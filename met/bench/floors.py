"""Floors: a checked-in TOML file per model and machine class
(``benchmarks/floors/<model>.<machine>.toml``) holding each gate's pinned settings and the
values it must reach. See ``benchmarks/floors/smollm2-135m.cpu-2core.toml`` for the keys.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from met.bench.records import repo_root, usable_cores

EMBEDDED_MODEL_SLUG = "smollm2-135m"


def model_slug(model: str | None) -> str:
    """A short name for floors files: the embedded model is ``smollm2-135m``; a path or id
    becomes its last component, lower case, up to the first dot."""
    if not model:
        return EMBEDDED_MODEL_SLUG
    name = Path(model.rstrip("/")).name.split(".")[0].lower()
    return re.sub(r"[^a-z0-9_-]+", "-", name) or "model"


def machine_class(device: str = "cpu") -> str:
    """``cpu-<N>core`` (usable cores) or ``cuda-<gpu name>``."""
    if device.startswith("cuda"):
        import torch

        index = int(device.split(":")[1]) if ":" in device else 0
        name = torch.cuda.get_device_name(index) if torch.cuda.is_available() else "gpu"
        return "cuda-" + re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return f"cpu-{usable_cores()}core"


def default_floors_path(model: str | None, device: str = "cpu") -> Path:
    name = f"{model_slug(model)}.{machine_class(device)}.toml"
    return repo_root() / "benchmarks" / "floors" / name


@dataclass(frozen=True)
class Floors:
    """A parsed floors file: ``[serve]`` settings for every gate, and one table per gate
    (``[<gate>]``, with an optional ``[<gate>.serve]`` overriding the shared settings)."""

    path: Path | None
    data: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def load(cls, path: str | Path) -> Floors:
        p = Path(path)
        if not p.exists():
            raise FileNotFoundError(f"--floors: {p} does not exist")
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"--floors: {p} is not valid TOML ({e})") from None
        return cls(p, data)

    def section(self, gate: str) -> dict[str, Any]:
        """The gate's table (without its ``serve`` sub-table); empty if absent."""
        table = self.data.get(gate, {})
        if not isinstance(table, dict):
            raise ValueError(f"{self.path}: [{gate}] must be a table")
        return {k: v for k, v in table.items() if k != "serve"}

    def serve(self, gate: str) -> dict[str, Any]:
        """Shared ``[serve]`` settings overlaid with ``[<gate>.serve]``."""
        shared = dict(self.data.get("serve", {}))
        shared.update(self.data.get(gate, {}).get("serve", {}))
        return shared


def get(section: dict[str, Any], key: str, default: Any, path: Path | None, gate: str) -> Any:
    """``section[key]`` of the type of ``default`` (ValueError naming the key if not)."""
    value = section.get(key, default)
    if default is not None and not isinstance(value, type(default)) and not (
            isinstance(default, float) and isinstance(value, int)):
        raise ValueError(f"{path}: [{gate}] {key} must be a {type(default).__name__}, "
                         f"got {value!r}")
    return value
