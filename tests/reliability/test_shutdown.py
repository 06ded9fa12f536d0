"""Graceful shutdown of a real `met serve` process: SIGTERM stops accepting connections,
lets in-flight requests finish within --shutdown-timeout, then ends the rest with an error
event, and the process exits 0."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest
from serve_harness import ServerProcess

# The embedded SmolLM2 (not the tiny model, which finishes 8 x 480 tokens within seconds on
# an idle machine): the long request needs tens of seconds anywhere, the short one a second
# or two even on a loaded machine.
SHUTDOWN_TIMEOUT_S = 10


def _events(lines) -> list[dict | str]:
    out: list[dict | str] = []
    for line in lines:
        if line.startswith("data: "):
            payload = line[6:]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


@pytest.fixture
def server():
    proc = ServerProcess(["--dtype", "float32", "--max-model-len", "512",
                          "--served-model-name", "tiny", "--max-num-seqs", "9",
                          "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)])
    yield proc.wait_ready()
    proc.stop()


@pytest.mark.slow
def test_sigterm_finishes_short_requests_errors_long_ones_and_exits_0(server):
    # Both run at once (9 seats): the short one needs a few more steps after the signal,
    # the long one hundreds, far more than the shutdown timeout allows on any machine.
    short = {"model": "tiny", "prompt": "The keeper", "max_tokens": 12, "ignore_eos": True,
             "stream": True}
    long = {**short, "max_tokens": 480, "n": 8}
    results: dict[str, list] = {}

    def run(name: str, body: dict, started: threading.Event) -> None:
        with httpx.stream("POST", server.url + "/v1/completions", json=body,
                          timeout=60) as r:
            lines = r.iter_lines()
            first = _events(next(lines) for _ in range(1))
            started.set()
            results[name] = first + _events(lines)

    starts = {name: threading.Event() for name in ("long", "short")}
    threads = [threading.Thread(target=run, args=(name, body, starts[name]))
               for name, body in (("long", long), ("short", short))]
    threads[0].start()
    assert starts["long"].wait(60)
    threads[1].start()
    assert starts["short"].wait(60)
    signalled = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)

    time.sleep(0.5)  # the listening socket is closed at once: new connections are refused
    with pytest.raises(httpx.TransportError):
        httpx.get(server.url + "/health", timeout=5)
    for t in threads:
        t.join(SHUTDOWN_TIMEOUT_S + 30)
    assert server.proc.wait(30) == 0
    assert time.monotonic() - signalled < SHUTDOWN_TIMEOUT_S + 20

    short_events = results["short"]
    assert short_events[-1] == "[DONE]"
    finished = [c["finish_reason"] for e in short_events[:-1] for c in e["choices"]
                if c["finish_reason"]]
    assert finished == ["length"]  # it ran to its end during the drain

    long_events = results["long"]
    assert long_events[-1] == "[DONE]"
    error = long_events[-2]["error"]
    assert "shutting down" in error["message"] and "--shutdown-timeout" in error["message"]
    assert error["type"] == "server_error"
    assert "draining" in server.log()
    assert "shutdown timeout: ended 8 in-flight request(s)" in server.log()  # long's choices
