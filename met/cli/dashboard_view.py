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


def _one_ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:,.0f}" if ms >= 100 else f"{ms:.1f}"


def _ms(pair: tuple[float, float] | None) -> str:
    return "-" if pair is None else f"{_one_ms(pair[0])} / {_one_ms(pair[1])} ms"


def web_chat_url(url: str) -> str:
    return url.rstrip("/") + "/"


def kernels_line(snap: Snapshot) -> str:
    k = snap.kernels
    if not k:
        return "kernels: (deciding at load)"
    return (f"linear {k.get('linear', '?')} · attention {k.get('attention', '?')} · "
            f"ISA {k.get('cpu_isa', '?')}")


def _auth_line(snap: Snapshot) -> str:
    # The snapshot's auth says "on (N API keys)" or "off": never a key.
    return snap.auth if snap.auth != "off" else \
        "off (anyone who can reach the port may use it; --api-key to require one)"


def banner_rows(snap: Snapshot, note: str = "") -> list[tuple[str, str]]:
    """The banner's (label, value) lines, shared by the terminal's box and the plain log."""
    rows = [("API", f"{snap.url}/v1  (OpenAI + Anthropic)"),
            ("Web chat", web_chat_url(snap.url) + ("  (the page loads without a key; type it in "
                                                   "its ⚙ settings)" if snap.auth != "off"
                                                   else "")),
            ("Model", f"{snap.model}  {snap.root}".rstrip()),
            ("Device", f"{snap.device} · {snap.dtype} · quantization {snap.quantization} · "
                       f"{kernels_line(snap)}"),
            ("Auth", _auth_line(snap))]
    if note:
        rows.append(("Note", note))
    return rows


def _banner_title(load_s: float | None) -> str:
    took = f" in {load_s:.1f} s" if load_s is not None else ""
    return f"met {met.__version__} ready{took}"


_BANNER_HINT = "Ctrl-C drains and stops"


def banner(snap: Snapshot, load_s: float | None, note: str = "") -> Panel:
    """One box that says where the server is and what it runs."""
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column()
    for label, value in banner_rows(snap, note):
        # Text, not markup: a model path or name with [brackets] is shown as it is.
        text = Text(value)
        if label == "Model" and snap.root:
            text = Text.assemble(snap.model, "  ", (snap.root, "dim"))
        grid.add_row(label, text)
    return Panel(grid, title=Text(_banner_title(load_s), style="bold green"),
                 title_align="left", subtitle=_BANNER_HINT, subtitle_align="right",
                 border_style="green", expand=False)


def banner_text(snap: Snapshot, load_s: float | None, note: str = "") -> str:
    """The banner as plain lines, for a log that is not a terminal."""
    rows = banner_rows(snap, note)
    width = max(len(label) for label, _ in rows)
    lines = [f"{_banner_title(load_s)} (Ctrl-C or SIGTERM drains and stops)"]
    lines += [f"  {label:<{width}}  {value}" for label, value in rows]
    return "\n".join(lines)


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


def _line(*parts, style: str = "") -> Text:
    """One header line: cut with an ellipsis rather than wrapped, so the header keeps its
    height (and its hint) in a narrow terminal."""
    text = Text.assemble(*parts, style=style)
    text.no_wrap, text.overflow = True, "ellipsis"
    return text


def _header(snap: Snapshot) -> Panel:
    top = _line((f"met {met.__version__}", "bold"), "  ", (snap.model, "bold cyan"), "  ",
                (snap.state, _STATE_STYLE.get(snap.state, "")), f"  up {duration(snap.uptime_s)}")
    where = _line(f"{snap.url}/v1", "  web chat ", web_chat_url(snap.url),
                  "  auth ", (snap.auth, "green" if snap.auth != "off" else "yellow"))
    what = _line(f"{snap.device or '-'} · {snap.dtype or '-'} · quantization "
                 f"{snap.quantization or '-'} · {kernels_line(snap)}")
    hint = _line("q or Ctrl-C: drain in-flight requests and exit", style="dim")
    return Panel(Group(top, where, what, hint), border_style="cyan")


def _pairs_panel(title: str, rows: list[tuple[str, str, str]],
                 justify: str = "left") -> tuple[Panel, int]:
    """A panel of (label, value, style) lines and the width that holds them unwrapped."""
    grid = Table.grid(padding=(0, 1))
    grid.add_column(no_wrap=True)
    grid.add_column(no_wrap=True, justify=justify)  # type: ignore[arg-type]
    for label, value, style in rows:
        grid.add_row(label, Text(value, style=style))
    inner = (max(len(label) for label, _, _ in rows) + 1
             + max(len(value) for _, value, _ in rows))
    return Panel(grid, title=title, title_align="left"), max(inner, len(title) + 3) + 4


