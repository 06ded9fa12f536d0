"""A `met serve` subprocess for a gate: a free port, pinned settings, always stopped."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

SERVED_NAME = "bench"


def serve_flags(settings: dict[str, Any]) -> list[str]:
    """``{"dtype": "float32", "no-enable-prefix-caching": true}`` → CLI flags. ``true`` is a
    bare flag; ``false`` and absent keys are left out."""
    flags: list[str] = []
    for key, value in settings.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is not False and value is not None:
            flags += [flag, str(value)]
    return flags


class ManagedServer:
    """``python -m met.cli serve MODEL FLAGS --port 0``. Use as a context manager: the exit
    stops the process (SIGTERM, then SIGKILL) whatever happened inside."""

    def __init__(self, model: str | None, settings: dict[str, Any], ready_timeout: float = 600,
                 env: dict[str, str] | None = None):
        self.model = model
        self.env = dict(env or {})
        self.ready_seconds: float | None = None  # launch to /health 200
        self.settings = dict(settings)
        self.ready_timeout = ready_timeout
        self.argv = [sys.executable, "-m", "met.cli", "serve",
                     *([model] if model else []), *serve_flags(self.settings),
                     "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", "0"]
        self.url = ""
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: Any = None

    def log(self) -> str:
        if self._log is None:
            return ""
        path = Path(self._log.name)
        return path.read_text(errors="replace") if path.exists() else ""

    def start(self) -> ManagedServer:
        self._log = tempfile.NamedTemporaryFile("w+", prefix="met-bench-serve-", suffix=".log",
                                                delete=False)
        env = dict(os.environ)
        repo = str(Path(__file__).resolve().parents[2])  # this checkout's met, not another
        env["PYTHONPATH"] = os.pathsep.join([repo, *filter(None, [env.get("PYTHONPATH")])])
        env.update(self.env)
        started = time.monotonic()
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=env, start_new_session=True)
        self._wait_ready()
        self.ready_seconds = round(time.monotonic() - started, 2)
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout
        while not self.url:
            m = re.search(r"Uvicorn running on (http://[\d.]+:\d+)", self.log())
            if m:
                self.url = m.group(1)
            else:
                self._check(deadline)
                time.sleep(0.1)
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            self._check(deadline)
            time.sleep(0.1)

    def _check(self, deadline: float) -> None:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"met serve exited ({self.proc.returncode}):\n{self.log()[-4000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"met serve not ready in {self.ready_timeout:.0f}s:\n"
                               f"{self.log()[-4000:]}")

    def metric(self, name: str) -> float | None:
        """The sum of ``name``'s samples on /metrics, whatever their labels (None if it is
        absent or the server does not answer)."""
        try:
            text = httpx.get(self.url + "/metrics", timeout=10).text
        except httpx.HTTPError:
            return None
        found = None
        for line in text.splitlines():
            key, _, value = line.rpartition(" ")
            if key == name or key.startswith(name + "{"):
                found = (found or 0.0) + float(value)
        return found

    def stop(self) -> int | None:
        """SIGTERM (drain), SIGKILL after 30 s; removes the log file."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self._log is not None:
            self._log.close()
            Path(self._log.name).unlink(missing_ok=True)
            self._log = None
        return None if self.proc is None else self.proc.returncode

    def __enter__(self) -> ManagedServer:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()
