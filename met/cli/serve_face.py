"""What `met serve` shows: startup progress, one banner, then (at a terminal) the dashboard.

Not at a terminal (a pipe, CI, systemd) or with TERM=dumb, `PlainFace` keeps the plain log
and adds the banner to it as one record once the server is bound and ready.

At a terminal, `serve()` enters a `ServeFace` around uvicorn's run (main thread, which keeps
the signal handlers: Ctrl-C drains as before). The face works in its own thread: a spinner
with the latest log line while kernels build and the model loads, the banner once the
server is bound and ready, then (unless --no-tui) the live dashboard on the alternate screen, whose
`q` asks uvicorn to drain exactly as a SIGINT does. While the face owns the screen the log
goes to it instead of stderr; the plain handlers come back when it is done.
"""

from __future__ import annotations

import collections
import logging
import os
import select
import sys
import threading
import time
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.text import Text

from met.cli.dashboard_view import banner, banner_text, dashboard
from met.cli.live_stats import ClientTracker, StatsSampler
from met.engine.async_engine import EngineState

log = logging.getLogger("met.cli")

_TICK_S = 0.25  # dashboard refresh and key poll period
_LOG_LINES = 500  # log lines the dashboard keeps
_SHOWN_AFTER = 20  # log lines printed again when the dashboard leaves the screen


