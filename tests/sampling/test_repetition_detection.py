"""repetition_detection: an output that ends in one pattern repeated min_count times stops
with finish_reason "length" and stop_reason "repetition"; other outputs are untouched."""

from __future__ import annotations

import random

import pytest

from met import LLM, SamplingParams
from met.sampling import RepetitionDetection

PROMPT = [20 + (7 * j) % 150 for j in range(13)]


def first_repetition(tokens: list[int], lo: int, hi: int, count: int) -> int | None:
    """Plain reference: the shortest prefix length whose tail is a pattern of lo..hi tokens
    repeated count times (None: no prefix is)."""
    for end in range(1, len(tokens) + 1):
        out = tokens[:end]
        for size in range(lo, hi + 1):
            if size * count <= end and out[end - size * count:] == out[end - size:] * count:
                return end
    return None


def test_matches_agrees_with_a_plain_reference():
    rng = random.Random(0)
    for _ in range(400):
        lo = rng.randint(1, 3)
        rd = RepetitionDetection(lo, rng.randint(lo, 5), rng.randint(2, 4))
        start = rng.randint(0, 3)
        toks = [rng.randint(0, 2) for _ in range(rng.randint(0, 24))]
        want = any(size * rd.min_count <= len(toks) - start
                   and toks[len(toks) - size * rd.min_count:] == toks[len(toks) - size:]
                   * rd.min_count
                   for size in range(rd.min_pattern_size, rd.max_pattern_size + 1))
        assert rd.matches(toks, start) == want, (rd, start, toks)


@pytest.mark.parametrize("kw,field", [
    ({"min_pattern_size": 0}, "repetition_detection.min_pattern_size"),
    ({"min_pattern_size": 3, "max_pattern_size": 2}, "repetition_detection.max_pattern_size"),
    ({"min_count": 1}, "repetition_detection.min_count"),
    ({"min_size": 1}, "repetition_detection"),
])
def test_invalid_values_name_the_field(kw, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        SamplingParams(repetition_detection=kw)


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(str(tiny_checkpoint("llama")), dtype="float32", max_model_len=256)


def _run(llm, **kw):
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, **kw)
    return llm.generate([{"prompt_token_ids": PROMPT}], params)[0].outputs[0]


def test_forced_loop_stops_early_with_reason_repetition(llm):
    # Two allowed tokens + greedy: the model falls into a loop.
    loop = dict(allowed_token_ids=[40, 41])
    plain = _run(llm, **loop)
    expect = first_repetition(plain.token_ids, 1, 4, 3)
    assert expect is not None and expect < 40  # the premise: it loops
    out = _run(llm, repetition_detection={"min_pattern_size": 1, "max_pattern_size": 4,
                                          "min_count": 3}, **loop)
    assert out.token_ids == plain.token_ids[:expect]
    assert out.finish_reason == "length" and out.stop_reason == "repetition"
    assert plain.finish_reason == "length" and plain.stop_reason is None


def test_non_repeating_output_is_untouched(llm):
    plain = _run(llm)
    rd = {"min_pattern_size": 2, "max_pattern_size": 8, "min_count": 2}
    assert first_repetition(plain.token_ids, 2, 8, 2) is None  # the premise
    out = _run(llm, repetition_detection=rd)
    assert out.token_ids == plain.token_ids and len(out.token_ids) == 40
    assert out.finish_reason == "length" and out.stop_reason is None


def test_prompt_tokens_never_count_and_min_tokens_delays_the_stop(llm):
    loop = dict(allowed_token_ids=[40, 41])
    plain = _run(llm, **loop)
    expect = first_repetition(plain.token_ids, 1, 4, 3)
    rd = {"min_pattern_size": 1, "max_pattern_size": 4, "min_count": 3}
    # A prompt that is itself one long repetition does not stop the first token.
    rep_prompt = [40, 41] * 10
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True,
                            repetition_detection=rd)
    out = llm.generate([{"prompt_token_ids": rep_prompt}], params)[0].outputs[0]
    assert len(out.token_ids) == 3  # a stop needs 3 output tokens at the least
    # min_tokens: no repetition stop before that many tokens are out.
    late = _run(llm, repetition_detection=rd, min_tokens=expect + 5, **loop)
    assert late.stop_reason == "repetition" and len(late.token_ids) >= expect + 5
    assert late.token_ids == plain.token_ids[:len(late.token_ids)]
