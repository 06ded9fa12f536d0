"""`met doctor`: one screen of checks; exit 1 with the fix when one fails."""

from __future__ import annotations

import json
import socket
import subprocess
import sys


def _doctor(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "met", "doctor", *args], capture_output=True,
                          text=True, timeout=300, check=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_doctor_reports_the_machine_and_passes_here():
    run = _doctor("--json", "--port", str(_free_port()))
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(run.stdout)
    assert report["ok"]
    checks = report["checks"]
    names = {c["name"] for c in checks}
    assert {"gguf_blocks", "decode_attention", "embedded model", "speculative decoding"} <= names
    spec = next(c for c in checks if c["name"] == "speculative decoding")
    assert all(m in spec["detail"] for m in ("ngram", "suffix", "draft_model", "self"))
    assert any("avx2" in json.dumps(c).lower() for c in checks)
    assert not [c for c in checks if c["status"] not in ("ok", "info")]


def test_a_taken_port_fails_with_what_to_do():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = _doctor("--json", "--port", str(port))
    assert run.returncode == 1
    report = json.loads(run.stdout)
    assert not report["ok"]
    failed = [c for c in report["checks"] if c["name"].startswith("port")]
    assert failed and str(port) in json.dumps(failed) and all(c["fix"] for c in failed)
