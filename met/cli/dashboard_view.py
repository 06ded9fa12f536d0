"""The serve dashboard's screen and the startup banner, drawn with rich from a Snapshot.

Pure functions of their inputs, so tests render them into a recording console."""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Console, ConsoleOptions, Group, RenderResult
from rich.layout import Layout
from rich.measure import Measurement
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

import met
from met.cli.live_stats import Snapshot

_BARS = "▁▂▃▄▅▆▇█"
_STATE_STYLE = {"ready": "bold green", "loading": "yellow", "draining": "bold yellow",
                "faulted": "bold red", "stopped": "red"}


def sparkline(values: Sequence[float], width: int = 30) -> str:
    """The last ``width`` values as block characters, scaled to their maximum."""
    values = list(values)[-width:]
    top = max(values, default=0.0)
    if top <= 0:
        return _BARS[0] * len(values)
    return "".join(_BARS[min(len(_BARS) - 1, int(v / top * (len(_BARS) - 1) + 0.5))]
                   for v in values)


def duration(seconds: float) -> str:
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    return f"{s // 3600}h {s % 3600 // 60:02d}m"


def _ms(pair: tuple[float, float] | None) -> str:
    return "-" if pair is None else f"{pair[0] * 1e3:,.1f} / {pair[1] * 1e3:,.1f} ms"


def web_chat_url(url: str) -> str:
    return url.rstrip("/") + "/"


def kernels_line(snap: Snapshot) -> str:
    k = snap.kernels
    if not k:
        return "kernels: (deciding at load)"
    return (f"linear {k.get('linear', '?')} · attention {k.get('attention', '?')} · "
            f"ISA {k.get('cpu_isa', '?')}")


def banner(snap: Snapshot, load_s: float | None, note: str = "") -> Panel:
    """One box that says where the server is and what it runs."""
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    grid.add_row("API", f"{snap.url}/v1  (OpenAI + Anthropic)")
    grid.add_row("Web chat", web_chat_url(snap.url))
    grid.add_row("Model", f"{snap.model}  [dim]{snap.root}[/]")
    grid.add_row("Device", f"{snap.device} · {snap.dtype} · quantization {snap.quantization}"
                           f" · {kernels_line(snap)}")
    grid.add_row("Auth", snap.auth if snap.auth != "off"
                 else "off (anyone who can reach the port may use it; --api-key to require one)")
    if note:
        grid.add_row("Note", note)
    took = f" in {load_s:.1f} s" if load_s is not None else ""
    return Panel(grid, title=f"[bold green]met {met.__version__} ready{took}[/]",
                 title_align="left", subtitle="Ctrl-C drains and stops", subtitle_align="right",
                 border_style="green", expand=False)


class Spark:
    """A sparkline as wide as the space it is given (the newest values at the right)."""

    def __init__(self, values: Sequence[float], style: str):
        self.values, self.style = values, style

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield Text(sparkline(self.values, options.max_width), style=self.style, no_wrap=True)

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        return Measurement(1, max(1, len(self.values)))


class LogTail:
    """The newest log lines that fit the height it is given (never wrapped)."""

    def __init__(self, lines: Sequence[str]):
        self.lines = lines

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        height = options.height or 10
        for line in list(self.lines)[-height:]:
            yield Text(line, no_wrap=True, overflow="ellipsis", style=_log_style(line))


def _log_style(line: str) -> str:
    if line.startswith(("ERROR", "CRITICAL")):
        return "red"
    if line.startswith("WARNING"):
        return "yellow"
    return ""


def _header(snap: Snapshot) -> Panel:
    state = Text(snap.state, style=_STATE_STYLE.get(snap.state, ""))
    top = Text.assemble((f"met {met.__version__}", "bold"), "  ", (snap.model, "bold cyan"),
                        "  ", state, f"  up {duration(snap.uptime_s)}")
    where = Text.assemble(f"{snap.url}/v1", "  web chat ", web_chat_url(snap.url),
                          "  auth ", (snap.auth, "green" if snap.auth != "off" else "yellow"))
    what = Text(f"{snap.device or '-'} · {snap.dtype or '-'} · quantization "
                f"{snap.quantization or '-'} · {kernels_line(snap)}")
    hint = Text("q or Ctrl-C: drain in-flight requests and exit", style="dim")
    return Panel(Group(top, where, what, hint), border_style="cyan")


def _stats(snap: Snapshot) -> Table:
    grid = Table.grid(expand=True, padding=(0, 1))
    for _ in range(3):
        grid.add_column(ratio=1)
    requests = Table.grid(padding=(0, 1))
    for name, value, style in (("running", snap.running, "bold"),
                               ("waiting", snap.waiting, ""),
                               ("finished", snap.finished, "green"),
                               ("failed", snap.failed, "red" if snap.failed else ""),
                               ("aborted", snap.aborted, "")):
        requests.add_row(name, Text(str(value), style=style))
    speed = Table.grid(padding=(0, 1))
    speed.add_row("decode", f"{snap.decode_tps:8.1f} tok/s", Spark(snap.decode_history, "green"))
    speed.add_row("prompt", f"{snap.prompt_tps:8.1f} tok/s", Spark(snap.prompt_history, "blue"))
    speed.add_row("TTFT", "p50/p99", _ms(snap.ttft))
    speed.add_row("TPOT", "p50/p99", _ms(snap.tpot))
    cache = Table.grid(padding=(0, 1))
    pct = 100.0 * snap.kv_used / snap.kv_total if snap.kv_total else 0.0
    cache.add_row("KV blocks", f"{snap.kv_used:,} / {snap.kv_total:,} ({pct:.0f}%)")
    cache.add_row("prefix hits", "-" if snap.prefix_hit_rate is None
                  else f"{100.0 * snap.prefix_hit_rate:.0f}%")
    cache.add_row("preemptions", str(snap.preemptions))
    grid.add_row(Panel(requests, title="requests", title_align="left"),
                 Panel(speed, title="throughput and latency", title_align="left"),
                 Panel(cache, title="KV cache", title_align="left"))
    return grid


def _live_table(snap: Snapshot, rows: int) -> Table:
    t = Table(expand=True, box=None, header_style="bold", pad_edge=False)
    for name, justify in (("request", "left"), ("client", "left"), ("state", "left"),
                          ("prompt", "right"), ("tokens", "right"), ("tok/s", "right"),
                          ("age", "right")):
        t.add_column(name, justify=justify, no_wrap=True)
    for r in snap.live[:rows]:
        t.add_row(r.id[:16], r.client, r.state, str(r.prompt_tokens), str(r.tokens),
                  f"{r.tok_s:.1f}", duration(r.age_s))
    if len(snap.live) > rows:
        t.add_row(f"… {len(snap.live) - rows} more", "", "", "", "", "", "")
    return t


def dashboard(snap: Snapshot, log_lines: Sequence[str], max_live_rows: int = 8) -> Layout:
    """The whole screen: header, stats, live requests, then the log filling the rest."""
    rows = min(len(snap.live), max_live_rows) + (len(snap.live) > max_live_rows)
    layout = Layout()
    layout.split_column(
        Layout(_header(snap), name="header", size=6),
        Layout(_stats(snap), name="stats", size=7),
        Layout(Panel(_live_table(snap, max_live_rows),
                     title=f"live requests ({len(snap.live)})", title_align="left"),
               name="live", size=max(rows, 1) + 3),
        Layout(Panel(LogTail(log_lines), title="log", title_align="left", border_style="dim"),
               name="log", ratio=1),
    )
    return layout
