"""`met serve`'s live dashboard in a real terminal: tmux (a private server, a 160x48 pane)
runs the embedded model while real chat completions flow; the screen is read with
`capture-pane`. `q` drains the request in flight and exits 0, leaving no process behind.
With stdout piped inside the same terminal the plain log and its banner appear instead."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from serve_harness import REPO, wait_until

import met

pytestmark = pytest.mark.slow

TMUX = shutil.which("tmux")
MODEL = "SmolLM2-135M-Instruct"
WIDTH, HEIGHT = 160, 48
ARGS = ["--max-model-len", "1024", "--kv-cache-memory", "32MiB", "--max-num-seqs", "4"]


def serve_command(port: int) -> str:
    return shlex.join([sys.executable, "-m", "met.cli", "serve", "--port", str(port), *ARGS])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Tmux:
    """One detached session on a private tmux server (never the user's). The pane runs a
    shell line that prints `met-exit-status=N` when met serve exits (tmux's own
    pane_dead_status is sometimes never filled in), and stays after it so it can be read."""

    def __init__(self, tmp_path: Path, name: str):
        self.socket = f"met-test-{os.getpid()}-{name}"
        self.session = name
        self.conf = tmp_path / "tmux.conf"
        self.conf.write_text("set -g remain-on-exit on\nset -g history-limit 10000\n")
        self.socket_path: Path | None = None

    def __call__(self, *args: str, env: dict[str, str] | None = None) -> str:
        return subprocess.run([TMUX, "-L", self.socket, "-f", str(self.conf), *args],
                              capture_output=True, text=True, check=True, timeout=30,
                              env=env).stdout

    def start(self, command: str) -> None:
        env = {k: v for k, v in os.environ.items() if k != "TMUX"}
        env["PYTHONPATH"] = os.pathsep.join(
            [str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        self("new-session", "-d", "-s", self.session, "-x", str(WIDTH), "-y", str(HEIGHT),
             "-c", str(REPO), command, env=env)
        self.socket_path = Path(self.pane("#{socket_path}"))

    def screen(self, history: bool = False) -> str:
        return self("capture-pane", "-p", "-t", self.session, *(["-S", "-"] if history else []))

    def pane(self, fmt: str) -> str:
        return self("display-message", "-p", "-t", self.session, fmt).strip()

    def exit_status(self) -> int | None:
        """met serve's exit status once it has exited, else None."""
        m = re.search(r"met-exit-status=(\d+)", self.screen(history=True))
        return int(m.group(1)) if m else None

    def exited(self) -> bool:
        return self.exit_status() is not None

    def server_pid(self) -> int:
        """The met serve process below the pane's shell."""
        found = [p for p in descendants(int(self.pane("#{pane_pid}")))
                 if Path(f"/proc/{p}/cmdline").read_text(errors="replace").split("\0")[1:3]
                 == ["-m", "met.cli"]]
        assert len(found) == 1, found
        return found[0]

    def wait_screen(self, pattern: str, timeout: float = 30.0) -> str:
        """The screen once ``pattern`` (a regex) is on it; fails with the screen if not."""
        deadline = time.monotonic() + timeout
        while True:
            text = self.screen()
            if re.search(pattern, text):
                return text
            if time.monotonic() > deadline:
                pytest.fail(f"{pattern!r} not on the screen in {timeout:.0f} s:\n{text}")
            time.sleep(0.2)

    def close(self) -> None:
        subprocess.run([TMUX, "-L", self.socket, "kill-server"], capture_output=True,
                       timeout=30)
        if self.socket_path is not None:  # kill-server leaves its socket file behind
            self.socket_path.unlink(missing_ok=True)


@pytest.fixture
def tmux(tmp_path, request):
    if TMUX is None:
        pytest.fail("tmux is not installed (apt-get install -y tmux): the dashboard needs "
                    "a real terminal to be tested in")
    t = Tmux(tmp_path, request.node.name.replace("[", "-").rstrip("]")[:40])
    yield t
    t.close()


def wait_healthy(url: str, tmux: Tmux, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if tmux.exited():
            pytest.fail(f"met serve exited before ready:\n{tmux.screen(history=True)}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    pytest.fail(f"met serve not ready in {timeout:.0f} s:\n{tmux.screen(history=True)}")


def chat(url: str, max_tokens: int = 8) -> dict:
    r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


class Stream(threading.Thread):
    """A streamed chat completion of exactly ``max_tokens`` tokens (ignore_eos), read in the
    background; ``first`` is set on its first content chunk."""

    def __init__(self, url: str, request_id: str, max_tokens: int):
        super().__init__(daemon=True)
        self.url, self.request_id, self.max_tokens = url, request_id, max_tokens
        self.first = threading.Event()
        self.chunks: list[dict] = []
        self.done = False  # saw "data: [DONE]"
        self.error: BaseException | None = None

    def run(self) -> None:
        body = {"model": MODEL, "stream": True, "stream_options": {"include_usage": True},
                "messages": [{"role": "user", "content": "Tell me a long story."}],
                "max_tokens": self.max_tokens, "ignore_eos": True, "temperature": 0}
        try:
            with httpx.stream("POST", self.url + "/v1/chat/completions", json=body,
                              headers={"x-request-id": self.request_id}, timeout=180) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        self.done = True
                    elif line.startswith("data: "):
                        chunk = json.loads(line[6:])
                        self.chunks.append(chunk)
                        if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                            self.first.set()
        except BaseException as e:  # reported by assert_complete
            self.error = e
        finally:
            self.first.set()

    def assert_complete(self) -> None:
        """Ended as a finished request does: every token, finish_reason, usage, [DONE]."""
        self.join(180)
        assert self.error is None, repr(self.error)
        assert not any("error" in c for c in self.chunks), self.chunks[-3:]
        reasons = [c["choices"][0]["finish_reason"] for c in self.chunks
                   if c.get("choices") and c["choices"][0].get("finish_reason")]
        assert reasons == ["length"], self.chunks[-3:]
        usage = [c["usage"] for c in self.chunks if c.get("usage")]
        assert usage and usage[-1]["completion_tokens"] == self.max_tokens
        assert self.done


def number(pattern: str, text: str) -> float:
    m = re.search(pattern, text)
    assert m, f"{pattern!r} not on the screen:\n{text}"
    return float(m.group(1).replace(",", ""))


def descendants(pid: int) -> set[int]:
    """``pid`` and every process below it (Linux /proc)."""
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        out.add(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
    return out


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_dashboard_shows_live_traffic_and_q_drains(tmux):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    tmux.start(f"{serve_command(port)}; echo met-exit-status=$?")
    wait_healthy(url, tmux)
    pid = tmux.server_pid()
    screen = tmux.wait_screen(r"live requests \(0\)")
    assert tmux.pane("#{alternate_on}") == "1"  # the dashboard owns the screen
    assert MODEL in screen
    assert f"{url}/v1" in screen and f"web chat {url}/" in screen and "auth off" in screen
    assert re.search(r"\bready\b", screen)
    assert number(r"finished\s+(\d+)", screen) == 0
    kv_total = number(r"KV blocks\s+[\d,]+ / ([\d,]+)", screen)
    metrics = httpx.get(url + "/metrics", timeout=10).text
    pool = re.search(r"^met_kv_blocks_total(?:{[^}]*})? (\S+)", metrics, re.M)
    assert pool and kv_total == float(pool.group(1)) > 0

    # Three finished requests: the counts follow.
    for _ in range(3):
        chat(url)
    screen = tmux.wait_screen(r"finished\s+3\b", timeout=10)
    assert number(r"running\s+(\d+)", screen) == 0
    assert number(r"failed\s+(\d+)", screen) == 0

    # A long stream: it is listed while it runs, and speeds and KV use show it.
    long = Stream(url, "dash-long-stream-01", max_tokens=160)
    long.start()
    assert long.first.wait(60) and long.error is None, long.error
    screen = tmux.wait_screen(r"dash-long-stream.*decoding", timeout=10)
    row = next(line for line in screen.splitlines() if "dash-long-stream" in line)
    assert "127.0.0.1:" in row  # the client's address
    assert "live requests (1)" in screen and number(r"running\s+(\d+)", screen) == 1
    screen = tmux.wait_screen(r"decode\s+[1-9][\d,]*\.\d tok/s", timeout=10)
    assert number(r"KV blocks\s+([\d,]+) /", screen) > 0
    assert re.search(r"TTFT\s+[\d,.]+ / [\d,.]+ ms", screen), screen
    chat(url)  # one more while the stream runs: two ran at once
    long.assert_complete()
    screen = tmux.wait_screen(r"finished\s+5\b", timeout=10)
    assert "live requests (0)" in screen

    # q while a stream is in flight: it finishes whole, then the server exits 0.
    procs = descendants(pid)
    last = Stream(url, "dash-drained-0001", max_tokens=64)
    last.start()
    assert last.first.wait(60) and last.error is None, last.error
    tmux("send-keys", "-t", tmux.session, "q")
    screen = tmux.wait_screen(r"draining", timeout=10)
    last.assert_complete()
    assert wait_until(tmux.exited, timeout=60), tmux.screen(history=True)
    assert tmux.exit_status() == 0, tmux.screen(history=True)
    assert not [p for p in procs if alive(p)], "processes left behind"
    with pytest.raises(httpx.TransportError):
        httpx.get(url + "/health", timeout=5)
    # Back on the normal screen: the startup lines, one banner, the stop line.
    after = tmux.screen(history=True)
    assert tmux.pane("#{alternate_on}") == "0"
    assert after.count(f"met {met.__version__} ready in") == 1, after
    assert f"Web chat  {url}/" in after and "Auth      off" in after, after
    assert "met: stopped (6 requests finished)" in after, after


def test_piped_stdout_in_a_terminal_keeps_the_plain_log(tmux):
    """`met serve | cat` at a terminal: stdout is a pipe, so no dashboard; the log (on the
    terminal's stderr) ends with the plain banner."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    tmux.start(f"({serve_command(port)}; echo met-exit-status=$? >&2) | cat")
    wait_healthy(url, tmux)
    chat(url)
    screen = tmux.wait_screen(r"Auth\s+off", timeout=15)
    assert tmux.pane("#{alternate_on}") == "0"
    assert f"INFO met.cli: met {met.__version__} ready in" in screen
    assert f"API       {url}/v1" in screen and f"Web chat  {url}/" in screen
    assert "live requests" not in screen and "╭" not in screen, screen
    os.kill(tmux.server_pid(), signal.SIGTERM)
    assert wait_until(tmux.exited, timeout=60), tmux.screen(history=True)
    assert tmux.exit_status() == 0, tmux.screen(history=True)
