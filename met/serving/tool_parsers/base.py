"""What every tool-call parser shares: the call records, the scan contract, and the
streaming wrapper that turns successive scans into OpenAI-style deltas.

A parser implements one function, ``scan(text, final)``:

- ``final=True`` is the one-shot parse of a finished output: the text outside the calls and
  the calls (name + arguments as JSON text).
- ``final=False`` is a snapshot of a growing output: only the content that can no longer turn
  into part of a call (a tail that may be the start of a tag is held back) and the calls
  begun so far, each with what is known of it (its name once complete, the arguments text so
  far).

Both modes come from the same code, and each snapshot's content and argument texts are
prefixes of the final ones, so streaming by diffing snapshots (``ToolCallStream``) gives
exactly the one-shot result.
"""

from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

_WS = " \t\r\n"


def loads(text: str) -> Any:
    """JSON as models write it: raw control characters inside strings are accepted
    (xgrammar's JSON grammar allows them too)."""
    return json.loads(text, strict=False)


@dataclass(frozen=True)
class ParsedCall:
    """One call: ``name is None`` only in snapshots, while the name is still incomplete."""

    name: str | None
    arguments: str  # JSON text (a snapshot may hold a prefix of it)


@dataclass(frozen=True)
class ToolCallDelta:
    """One streamed piece of a call: the header (id, name, empty arguments) or a fragment."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def to_openai(self) -> dict[str, Any]:
        if self.id is not None:
            return {"index": self.index, "id": self.id, "type": "function",
                    "function": {"name": self.name, "arguments": self.arguments}}
        return {"index": self.index, "function": {"arguments": self.arguments}}


@dataclass
class StreamDelta:
    """What one fed piece of text released."""

    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


def new_call_id() -> str:
    """An OpenAI-style tool-call id."""
    return "call_" + uuid.uuid4().hex[:24]


class ToolParser(ABC):
    """A model family's tool-call format: parsing, and writing calls/results back as text."""

    name: ClassVar[str]
    start_tags: ClassVar[tuple[str, ...]]  # text that starts the call region

    def __init__(self, tools: Sequence[dict[str, Any]] | None = None):
        self.tools = list(tools or [])

    @abstractmethod
    def scan(self, text: str, final: bool) -> tuple[str, list[ParsedCall]]:
        """See the module docstring."""

    def parse(self, text: str) -> tuple[str, list[ParsedCall]]:
        """One-shot: (text outside the calls, calls)."""
        return self.scan(text, True)

    def streamer(self) -> ToolCallStream:
        return ToolCallStream(self)

    @abstractmethod
    def format_calls(self, calls: Sequence[tuple[str, Any]]) -> str:
        """(name, arguments dict) pairs written as the model writes calls (tool history)."""

    def format_results(self, results: Sequence[str]) -> str:
        """Tool results written back to the model (history, when the template cannot)."""
        return "\n".join(f"<tool_response>\n{r}\n</tool_response>" for r in results)

    @abstractmethod
    def call_instructions(self) -> str:
        """How to call a function, in this format (for the system message met writes)."""


class ToolCallStream:
    """Incremental parsing: ``feed(text_delta)`` then ``finish()``, each returning the new
    content and tool-call deltas (a header per call, then argument fragments)."""

    def __init__(self, parser: ToolParser):
        self._parser = parser
        self._text = ""
        self._content = ""  # content sent so far
        self._calls: list[list[str]] = []  # [id, name, arguments sent] per call

    @property
    def calls(self) -> list[tuple[str, str, str]]:
        """(id, name, arguments) of every call sent so far."""
        return [(c[0], c[1], c[2]) for c in self._calls]

    def feed(self, text: str) -> StreamDelta:
        if not text:
            return StreamDelta()
        self._text += text
        return self._diff(*self._parser.scan(self._text, False))

    def finish(self) -> StreamDelta:
        return self._diff(*self._parser.scan(self._text, True))

    def _diff(self, content: str, calls: list[ParsedCall]) -> StreamDelta:
        out = StreamDelta()
        if len(content) > len(self._content) and content.startswith(self._content):
            out.content = content[len(self._content):]
            self._content = content
        for i, call in enumerate(calls):
            if call.name is None:
                break
            if i == len(self._calls):
                cid = new_call_id()
                self._calls.append([cid, call.name, ""])
                out.tool_calls.append(ToolCallDelta(i, "", cid, call.name))
            sent = self._calls[i][2]
            if len(call.arguments) > len(sent) and call.arguments.startswith(sent):
                out.tool_calls.append(ToolCallDelta(i, call.arguments[len(sent):]))
                self._calls[i][2] = call.arguments
        return out


# ---------------------------------------------------------------------------------------------
# helpers shared by the parsers


def join_content(segments: list[str], num_calls: int, open_tail: bool) -> str:
    """The text outside the calls: ``segments[k]`` precedes call k (the last one follows the
    last call). Whitespace next to a call is dropped and the pieces are joined by newlines;
    with ``open_tail`` (a snapshot) the last segment's trailing whitespace is held back, since
    a call may still follow it."""
    parts = []
    for k, seg in enumerate(segments):
        if k > 0:
            seg = seg.lstrip(_WS)
        if k < num_calls or open_tail:
            seg = seg.rstrip(_WS)
        if seg:
            parts.append(seg)
    return "\n".join(parts)


