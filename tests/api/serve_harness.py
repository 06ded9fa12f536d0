"""A real `met serve` subprocess on a free port, and small helpers to poll it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]


class ServerProcess:
    """`python -m met.cli serve ARGS --port 0`; the port is read from uvicorn's log line."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None):
        self.args = args
        self._log = tempfile.NamedTemporaryFile("w+", prefix="met-serve-", suffix=".log",
                                                delete=False)
        full_env = {**os.environ, **(env or {})}
        full_env["PYTHONPATH"] = os.pathsep.join(
            [str(REPO)] + ([full_env["PYTHONPATH"]] if full_env.get("PYTHONPATH") else []))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "met.cli", "serve", *args, "--host", "127.0.0.1",
             "--port", "0"],
            cwd=REPO, env=full_env, stdout=self._log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.url = ""
        self.health_seen: list[tuple[int, str]] = []

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def log(self) -> str:
        path = Path(self._log.name)
        return path.read_text(errors="replace") if path.exists() else ""

    def wait_ready(self, timeout: float = 180.0) -> ServerProcess:
        """Wait for the listening line, then for /health to say ok."""
        deadline = time.monotonic() + timeout
        while not self.url:
            m = re.search(r"Uvicorn running on (http://[\d.]+:\d+)", self.log())
            if m:
                self.url = m.group(1)
                break
            self._check_alive(deadline)
            time.sleep(0.05)
        while True:
            try:
                r = httpx.get(self.url + "/health", timeout=5)
                self.health_seen.append((r.status_code, r.json().get("status")))
                if r.status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            self._check_alive(deadline)
            time.sleep(0.05)

    def _check_alive(self, deadline: float) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"met serve exited ({self.proc.returncode}):\n{self.log()}")
        if time.monotonic() > deadline:
            log = self.log()
            self.stop()
            raise RuntimeError(f"met serve not ready in time:\n{log}")

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics, keyed by name with its labels (as Prometheus prints)."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of ``name`` whose labels include ``labels``."""
        total = 0.0
        for key, value in self.metrics().items():
            base, _, rest = key.partition("{")
            if base == name and all(f'{k}="{v}"' in rest for k, v in labels.items()):
                total += value
        return total

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        Path(self._log.name).unlink(missing_ok=True)
        return self.proc.returncode


def wait_until(predicate, timeout: float = 30.0, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
