"""`met chat` as a person uses it: input parsing, commands, and both backends end to end
(in-process and --url against a real `met serve`), greedy so the replies are comparable."""

from __future__ import annotations

import io
import json
import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from met.cli.chat import ChatSession, read_message
from met.cli.chat_backends import ChatError, Remote, Reply, _sse_texts

REPO = Path(__file__).resolve().parents[1]
FLAGS = ["--temperature", "0", "--max-tokens", "12", "--dtype", "float32",
         "--quantization", "none"]


def lines(*items: str):
    it = iter(items)

    def read(prompt: str) -> str:
        try:
            return next(it)
        except StopIteration:
            raise EOFError from None

    return read


def test_multiline_input_backslash_and_triple_quotes():
    assert read_message(lines("one line")) == "one line"
    assert read_message(lines("first \\", "second\\", "third")) == "first \nsecond\nthird"
    assert read_message(lines('"""', "a", "", "b", '"""')) == "a\n\nb"
    assert read_message(lines('"""start', "end"'"""')) == "start\nend"
    assert read_message(lines('"""just one"""')) == "just one"
    assert read_message(lines('"""', "never closed")) == "never closed"  # EOF sends it
    with pytest.raises(EOFError):
        read_message(lines())


class FakeBackend:
    model = "fake"
    where = "test"

    def __init__(self, fail: bool = False):
        self.seen: list[list[dict]] = []
        self.fail = fail

    def stream(self, messages, params, reply: Reply):
        self.seen.append([dict(m) for m in messages])
        if self.fail:
            raise ChatError("context full; /reset")
        for piece in ("hel", "lo"):
            reply.tokens += 1
            reply.text += piece
            yield piece
        reply.finish_reason = "stop"


def session(backend) -> tuple[ChatSession, io.StringIO, io.StringIO]:
    out, err = io.StringIO(), io.StringIO()
    return ChatSession(backend, None, None, out, err), out, err


def test_history_system_reset_save_and_load(tmp_path):
    backend = FakeBackend()
    chat, out, err = session(backend)
    saved = tmp_path / "c.json"
    chat.loop(lines("/system Be brief.", "hi", "again", f"/save {saved}", "/reset", "after",
                    "/system", "bare", f"/load {saved}", "/history", "/exit", "never read"))
    assert backend.seen[0] == [{"role": "system", "content": "Be brief."},
                               {"role": "user", "content": "hi"}]
    assert backend.seen[1][-3:] == [{"role": "user", "content": "hi"},
                                    {"role": "assistant", "content": "hello"},
                                    {"role": "user", "content": "again"}]
    assert backend.seen[2] == [{"role": "system", "content": "Be brief."},  # reset keeps it
                               {"role": "user", "content": "after"}]
    assert backend.seen[3][0] == {"role": "user", "content": "after"}  # /system cleared it
    assert len(backend.seen) == 4  # "/exit" stopped before "never read"
    doc = json.loads(saved.read_text())
    assert doc["model"] == "fake" and len(doc["messages"]) == 5
    assert chat.system == "Be brief." and len(chat.history) == 4  # as loaded
    assert "[system] Be brief." in out.getvalue()
    assert "hello\n" in out.getvalue()
    assert "saved 5 messages" in err.getvalue() and "conversation cleared" in err.getvalue()


def test_a_failed_turn_is_dropped_and_explained():
    chat, _, err = session(FakeBackend(fail=True))
    chat.loop(lines("hi", "/nope"))
    assert chat.history == []
    assert "context full; /reset" in err.getvalue()
    assert "unknown command /nope" in err.getvalue()


def test_stream_parsing_and_server_errors():
    reply = Reply()
    frames = ['data: {"choices":[{"delta":{"role":"assistant"}}]}',
              'data: {"choices":[{"delta":{"content":"Hi"}}]}', "",
              'data: {"choices":[{"delta":{"content":" there"},"finish_reason":"stop"}]}',
              'data: {"choices":[],"usage":{"completion_tokens":2}}', "data: [DONE]"]
    assert "".join(_sse_texts(iter(frames), reply)) == "Hi there"
    assert (reply.tokens, reply.finish_reason) == (2, "stop")
    with pytest.raises(ChatError, match="engine faulted"):
        list(_sse_texts(iter(['data: {"error":{"message":"engine faulted"}}']), Reply()))

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(401, json={"error": {"message": "invalid API key"}})

    remote = Remote("http://x:1", None, "m")
    remote.http = httpx.Client(transport=httpx.MockTransport(handler))
    with pytest.raises(ChatError, match="--api-key"):
        list(remote.stream([{"role": "user", "content": "x"}], _params(), Reply()))


