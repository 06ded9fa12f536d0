"""Incremental detokenization and stop strings.

``IncrementalDetokenizer`` turns tokens into text as they arrive without ever emitting a
broken UTF-8 sequence: text is only released once the decoded window no longer ends in an
incomplete character (U+FFFD). The window restarts at the last release point, which is a
character boundary, so the released pieces concatenate to exactly ``decode(all tokens)``
(checked by tests on random token sequences).

``StopStringMatcher`` holds back any tail of the text that could still grow into a stop
string, so a stop string split across tokens is never partly sent.
"""

from __future__ import annotations

from typing import Any

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Tokens in, complete text out. ``push`` returns the new text; ``flush`` the rest."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # window start: a character boundary already released
        self._read = 0  # tokens up to here have been released as text

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def push(self, token_ids: list[int]) -> str:
        """Add tokens; return the text they complete (may be empty while a char is split)."""
        if self._tok is None:
            return ""
        self._ids.extend(token_ids)
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        new_text = self._decode(self._ids[self._prefix:])
        if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT):
            self._prefix, self._read = self._read, len(self._ids)
            return new_text[len(prefix_text):]
        return ""

    def flush(self) -> str:
        """The generation ended: release whatever is held, incomplete characters included."""
        if self._tok is None or self._read == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        new_text = self._decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        return new_text[len(prefix_text):]


class StopStringMatcher:
    """Finds stop strings in streamed text and holds back what might still become one.

    ``feed(text)`` returns ``(releasable_text, matched_stop)``; after a match the output is
    final (the text before the stop, plus the stop itself with ``include_in_output``).
    """

    def __init__(self, stops: tuple[str, ...], include_in_output: bool = False):
        self._stops = tuple(s for s in stops if s)
        self._include = include_in_output
        self._held = ""

    def feed(self, text: str, check: bool = True) -> tuple[str, str | None]:
        """Add text. ``check=False`` (before min_tokens) passes it on without matching."""
        if not self._stops:
            return text, None
        buf = self._held + text
        if check:
            hit: tuple[int, str] | None = None
            for s in self._stops:
                i = buf.find(s)
                if i >= 0 and (hit is None or i < hit[0]):
                    hit = (i, s)
            if hit is not None:
                i, s = hit
                self._held = ""
                return buf[: i + len(s)] if self._include else buf[:i], s
        keep = self._partial_tail(buf)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[: len(buf) - keep], None

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held

    def _partial_tail(self, buf: str) -> int:
        """Length of the longest tail of ``buf`` that is a proper prefix of some stop string."""
        best = 0
        for s in self._stops:
            for n in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:n]):
                    best = n
                    break
        return best
