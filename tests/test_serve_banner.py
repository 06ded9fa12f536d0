"""`met serve` with stdout piped (CI, systemd, `| tee`): the plain log shows the load's
progress and ends with one banner (URL, model, device, auth state, web chat address); an
API key is never printed, whatever the server logs."""

from __future__ import annotations

import re
import secrets
import signal

import httpx
import pytest
from serve_harness import ServerProcess, wait_until

import met

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
ARGS = ["--max-model-len", "512", "--kv-cache-memory", "16MiB", "--max-num-seqs", "2"]
TITLE = f"met {met.__version__} ready in "
# Startup lines the banner must follow: the engine's progress, then the bound address.
PROGRESS = ("loading the embedded model", "kernels: linear", "loaded ", "memory: weights",
            "met: ready in", "Uvicorn running on")


def run_and_stop(args: list[str], key: str | None) -> tuple[str, str, int]:
    """Start `met serve ARGS` (stdout to a file), wait for the banner, send a few requests
    (with the right key, a wrong one and none when ``key``), stop it with SIGTERM; (its
    whole output, its URL, its exit status)."""
    server = ServerProcess(args, env={"MET_API_KEY": ""})
    try:
        server.wait_ready()
        assert wait_until(lambda: "  Auth " in server.log(), timeout=15), server.log()
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 4}
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        r = httpx.post(server.base_url + "/chat/completions", json=body, headers=headers,
                       timeout=60)
        assert r.status_code == 200, r.text
        if key:
            for wrong in ({"Authorization": "Bearer not-the-key"}, {}):
                r = httpx.post(server.base_url + "/chat/completions", json=body,
                               headers=wrong, timeout=60)
                assert r.status_code == 401
        server.proc.send_signal(signal.SIGTERM)
        rc = server.proc.wait(60)
        return server.log(), server.url, rc
    finally:
        server.stop()


def banner_fields(log: str) -> tuple[int, dict[str, str]]:
    """(the banner title's line number, {label: value}) of the one banner in ``log``."""
    lines = log.splitlines()
    titles = [i for i, line in enumerate(lines) if TITLE in line]
    assert len(titles) == 1, f"expected one banner, got {len(titles)}:\n{log}"
    fields = {}
    for line in lines[titles[0] + 1:]:
        m = re.match(r"  (\S+(?: \S+)?)\s{2,}(.*)$", line)
        if not m:
            break
        fields[m.group(1)] = m.group(2)
    return titles[0], fields


@pytest.mark.parametrize("auth", ["off", "on"])
def test_piped_startup_shows_progress_then_one_banner(auth):
    key = f"met-test-key-{secrets.token_hex(12)}" if auth == "on" else None
    # --log-requests: even the request log must not print the key.
    args = ARGS + (["--api-key", key, "--log-requests"] if key else [])
    log, url, rc = run_and_stop(args, key)
    assert rc == 0, log
    lines = log.splitlines()
    at, fields = banner_fields(log)
    for progress in PROGRESS:
        seen = [i for i, line in enumerate(lines) if progress in line]
        assert seen, f"no {progress!r} line before the banner:\n{log}"
        assert max(seen) < at, f"{progress!r} after the banner:\n{log}"
    assert fields["API"].startswith(f"{url}/v1 "), fields  # the bound port, not "0"
    assert fields["Web chat"].split()[0] == f"{url}/", fields
    assert fields["Model"].startswith(MODEL), fields
    assert re.match(r"(cpu|cuda(:\d+)?) · ", fields["Device"]), fields
    if key:
        assert fields["Auth"] == "on (1 API key)", fields
        assert "without a key" in fields["Web chat"]
        assert key not in log, "the API key was printed"
    else:
        assert fields["Auth"].startswith("off"), fields
    # A pipe gets the plain log: no terminal escapes, no dashboard or boxes.
    assert "\x1b[" not in log and "╭" not in log and "live requests" not in log, log
