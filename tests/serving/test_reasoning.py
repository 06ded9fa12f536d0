"""The reasoning split on canned outputs: one-shot and streamed (every split) agree."""

from __future__ import annotations

import pytest

from met.serving.reasoning import ThinkParser, get_reasoning_parser, select_reasoning_parser

# (starts inside thinking, output, reasoning, answer)
CASES = [
    (False, "<think>\nThe user wants x.\n</think>\n\nThe answer is 4.", "The user wants x.",
     "The answer is 4."),
    (True, "Prompt opened it. 2+2 is 4.\n</think>\n\n4", "Prompt opened it. 2+2 is 4.", "4"),
    (False, "No thinking here, <think> is mid-text.", None,
     "No thinking here, <think> is mid-text."),
    (False, "<think>cut off before the end", "cut off before the end", ""),
    (True, "still thinking </thi", "still thinking </thi", ""),
    (False, "  <think></think>Direct.", "", "Direct."),
    (False, "<think>a < b and </ think> is not the tag</think>ok", "a < b and </ think> is not "
     "the tag", "ok"),
]


def _stream(parser: ThinkParser, pieces: list[str]) -> tuple[str, str, bool]:
    s = parser.streamer()
    reasoning = content = ""
    for d in [*(s.feed(p) for p in pieces), s.finish()]:
        reasoning += d.reasoning
        content += d.content
    return reasoning, content, s.has_reasoning


@pytest.mark.parametrize("inside,text,reasoning,answer", CASES)
def test_one_shot(inside, text, reasoning, answer):
    assert ThinkParser(starts_inside=inside).parse(text) == (reasoning, answer)


@pytest.mark.parametrize("inside,text,reasoning,answer", CASES)
def test_stream_every_split_matches_one_shot(inside, text, reasoning, answer):
    parser = ThinkParser(starts_inside=inside)
    expected = (reasoning or "", answer, reasoning is not None)
    assert _stream(parser, list(text)) == expected
    for cut in range(len(text) + 1):
        assert _stream(parser, [text[:cut], text[cut:]]) == expected


def test_thinking_ended_turns_on_with_the_closing_delta():
    s = ThinkParser().streamer()
    s.feed("<think>hmm")
    assert not s.thinking_ended
    s.feed("</thi")
    assert not s.thinking_ended
    d = s.feed("nk>Yes")
    assert s.thinking_ended and d.content == "Yes"


def test_prompt_that_opened_thinking_is_detected():
    tmpl = "{% if tools %}{% endif %}<think>"
    p = get_reasoning_parser("auto", tmpl, "<|im_start|>assistant\n<think>\n")
    assert p is not None and p.starts_inside
    closed = get_reasoning_parser("auto", tmpl, "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert closed is not None and not closed.starts_inside and closed.closed_in_prompt
    assert get_reasoning_parser("auto", "{{ messages }}", "x") is None
    assert get_reasoning_parser("none", tmpl, "x") is None
    assert select_reasoning_parser(tmpl) == "think"
    with pytest.raises(ValueError, match="--reasoning-parser"):
        get_reasoning_parser("r1", tmpl, "x")