def _stats(snap: Snapshot) -> Table:
    """Requests and KV cache as wide as their numbers; throughput takes the rest (its
    sparklines stretch), so no number is ever cut short."""
    requests, requests_w = _pairs_panel("requests", [
        ("running", f"{snap.running:,}", "bold"), ("waiting", f"{snap.waiting:,}", ""),
        ("finished", f"{snap.finished:,}", "green"),
        ("failed", f"{snap.failed:,}", "red" if snap.failed else ""),
        ("aborted", f"{snap.aborted:,}", "")], justify="right")
    pct = 100.0 * snap.kv_used / snap.kv_total if snap.kv_total else 0.0
    cache, cache_w = _pairs_panel("KV cache", [
        ("KV blocks", f"{snap.kv_used:,} / {snap.kv_total:,}", ""),
        ("in use", f"{pct:.0f}%", ""),
        ("prefix hits", "-" if snap.prefix_hit_rate is None
         else f"{100.0 * snap.prefix_hit_rate:.0f}%", ""),
        ("preemptions", f"{snap.preemptions:,}", "")])
    speed = Table.grid(padding=(0, 1), expand=True)
    speed.add_column(no_wrap=True)
    speed.add_column(no_wrap=True, justify="right")
    speed.add_column(no_wrap=True, ratio=1)
    speed.add_row("decode", f"{snap.decode_tps:,.1f} tok/s", Spark(snap.decode_history, "green"))
    speed.add_row("prompt", f"{snap.prompt_tps:,.1f} tok/s", Spark(snap.prompt_history, "blue"))
    speed.add_row("TTFT", _ms(snap.ttft), "")
    speed.add_row("TPOT", _ms(snap.tpot), "")
    grid = Table.grid(expand=True, padding=(0, 1))
    grid.add_column(width=requests_w, no_wrap=True)
    grid.add_column(ratio=1)
    grid.add_column(width=cache_w, no_wrap=True)
    grid.add_row(requests, Panel(speed, title="tok/s · latency p50/p99", title_align="left"),
                 cache)
    return grid


def _live_table(snap: Snapshot, rows: int) -> Table:
    t = Table(expand=True, box=None, header_style="bold", pad_edge=False)
    for name, justify in (("request", "left"), ("client", "left"), ("state", "left"),
                          ("prompt", "right"), ("tokens", "right"), ("tok/s", "right"),
                          ("age", "right")):
        t.add_column(name, justify=justify, no_wrap=True)
    shown = snap.live[:rows] if len(snap.live) <= rows else snap.live[:max(rows - 1, 0)]
    for r in shown:
        t.add_row(r.id[:16], r.client, r.state, str(r.prompt_tokens), str(r.tokens),
                  f"{r.tok_s:.1f}", duration(r.age_s))
    if len(shown) < len(snap.live):
        t.add_row(f"… {len(snap.live) - len(shown)} more", "", "", "", "", "", "")
    return t


_HEADER_H, _STATS_H, _LOG_MIN_H = 6, 7, 5  # the log keeps at least 3 lines


class Dashboard:
    """The whole screen: header, stats, live requests, then the log filling the rest. The
    live list gets the rows the screen can spare (its overflow becomes "… N more")."""

    def __init__(self, snap: Snapshot, log_lines: Sequence[str], max_live_rows: int = 8):
        self.snap, self.log_lines, self.max_live_rows = snap, log_lines, max_live_rows

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        height = options.height or console.height
        spare = height - _HEADER_H - _STATS_H - _LOG_MIN_H - 3  # 3: the live panel's frame
        rows = max(1, min(len(self.snap.live), self.max_live_rows, spare))
        layout = Layout()
        layout.split_column(
            Layout(_header(self.snap), name="header", size=_HEADER_H),
            Layout(_stats(self.snap), name="stats", size=_STATS_H),
            Layout(Panel(_live_table(self.snap, rows),
                         title=f"live requests ({len(self.snap.live)})", title_align="left"),
                   name="live", size=rows + 3),
            Layout(Panel(LogTail(self.log_lines), title="log", title_align="left",
                         border_style="dim"), name="log", ratio=1),
        )
        yield layout


def dashboard(snap: Snapshot, log_lines: Sequence[str], max_live_rows: int = 8) -> Dashboard:
    """The serve dashboard's screen for one snapshot (see Dashboard)."""
    return Dashboard(snap, log_lines, max_live_rows)