def partial_tag_len(text: str, tags: Sequence[str]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of one of ``tags``."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:n]):
                best = n
                break
    return best


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


_SCALAR_CHARS = frozenset("0123456789+-.eEtruefalsn")
_STRUCTURAL = re.compile(r'["{}\[\]]')
_STRING_REST = re.compile(r'(?:[^"\\]|\\.)*"', re.S)  # a string's body and closing quote
_STRING_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"?', re.S)  # a string, possibly unterminated
_CONTROL = re.compile(r"[\x00-\x1f]")


def value_end(text: str, i: int, final: bool) -> int | None:
    """End (exclusive) of the JSON value starting at ``text[i]``; None while incomplete.

    Only the extent is found here (strings and nesting tracked); callers validate with
    ``json.loads``. A bare scalar running to the end of a snapshot may still grow.
    """
    n = len(text)
    if i >= n:
        return None
    c = text[i]
    if c == '"':
        return _string_end(text, i)
    if c in "{[":
        depth = 0
        j = i
        while True:  # jump from one structural character to the next (regex: C speed)
            m = _STRUCTURAL.search(text, j)
            if m is None:
                return None
            j = m.start()
            ch = text[j]
            if ch == '"':
                end = _string_end(text, j)
                if end is None:
                    return None
                j = end
                continue
            if ch in "{[":
                depth += 1
            else:
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
    j = i
    while j < n and text[j] in _SCALAR_CHARS:
        j += 1
    if j == i:
        return i  # not a JSON value: zero extent, the caller's json.loads fails
    if j == n and not final:
        return None
    return j


def _string_end(text: str, i: int) -> int | None:
    """End (exclusive) of the JSON string whose opening quote is at ``i``; None if open."""
    m = _STRING_REST.match(text, i + 1)
    return m.end() if m else None


@dataclass
class ObjectScan:
    """Top-level members of a (possibly incomplete) JSON object: key → (start, end|None)."""

    members: dict[str, tuple[int, int | None]]
    end: int | None  # index after the closing brace; None while incomplete (or cut off)
    ok: bool  # False: not a JSON object (malformed); an incomplete one is ok


def scan_object(text: str, i: int, final: bool) -> ObjectScan:
    """Walk the object at ``text[i]`` (which must be ``{``), recording member extents."""
    members: dict[str, tuple[int, int | None]] = {}
    n = len(text)
    if i >= n or text[i] != "{":
        return ObjectScan(members, None, i >= n)
    j = skip_ws(text, i + 1)
    if j < n and text[j] == "}":
        return ObjectScan(members, j + 1, True)
    while True:
        if j >= n:
            return ObjectScan(members, None, True)
        if text[j] != '"':
            return ObjectScan(members, None, False)
        kend = _string_end(text, j)
        if kend is None:
            return ObjectScan(members, None, True)
        try:
            key = loads(text[j:kend])
        except ValueError:
            return ObjectScan(members, None, False)
        j = skip_ws(text, kend)
        if j >= n:
            return ObjectScan(members, None, True)
        if text[j] != ":":
            return ObjectScan(members, None, False)
        vstart = skip_ws(text, j + 1)
        if vstart >= n:
            return ObjectScan(members, None, True)
        vend = value_end(text, vstart, final)
        members[key] = (vstart, vend)
        if vend is None:
            return ObjectScan(members, None, True)
        j = skip_ws(text, vend)
        if j >= n:
            return ObjectScan(members, None, True)
        if text[j] == ",":
            j = skip_ws(text, j + 1)
            continue
        if text[j] == "}":
            return ObjectScan(members, j + 1, True)
        return ObjectScan(members, None, False)


def call_from_object(text: str, scan: ObjectScan, final: bool,
                     arg_keys: tuple[str, ...] = ("arguments", "parameters")) -> ParsedCall | None:
    """A call from a scanned ``{"name": ..., "arguments": ...}`` object.

    The arguments are the model's own JSON text for that member (so streamed fragments are
    exactly its characters); a string-valued member holding JSON is unwrapped once complete.
    Final mode returns None unless the object is complete, valid and names a function.
    """
    if not scan.ok:
        return None
    name = None
    if "name" in scan.members:
        s, e = scan.members["name"]
        if e is not None:
            try:
                value = loads(text[s:e])
            except ValueError:
                return None
            if not isinstance(value, str) or not value:
                return None
            name = value
    args = ""
    key = next((k for k in arg_keys if k in scan.members), None)
    if key is not None:
        s, e = scan.members[key]
        raw = text[s:len(text) if e is None else e]
        if raw.startswith('"'):  # arguments sent as a JSON string
            args = ""
            if e is not None:
                try:
                    args = loads(raw)
                except ValueError:
                    return None
        else:
            args = escape_controls(raw)
    if final:
        if name is None or scan.end is None:
            return None
        if key is None:
            args = "{}"
        try:
            if not isinstance(loads(args), dict):
                return None
        except ValueError:
            return None
    return ParsedCall(name, args)


def escape_controls(raw: str) -> str:
    """JSON text with raw control characters inside strings escaped (``\\u0001``), so that
    strict parsers (``json.loads``) read arguments that a lenient grammar let through. Each
    string (an unterminated last one too) is rewritten on its own, so a prefix maps to a
    prefix of the whole (streaming)."""
    if not _CONTROL.search(raw):
        return raw
    return _STRING_TOKEN.sub(lambda m: _CONTROL.sub(_escape_control, m.group()), raw)


def _escape_control(m: re.Match[str]) -> str:
    return f"\\u{ord(m.group()):04x}"


def tools_json(tools: Sequence[dict[str, Any]]) -> str:
    """The tools as one JSON line each (as function signatures)."""
    return "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
