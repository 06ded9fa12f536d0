"""A live progress bar that degrades to plain lines when the stream is not a terminal."""

from __future__ import annotations

import sys
import time
from typing import TextIO

_WIDTH = 30


class Progress:
    """``done/total`` of one labelled task. On a TTY it redraws one line in place; elsewhere
    (a pipe, a log file, CI) it writes a plain line at each quarter and at the end, so logs
    stay readable and carry no carriage returns."""

    def __init__(self, total: int, label: str, stream: TextIO | None = None):
        self.total = max(total, 0)
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.done = 0
        self.failed = 0
        self._start = time.perf_counter()
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._next_quarter = 1
        self._closed = False
        if self._tty:
            self._draw()

    def update(self, ok: bool = True) -> None:
        """One more item finished (``ok=False`` counts it as failed)."""
        self.done += 1
        self.failed += 0 if ok else 1
        if self._tty:
            self._draw()
            return
        if not self.total or self.done >= self.total:
            return  # close() writes the last line
        reached = self.done * 4 // self.total
        if reached >= self._next_quarter:
            self._line(f"{reached * 25}%")
            self._next_quarter = reached + 1

    def close(self) -> None:
        """Finish the line (TTY) or write the closing line."""
        if self._closed:
            return
        self._closed = True
        if self._tty:
            self._draw()
            self.stream.write("\n")
        else:
            self._line("done")
        self.stream.flush()

    def _status(self) -> str:
        errs = f", {self.failed} failed" if self.failed else ""
        return f"{self.done}/{self.total}{errs} {time.perf_counter() - self._start:.1f}s"

    def _draw(self) -> None:
        filled = _WIDTH * self.done // self.total if self.total else _WIDTH
        bar = "#" * filled + "-" * (_WIDTH - filled)
        self.stream.write(f"\r{self.label} [{bar}] {self._status()}")
        self.stream.flush()

    def _line(self, what: str) -> None:
        self.stream.write(f"{self.label}: {what} ({self._status()})\n")
        self.stream.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
