"""The reasoning split: a thinking model's ``<think>…</think>`` goes to ``reasoning_content``,
the rest is the answer.

``--reasoning-parser think`` (or ``auto``: ``think`` when the chat template mentions
``<think>``). The output may open the thinking itself (``<think>`` first), or start inside it
when the prompt already opened it (the template ended the prompt with ``<think>``); an output
that never closes its thinking is all reasoning. One-shot (``parse``) and streaming
(``streamer``) come from one scan, as the tool parsers do, so they always agree.
"""

from __future__ import annotations

from dataclasses import dataclass

from met.serving.tool_parsers.base import partial_tag_len

REASONING_PARSER_CHOICES = ("auto", "think", "none")
_WS = " \t\r\n"


def select_reasoning_parser(template: str | None) -> str | None:
    """``think`` when the chat template knows ``<think>``, else None (no split)."""
    return "think" if template and "<think>" in template else None


@dataclass(frozen=True)
class ThinkParser:
    """``<think>reasoning</think>answer``; ``starts_inside`` when the prompt opened it."""

    starts_inside: bool = False
    closed_in_prompt: bool = False  # the template closed an empty block (thinking off)
    start: str = "<think>"
    end: str = "</think>"

    @staticmethod
    def prompt_opens_thinking(prompt_text: str | None, start: str = "<think>") -> bool:
        """Whether the rendered prompt ends inside an opened thinking block."""
        return bool(prompt_text) and prompt_text.rstrip(_WS).endswith(start)

    def scan(self, text: str, final: bool) -> tuple[str | None, str, bool]:
        """(reasoning or None when there is none, answer, thinking ended). A snapshot
        (``final=False``) holds back what may still be a tag or trailing whitespace."""
        if self.starts_inside:
            r_start = 0
        else:
            lead = text.lstrip(_WS)
            if lead.startswith(self.start):
                r_start = len(text) - len(lead) + len(self.start)
            elif not final and self.start.startswith(lead):
                return None, "", False  # may still open a thinking block
            else:
                return None, text if final else text.rstrip(_WS), False
        e = text.find(self.end, r_start)
        if e < 0:
            body = text[r_start:]
            if not final:
                body = body[:len(body) - partial_tag_len(body, (self.end,))].rstrip(_WS)
            return body.strip(_WS), "", False
        answer = text[e + len(self.end):].lstrip(_WS)
        return text[r_start:e].strip(_WS), answer if final else answer.rstrip(_WS), True

    def parse(self, text: str) -> tuple[str | None, str]:
        """One-shot: (reasoning or None, answer)."""
        reasoning, answer, _ = self.scan(text, True)
        return reasoning, answer

    def streamer(self) -> ReasoningStream:
        return ReasoningStream(self)


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class ReasoningStream:
    """Feed text deltas; get reasoning and answer deltas. ``thinking_ended`` turns true with
    the delta that closes the thinking (its tokens are the last reasoning tokens)."""

    def __init__(self, parser: ThinkParser):
        self._parser = parser
        self._text = ""
        self._reasoning = ""
        self._content = ""
        self.has_reasoning = parser.starts_inside
        self.thinking_ended = False

    def feed(self, text: str) -> ReasoningDelta:
        if not text:
            return ReasoningDelta()
        self._text += text
        return self._diff(*self._parser.scan(self._text, False))

    def finish(self) -> ReasoningDelta:
        return self._diff(*self._parser.scan(self._text, True))

    def _diff(self, reasoning: str | None, content: str, ended: bool) -> ReasoningDelta:
        out = ReasoningDelta()
        if reasoning is not None:
            self.has_reasoning = True
            if len(reasoning) > len(self._reasoning) and reasoning.startswith(self._reasoning):
                out.reasoning = reasoning[len(self._reasoning):]
                self._reasoning = reasoning
        if len(content) > len(self._content) and content.startswith(self._content):
            out.content = content[len(self._content):]
            self._content = content
        self.thinking_ended = self.thinking_ended or ended
        return out


def get_reasoning_parser(name: str | None, template: str | None,
                         prompt_text: str | None) -> ThinkParser | None:
    """The parser for ``--reasoning-parser`` (None/``none``: no split), knowing whether the
    prompt already opened the thinking."""
    if name == "auto":
        name = select_reasoning_parser(template)
    if name in (None, "none"):
        return None
    if name != "think":
        raise ValueError(f"--reasoning-parser: unknown parser {name!r}; expected one of "
                         f"{', '.join(REASONING_PARSER_CHOICES)}")
    closed = bool(prompt_text) and prompt_text.rstrip(_WS).endswith("</think>")
    return ThinkParser(starts_inside=ThinkParser.prompt_opens_thinking(prompt_text),
                       closed_in_prompt=closed)