def test_an_unreachable_server_is_a_clear_error():
    run = _chat(["--url", "http://127.0.0.1:9", *FLAGS], "hi\n")
    assert run.returncode == 1
    assert "cannot reach http://127.0.0.1:9/v1" in run.stderr


def _params():
    from met import SamplingParams

    return SamplingParams(max_tokens=4, temperature=0.0)


def _chat(args: list[str], stdin: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "met", "chat", *args], input=stdin,
                          capture_output=True, text=True, timeout=300, cwd=REPO, check=False,
                          env={**os.environ, "PYTHONPATH": str(REPO)})


def test_in_process_and_url_give_the_same_greedy_replies(tiny_checkpoint, start_server,
                                                          tmp_path):
    """The same two-turn conversation through a pipe: in this process, then through a
    served model's OpenAI API (streaming, with an API key); /save holds both turns."""
    ckpt = str(tiny_checkpoint("llama"))
    saved = tmp_path / "chat.json"
    talk = f"hello world\nand \\\nmore\n/save {saved}\n"
    local = _chat([ckpt, *FLAGS, "--max-model-len", "256"], talk)
    assert local.returncode == 0, local.stderr
    messages = json.loads(saved.read_text())["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
    assert messages[1]["content"] and messages[3]["content"]
    assert local.stdout == messages[1]["content"] + "\n" + messages[3]["content"] + "\n"
    assert messages[2]["content"] == "and \nmore"
    assert "12 tokens" in local.stderr

    server = start_server([ckpt, "--dtype", "float32", "--max-model-len", "256",
                           "--api-key", "sekrit", "--served-model-name", "tiny"])
    remote = _chat(["--url", server.url, "--api-key", "sekrit", *FLAGS], talk)
    assert remote.returncode == 0, remote.stderr
    assert remote.stdout == local.stdout
    denied = _chat(["--url", server.url, "--api-key", "wrong", *FLAGS], "hi\n")
    assert "401" in denied.stderr and "--api-key" in denied.stderr


@pytest.mark.slow
def test_embedded_model_keeps_the_history_through_a_pty():
    """A terminal session with the embedded model: the prompt, a sensible answer, a follow-up
    that needs the first turn, and Ctrl-D to leave."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: `met chat` on the pty
        os.chdir(REPO)
        os.environ["PYTHONPATH"] = str(REPO)
        os.execv(sys.executable, [sys.executable, "-m", "met", "chat", *FLAGS,
                                  "--max-tokens", "24"])
    screen = _PtyReader(fd)
    try:
        screen.wait_for(">>> ", 240)
        assert "met chat — SmolLM2-135M-Instruct" in screen.text
        os.write(fd, b"What is the capital of France?\n")
        screen.wait_for("tok/s", 120)
        assert "Paris" in screen.text
        screen.wait_for(">>> ", 60, start=screen.text.index("tok/s"))
        os.write(fd, b'"""\nAnd of Italy?\nOne word.\n"""\n')
        second = screen.text.index("tok/s") + 5
        screen.wait_for("tok/s", 120, start=second)
        assert "Rome" in screen.text
        # Ctrl-D only once readline holds the terminal again: typed ahead while the tty is
        # still canonical it reaches readline as a NUL, not as end of input.
        screen.wait_for(">>> ", 60, start=screen.text.index("tok/s", second))
        os.write(fd, b"\x04")
        assert _exit_code(pid, 60) == 0
    finally:
        try:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


def _exit_code(pid: int, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.1)
    raise AssertionError(f"met chat did not exit within {timeout:.0f} s of Ctrl-D")


class _PtyReader:
    def __init__(self, fd: int):
        self.fd = fd
        self.text = ""

    def wait_for(self, needle: str, timeout: float, start: int = 0) -> None:
        deadline = time.monotonic() + timeout
        while needle not in self.text[start:]:
            if time.monotonic() > deadline:
                raise AssertionError(f"{needle!r} never came; the screen:\n{self.text}")
            ready, _, _ = select.select([self.fd], [], [], 0.2)
            if ready:
                try:
                    self.text += os.read(self.fd, 4096).decode(errors="replace")
                except OSError:
                    raise AssertionError(f"met chat exited; the screen:\n{self.text}") from None
