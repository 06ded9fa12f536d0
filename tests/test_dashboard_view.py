"""The serve dashboard's screen and the startup banner, rendered from a Snapshot into a
recording console (no server): what a person reads at a given terminal size."""

from __future__ import annotations

import io
import re

import pytest
from rich.console import Console

import met
from met.cli.dashboard_view import banner, banner_text, dashboard
from met.cli.live_stats import LiveRequest, Snapshot


def snapshot(**changes) -> Snapshot:
    base = dict(
        state="ready", model="SmolLM2-135M-Instruct", root="/models/SmolLM2.Q4_1.gguf",
        dtype="bfloat16", quantization="w4a8", device="cpu",
        kernels={"linear": "w4a8-vnni", "attention": "cpu-native", "cpu_isa": "avx512-vnni"},
        url="http://127.0.0.1:8888", auth="off", uptime_s=75.0, running=3, waiting=2,
        finished=12345, failed=1, aborted=4, decode_tps=1233.8, prompt_tps=12345.6,
        decode_history=(1.0, 2.0, 3.0) * 20, prompt_history=(3.0, 1.0) * 30,
        ttft=(0.4302, 1.2458), tpot=(0.0123, 0.105), kv_used=1234, kv_total=5678,
        prefix_hit_rate=0.62, preemptions=7,
        live=tuple(LiveRequest(f"req{i:02d}-0123456789abcdef", "127.0.0.1:50123", "decoding",
                               39, 95, 35.3, 2.0) for i in range(10)))
    base.update(changes)
    return Snapshot(**base)


def render(renderable, width: int, height: int) -> str:
    console = Console(width=width, height=height, file=io.StringIO(), record=True,
                      force_terminal=False, color_system=None)
    console.print(renderable)
    return console.export_text()


LOG = [f"INFO met.api: log line {i}" for i in range(40)]


@pytest.mark.parametrize("width,height", [(80, 24), (100, 30), (160, 48)])
def test_every_number_is_readable_at_common_terminal_sizes(width, height):
    screen = render(dashboard(snapshot(), LOG), width, height)
    lines = screen.splitlines()
    assert len(lines) == height  # the screen, no more: nothing scrolls the header away
    assert all(len(line) <= width for line in lines)
    flat = re.sub(r"\s+", " ", screen)
    for shown in ("1,233.8 tok/s", "12,345.6 tok/s", "430 / 1,246 ms", "12.3 / 105 ms",
                  "KV blocks 1,234 / 5,678", "in use 22%", "prefix hits 62%", "preemptions 7",
                  "running 3", "waiting 2", "finished 12,345", "failed 1", "aborted 4"):
        assert shown in flat, f"{shown!r} is not whole on a {width}x{height} screen:\n{screen}"
    assert "SmolLM2-135M-Instruct" in screen
    assert "http://127.0.0.1:8888/v1" in screen and "web chat http://127.0.0.1:8888/" in screen
    assert "q or Ctrl-C: drain in-flight requests and exit" in screen
    assert "live requests (10)" in screen
    # The live list gets what the screen spares and says how many it left out; the log
    # keeps its newest line.
    rows = len(re.findall(r"req\d\d-0123456789", screen))
    assert 1 <= rows < 10 and f"… {10 - rows} more" in screen
    assert "log line 39" in screen


def test_a_short_live_list_is_shown_whole():
    snap = snapshot(live=snapshot().live[:2])
    screen = render(dashboard(snap, LOG), 100, 30)
    assert "req00-0123456789" in screen and "req01-0123456789" in screen
    assert "more" not in screen


def test_brackets_in_names_are_shown_as_written():
    """A model path or name is text, never rich markup (which ate "[bold]...[/bold]")."""
    snap = snapshot(model="my[model]", root="/srv/[bold]models[/bold]/m.gguf")
    box = render(banner(snap, 1.0), 200, 20)
    assert "/srv/[bold]models[/bold]/m.gguf" in box and "my[model]" in box
    assert "/srv/[bold]models[/bold]/m.gguf" in banner_text(snap, 1.0)


def test_banner_fields_in_the_box_and_in_plain_lines():
    snap = snapshot(auth="on (2 API keys)")
    plain = banner_text(snap, 3.25, note="listening on every interface")
    lines = plain.splitlines()
    assert lines[0].startswith(f"met {met.__version__} ready in 3.2 s")
    fields = dict(re.match(r"  (\S+(?: \S+)?)\s{2,}(.*)", line).groups() for line in lines[1:])
    assert fields["API"].startswith("http://127.0.0.1:8888/v1")
    assert fields["Web chat"].startswith("http://127.0.0.1:8888/ ")  # with auth: a hint
    assert "without a key" in fields["Web chat"]
    assert fields["Model"] == "SmolLM2-135M-Instruct  /models/SmolLM2.Q4_1.gguf"
    assert fields["Device"].startswith("cpu · bfloat16 · quantization w4a8")
    assert fields["Auth"] == "on (2 API keys)"
    assert fields["Note"] == "listening on every interface"
    box = render(banner(snap, 3.25, note="listening on every interface"), 200, 20)
    for value in fields.values():
        assert value in box
    off = banner_text(snapshot(), None)
    assert "Auth      off (anyone who can reach the port" in off
    assert "Web chat  http://127.0.0.1:8888/\n" in off  # no key hint without auth
