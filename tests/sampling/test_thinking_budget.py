"""Thinking budgets: the engine ends a reasoning model's thinking after its budget — at a
sentence end, never inside a code fence, within a bounded number of extra tokens — even
on a model biased never to close it; a grammar holds only the answer after it."""

from __future__ import annotations

import json

import jsonschema
import pytest

from met import LLM, SamplingParams, StructuredOutputs, ThinkingBudget
from met.sampling.thinking import ThinkingState

# --------------------------------------------------------------------------- the state machine

WORD, DOT, FENCE, NL, START, END, EOS, CLOSE = range(8)
BYTES = [b" word", b".", b"```", b"\n", b"<think>", b"</think>", b"", b"\n```\n"]


def _state(budget, grace=4, starts_inside=True, **kw):
    spec = ThinkingBudget(budget, (START,), (END,), starts_inside=starts_inside,
                          grace_tokens=grace, fence_close_token_ids=(CLOSE,), **kw)
    return ThinkingState(spec, BYTES, frozenset({EOS}))


def _feed(state, tokens):
    for t in tokens:
        assert state.forced_token() is None, "forced too early"
        state.on_token(t)


def test_closes_at_the_first_sentence_end_after_the_budget():
    s = _state(budget=3)
    _feed(s, [WORD, WORD, WORD, WORD])  # budget reached mid-sentence: keeps going
    s.on_token(DOT)
    assert s.forced_token() == END
    s.on_token(END)
    assert not s.in_thinking and s.ended and s.num_thinking_tokens == 5


def test_grace_bounds_the_wait_for_a_sentence_end():
    s = _state(budget=2, grace=3)
    _feed(s, [WORD] * 5)
    assert s.forced_token() == END  # 2 + 3 tokens: forced whatever the text


def test_never_inside_a_code_fence_and_closes_it_when_forced():
    s = _state(budget=3, grace=3)
    _feed(s, [WORD, FENCE, NL])  # in a fence now, at the budget, at a line end: no close
    _feed(s, [WORD, WORD, WORD])
    assert s.forced_token() == CLOSE  # grace spent inside the fence: close it, then end
    s.on_token(CLOSE)
    assert s.forced_token() == END


def test_eos_inside_thinking_becomes_the_end_marker():
    s = _state(budget=100)
    _feed(s, [WORD])
    assert s.on_token(EOS) == END
    assert s.ended and not s.in_thinking


def test_thinking_opened_by_the_output_and_budget_zero():
    s = _state(budget=0, starts_inside=False)
    _feed(s, [WORD, START])  # the output opens thinking on its second token
    assert s.in_thinking
    assert s.forced_token() == END  # budget 0: close at once
    s = _state(budget=0)
    assert s.forced_token() == END  # prompt-opened, budget 0: the first token closes it


def test_invalid_budget():
    with pytest.raises(ValueError, match="thinking_token_budget"):
        ThinkingBudget(-1, (1,), (2,))


# --------------------------------------------------------------------------- in the engine


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(str(tiny_checkpoint("llama")), max_model_len=512)


def _ids(llm, text):
    return tuple(llm.tokenizer(text, add_special_tokens=False).input_ids)


@pytest.mark.parametrize("budget", [0, 7, 20])
def test_budget_ends_thinking_on_a_model_that_never_closes(llm, budget):
    start, end = _ids(llm, "<think>"), _ids(llm, "</think>")
    assert len(end) > 1  # a multi-token marker: forced token by token
    grace = 6
    spec = ThinkingBudget(budget, start, end, starts_inside=True, grace_tokens=grace)
    never_close = dict.fromkeys(end, -100.0)
    never_close.update({t: -100.0 for t in llm.engine.loaded.eos_token_ids})
    out = llm.generate(["Think hard:"], SamplingParams(
        max_tokens=80, temperature=0.0, logit_bias=never_close, thinking_budget=spec,
        ignore_eos=True))[0].outputs[0]
    ids = out.token_ids
    at = next(i for i in range(len(ids)) if tuple(ids[i:i + len(end)]) == end)
    assert budget <= at <= budget + grace
    free = llm.generate(["Think hard:"], SamplingParams(
        max_tokens=80, temperature=0.0, logit_bias=never_close, ignore_eos=True))[0]
    assert not any(tuple(free.outputs[0].token_ids[i:i + len(end)]) == end
                   for i in range(80))  # without the budget it would never have closed


def test_grammar_holds_only_the_answer(llm):
    start, end = _ids(llm, "<think>"), _ids(llm, "</think>")
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}},
              "required": ["ok"], "additionalProperties": False}
    spec = ThinkingBudget(6, start, end, starts_inside=True, grace_tokens=4)
    out = llm.generate(["Q:"], SamplingParams(
        max_tokens=60, temperature=0.0, thinking_budget=spec,
        structured_outputs=StructuredOutputs(json=schema)))[0].outputs[0]
    ids = out.token_ids
    at = next(i for i in range(len(ids)) if tuple(ids[i:i + len(end)]) == end)
    answer = llm.tokenizer.decode(ids[at + len(end):], skip_special_tokens=True)
    jsonschema.validate(json.loads(answer), schema)
    assert out.finish_reason == "stop"
    thinking = llm.tokenizer.decode(ids[:at])
    with pytest.raises(ValueError):
        json.loads(thinking)  # the thinking was free text, not held by the grammar
    assert llm.kv_stats().num_blocks_in_use == 0