class _LogRouter(logging.Handler):
    """Takes the root logger's console handlers out and sends each formatted line to
    ``sink`` instead (the spinner's console, or the dashboard's ring); `restore` undoes it."""

    def __init__(self) -> None:
        super().__init__()
        root = logging.getLogger()
        self._removed = [h for h in root.handlers if type(h) is logging.StreamHandler]
        fmt = self._removed[0].formatter if self._removed else None
        self.setFormatter(fmt or logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        self.sink = lambda line: None
        self._lock2 = threading.Lock()
        for h in self._removed:
            root.removeHandler(h)
        root.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.sink(self.format(record))
        except Exception:
            self.handleError(record)

    def restore(self) -> None:
        with self._lock2:
            root = logging.getLogger()
            if self in root.handlers:
                root.removeHandler(self)
                for h in self._removed:
                    root.addHandler(h)


def server_url(server: Any, host: str, port: int) -> tuple[str, str]:
    """(the URL a browser on this machine opens, a note on where it listens)."""
    from met.api.server import binds_all_interfaces

    sockets = [s for srv in getattr(server, "servers", None) or [] for s in srv.sockets or []]
    if sockets:
        port = sockets[0].getsockname()[1]  # the one bound for --port 0
    note = ""
    if binds_all_interfaces(host):
        note = f"listening on every interface ({host or '*'}); other machines use this " \
               "machine's address"
        host = "127.0.0.1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}", note


def _bound_and_loaded(server: Any, ctx: Any) -> bool:
    return ctx.model is not None and bool(getattr(server, "started", False))


def _cannot_serve(server: Any, ctx: Any) -> bool:
    return bool(server.should_exit) or ctx.engine.state == EngineState.FAULTED


def _after_ready_announced(server: Any, timeout: float = 2.0) -> None:
    """Wait one turn of the server's event loop. The model becomes visible (ctx.model) in
    the same loop step that then logs "met: ready"; a callback queued now runs after that
    step, so the banner that follows is the last startup line, never before it."""
    loops = [srv.get_loop() for srv in getattr(server, "servers", None) or []]
    if not loops:
        return
    turned = threading.Event()
    try:
        loops[0].call_soon_threadsafe(turned.set)
    except RuntimeError:  # the loop has closed: the server is stopping anyway
        return
    turned.wait(timeout)


def _in_foreground(fd: int) -> bool:
    """Whether this process owns the terminal on ``fd``: changing a terminal's mode from a
    background job (`met serve &`) stops the whole process with SIGTTOU."""
    try:
        return os.tcgetpgrp(fd) == os.getpgrp()
    except OSError:
        return False


@contextmanager
def _keys(enabled: bool):
    """A function returning the keys typed since the last call (waiting up to a timeout);
    stdin is put in cbreak mode meanwhile, which keeps Ctrl-C a signal."""
    fd = sys.stdin.fileno() if enabled else -1
    if not enabled or not _in_foreground(fd):
        yield lambda timeout: (time.sleep(timeout), "")[1]
        return
    import termios
    import tty

    saved = termios.tcgetattr(fd)
    tty.setcbreak(fd)

    def read(timeout: float) -> str:
        ready, _, _ = select.select([fd], [], [], timeout)
        return os.read(fd, 64).decode(errors="replace") if ready else ""

    try:
        yield read
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


class ServeFace:
    """``with ServeFace(server, app, dashboard=True): server.run()``."""

    def __init__(self, server: Any, app: Any, *, dashboard: bool = True,
                 console: Console | None = None):
        self.server = server
        self.ctx = app.state.ctx
        self.use_dashboard = dashboard
        self.console = console or Console()
        self._scopes: dict[int, dict] = {}
        if dashboard:
            app.add_middleware(ClientTracker, scopes=self._scopes)
        self.sampler = StatsSampler(self.ctx, self._scopes)
        self._ring: collections.deque[str] = collections.deque(maxlen=_LOG_LINES)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="met-face", daemon=True)
        self._router: _LogRouter | None = None
        self._dashboard_shown = False
        self._dashboard_lines = 0
        self._started = time.monotonic()

    def __enter__(self) -> ServeFace:
        self._router = _LogRouter()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        if self._router is not None:
            self._router.restore()
        if self._dashboard_shown:
            # What the alternate screen took away (the startup lines are still above).
            tail = list(self._ring)[-min(_SHOWN_AFTER, self._dashboard_lines):]
            if self._dashboard_lines:
                self.console.rule(f"[dim]the log's last {len(tail)} lines")
                for line in tail:
                    self.console.print(line, markup=False, highlight=False)
            self.console.print(f"met: stopped ({self.sampler.sample().finished} requests "
                               f"finished)", markup=False, highlight=False)

    # ------------------------------------------------------------ the face's thread

    def _run(self) -> None:
        try:
            if self._startup() and self.use_dashboard and not self._stop.is_set():
                self._dashboard()
        except Exception:  # the face must never take the server down with it
            log.exception("the terminal dashboard failed; the server goes on with the log")
        finally:
            if self._router is not None:
                self._router.restore()

    def _startup(self) -> bool:
        """Spinner until ready; then the banner. False when the server will not serve."""
        last = ["starting"]

        def sink(line: str) -> None:
            last[0] = line.split(": ", 1)[-1]
            self._ring.append(line)  # the dashboard's log starts with the startup lines
            self.console.print(line, markup=False, highlight=False)

        assert self._router is not None
        self._router.sink = sink
        what = self.ctx.config.model_name
        with self.console.status(Text(f"loading {what}"), spinner="dots") as status:
            while not _bound_and_loaded(self.server, self.ctx):
                if self._stop.is_set() or _cannot_serve(self.server, self.ctx):
                    return False
                # Text, not markup: a log line or model name may hold [brackets].
                status.update(Text.assemble(
                    (f"loading {what}", "bold"),
                    f" ({time.monotonic() - self._started:.0f} s): {last[0][:100]}"))
                time.sleep(0.1)
        _after_ready_announced(self.server)
        host, port = self.ctx.config.host, self.ctx.config.port
        url, note = server_url(self.server, host, port)
        self.sampler.url = url
        self.console.print(banner(self.sampler.sample(), self.ctx.engine.load_seconds, note))
        if not self.use_dashboard:
            self._router.restore()
        return True

    def _dashboard(self) -> None:
        assert self._router is not None

        def sink(line: str) -> None:
            self._ring.append(line)
            self._dashboard_lines += 1

        self._router.sink = sink
        self._dashboard_shown = True
        with _keys(sys.stdin.isatty()) as read_keys, \
                Live(console=self.console, screen=True, auto_refresh=False) as live:
            while not self._stop.is_set():
                for key in read_keys(_TICK_S):
                    self._on_key(key)
                self.sampler.draining = bool(self.server.should_exit)
                live.update(dashboard(self.sampler.sample(), self._ring), refresh=True)

    def _on_key(self, key: str) -> None:
        if key not in ("q", "Q"):
            return
        if not self.server.should_exit:
            log.info("met: q pressed — draining in-flight requests (q again to force)")
            self.server.should_exit = True
        else:
            self.server.force_exit = True


class PlainFace:
    """``with PlainFace(server, app): server.run()`` where stdout is not a terminal: the log
    as it is, ending with the banner (one record) once the server is bound and ready."""

    def __init__(self, server: Any, app: Any):
        self.server = server
        self.ctx = app.state.ctx
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="met-banner", daemon=True)

    def __enter__(self) -> PlainFace:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        try:
            while not _bound_and_loaded(self.server, self.ctx):
                if self._stop.wait(0.1) or _cannot_serve(self.server, self.ctx):
                    return
            _after_ready_announced(self.server)
            url, note = server_url(self.server, self.ctx.config.host, self.ctx.config.port)
            snap = StatsSampler(self.ctx, {}, url).sample()
            log.info("%s", banner_text(snap, self.ctx.engine.load_seconds, note))
        except Exception:  # the banner must never take the server down with it
            log.exception("met: could not print the startup banner")
