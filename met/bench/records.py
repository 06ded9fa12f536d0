"""Gate records: ``.benchmarks/<gate>/<YYYY-MM-DD>-<git sha10>.json`` in the repo root.

A record says what ran (gate, command, serve settings), on what (git sha and dirty paths,
hardware, torch), what was measured, and the verdict with one check per floor, each naming
the floor and the measured value.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from met.bench.report import write_json

RECORD_KIND = "met-bench-record"
_OPS = {">=": lambda m, f: m >= f, "<=": lambda m, f: m <= f, "==": lambda m, f: m == f}


@dataclass(frozen=True)
class Check:
    """One floor (or ceiling, or required equality) against what was measured."""

    name: str
    measured: Any
    op: str
    floor: Any
    ok: bool

    @classmethod
    def of(cls, name: str, measured: Any, op: str, floor: Any) -> Check:
        if op not in _OPS:
            raise ValueError(f"check {name}: op must be one of {sorted(_OPS)}, got {op!r}")
        ok = measured is not None and bool(_OPS[op](measured, floor))
        return cls(name, measured, op, floor, ok)

    def describe(self) -> str:
        m = f"{self.measured:.4g}" if isinstance(self.measured, float) else repr(self.measured)
        f = f"{self.floor:.4g}" if isinstance(self.floor, float) else repr(self.floor)
        return f"{self.name} = {m} (floor {self.op} {f}): {'ok' if self.ok else 'FAIL'}"


def verdict(checks: list[Check]) -> tuple[str, str]:
    """PASS when every check holds; the reason names each failing check (or all of them)."""
    if not checks:
        return "FAIL", "no checks ran"
    failed = [c for c in checks if not c.ok]
    if failed:
        return "FAIL", "; ".join(c.describe() for c in failed)
    return "PASS", "; ".join(c.describe() for c in checks)


def repo_root() -> Path:
    """The git checkout met runs from, else the current directory."""
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=here,
                             capture_output=True, text=True, timeout=10, check=True)
        return Path(out.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        return Path.cwd()


def git_info(root: Path) -> dict[str, Any]:
    """sha and the paths with uncommitted changes (so a record of a dirty tree says so)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True,
                              timeout=30, check=True).stdout
    try:
        sha = git("rev-parse", "HEAD").strip()
        dirty = [line[3:] for line in git("status", "--porcelain").splitlines() if line]
    except (OSError, subprocess.SubprocessError):
        return {"sha": None, "dirty_paths": [], "note": "not a git checkout"}
    return {"sha": sha, "dirty_paths": dirty}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def hardware() -> dict[str, Any]:
    """CPU model, cores, memory, GPUs (if torch sees any), torch and Python versions."""
    import torch

    gpus = []
    if torch.cuda.is_available():
        gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {
        "cpu_model": _cpu_model(), "cpu_cores": usable_cores(),
        "cpu_count_os": os.cpu_count(), "memory_bytes": _memory_bytes(), "gpus": gpus,
        "torch": torch.__version__, "python": platform.python_version(),
        "platform": platform.platform(),
    }


@dataclass
class Record:
    """Everything one gate run leaves behind."""

    gate: str
    model: str
    command: list[str]
    serve: dict[str, Any]
    metrics: dict[str, Any]
    checks: list[Check]
    floors_file: str | None = None

    def to_dict(self, root: Path) -> dict[str, Any]:
        v, reason = verdict(self.checks)
        return {
            "kind": RECORD_KIND, "gate": self.gate, "model": self.model,
            "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "git": git_info(root), "command": self.command, "serve": self.serve,
            "hardware": hardware(), "floors_file": self.floors_file,
            "metrics": self.metrics, "checks": [asdict(c) for c in self.checks],
            "verdict": v, "reason": reason,
        }


def record_path(records_dir: Path, gate: str, sha: str | None) -> Path:
    """``<dir>/<gate>/<date>-<sha10>.json``; a second run the same day at the same commit
    gets ``-2``, ``-3``… rather than overwriting the first."""
    stem = f"{datetime.now(UTC).date().isoformat()}-{(sha or 'nogit')[:10]}"
    path = records_dir / gate / f"{stem}.json"
    n = 2
    while path.exists():
        path = records_dir / gate / f"{stem}-{n}.json"
        n += 1
    return path


def write_record(record: Record, records_dir: Path | None = None) -> tuple[Path, dict]:
    """Write the record; returns its path and contents."""
    root = repo_root()
    data = record.to_dict(root)
    path = record_path(records_dir or root / ".benchmarks", record.gate, data["git"]["sha"])
    write_json(path, data)
    return path, data


def command_line() -> list[str]:
    """How this process was started, as a user would retype it."""
    argv = list(sys.argv)
    if argv and argv[0].endswith(("cli.py", "__main__.py")):
        argv = ["python", "-m", "met.cli", *argv[1:]]
    return argv
