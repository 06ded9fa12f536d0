"""Thinking budgets: cap how many tokens a reasoning model spends inside ``<think>…</think>``.

The engine follows each budgeted request's output: thinking starts when the output emits
the start marker (or at once when the prompt opened it) and ends with the end marker. Once
``budget`` thinking tokens are out, the engine waits up to ``grace_tokens`` more for the end
of a sentence outside a code fence, then forces the end marker itself (closing an open code
fence first), token by token, through the sampler's forced-token mask. An EOS sampled while
thinking is replaced by the end marker, so the answer still comes. Forced and thinking
tokens count against max_tokens like any other.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

_SENTENCE_END = (b".", b"!", b"?", b"\n", b":", b";")


@dataclass(frozen=True)
class ThinkingBudget:
    """A request's thinking cap and its model's markers (as token ids)."""

    budget: int
    start_token_ids: tuple[int, ...]
    end_token_ids: tuple[int, ...]
    starts_inside: bool = False  # the prompt already opened the thinking block
    grace_tokens: int = 32  # extra tokens allowed to reach a sentence end
    fence_close_token_ids: tuple[int, ...] = ()  # e.g. "\n```\n", forced before the end

    def __post_init__(self) -> None:
        if self.budget < 0:
            raise ValueError(f"thinking_token_budget: must be >= 0, got {self.budget}")
        if not self.end_token_ids:
            raise ValueError("thinking_token_budget: the model has no end-of-thinking marker")
        if self.grace_tokens < 0:
            raise ValueError(f"thinking grace_tokens: must be >= 0, got {self.grace_tokens}")
        for name in ("start_token_ids", "end_token_ids", "fence_close_token_ids"):
            object.__setattr__(self, name, tuple(int(t) for t in getattr(self, name)))


class ThinkingState:
    """One request's thinking: where it is, how much it spent, what must be forced next.

    ``token_bytes[i]`` is token i's text as bytes (for sentence ends and code fences)."""

    def __init__(self, spec: ThinkingBudget, token_bytes: list[bytes],
                 eos_token_ids: frozenset[int]):
        self.spec = spec
        self._bytes = token_bytes
        self._eos = eos_token_ids
        self.in_thinking = spec.starts_inside
        self.ended = False
        self.num_thinking_tokens = 0
        self._forced: deque[int] = deque()
        self._recent: list[int] = []  # the last few output tokens (marker matching)
        self._fence_open = False
        self._backticks = 0  # length of the backtick run at the end of the thinking text
        self._at_sentence_end = True  # the thinking text so far ends a sentence (or is empty)

    def forced_token(self) -> int | None:
        """The token the next step must produce, if the budget forces one."""
        if not self._forced and self.in_thinking and self._must_close():
            if self._in_fence():
                self._forced.extend(self.spec.fence_close_token_ids)
            self._forced.extend(self.spec.end_token_ids)
        return self._forced[0] if self._forced else None

    def on_token(self, token: int) -> int:
        """Record the sampled ``token``; returns the token the output really gets (an EOS
        inside thinking becomes the end marker's first token)."""
        if self._forced:
            if token == self._forced[0]:
                self._forced.popleft()
        elif self.in_thinking and token in self._eos:
            self._forced.extend(self.spec.end_token_ids)
            token = self._forced.popleft()
        self._recent = (self._recent + [token])[-8:]
        if self.in_thinking:
            if self._ends_with(self.spec.end_token_ids):
                self.in_thinking = False
                self.ended = True
                self._forced.clear()
            else:
                self.num_thinking_tokens += 1
                self._track_text(token)
        elif not self.ended and self.spec.start_token_ids and self._ends_with(
                self.spec.start_token_ids):
            self.in_thinking = True
        return token

    def _must_close(self) -> bool:
        over = self.num_thinking_tokens - self.spec.budget
        if over < 0:
            return False
        if over >= self.spec.grace_tokens:
            return True
        return self._at_sentence_end and not self._in_fence()

    def _in_fence(self) -> bool:
        return self._fence_open != (self._backticks >= 3)

    def _ends_with(self, marker: tuple[int, ...]) -> bool:
        return len(self._recent) >= len(marker) and tuple(self._recent[-len(marker):]) == marker

    def _track_text(self, token: int) -> None:
        piece = self._bytes[token] if token < len(self._bytes) else b""
        for byte in piece:
            if byte == 0x60:  # `
                self._backticks += 1
                continue
            if self._backticks >= 3:
                self._fence_open = not self._fence_open
            self._backticks = 0
        stripped = piece.rstrip(b" \t")
        if stripped:  # (whitespace alone leaves the sentence state as it was)
            self._at_sentence_end = stripped.endswith(_SENTENCE_END) or b"\n" in stripped
