"""Speculation composes with the rest of the sampler: penalties, logit bias, filters, seeds,
logprobs, bad words, min_tokens, grammars, thinking budgets and repetition detection give
the same tokens and logprobs with prompt-lookup drafts verified as without them, in one
batch (the tiny random model loops, so drafts are accepted and rejected throughout). Beam
search never speculates (its engine requests are one token long)."""

from __future__ import annotations

import pytest

from met import LLM, SamplingParams, StructuredOutputs, ThinkingBudget

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "n": {"type": "integer"}},
          "required": ["name", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def engines(tiny_checkpoint):
    path = str(tiny_checkpoint("llama"))
    off = LLM(path, dtype="float32", max_model_len=512)
    on = LLM(path, dtype="float32", max_model_len=512,
             speculative_config={"method": "ngram", "num_speculative_tokens": 5,
                                 "gate": False})
    return off, on


def _ids(llm, text):
    return tuple(llm.tokenizer(text, add_special_tokens=False).input_ids)


def _cases(llm) -> list[SamplingParams]:
    start, end = _ids(llm, "<think>"), _ids(llm, "</think>")
    common = dict(max_tokens=64, ignore_eos=True, logprobs=2)
    return [
        SamplingParams(temperature=0.0, **common),
        SamplingParams(temperature=0.0, repetition_penalty=1.2, presence_penalty=0.3,
                       frequency_penalty=0.2, logit_bias={5: 1.5, 9: -3.0}, **common),
        SamplingParams(temperature=0.9, top_p=0.9, top_k=8, min_p=0.05, seed=3, **common),
        SamplingParams(temperature=0.7, seed=4, dry_multiplier=0.8, lz_penalty=0.5,
                       **common),
        SamplingParams(temperature=0.0, bad_words=((7, 8),), min_tokens=30,
                       max_tokens=64, logprobs=0),
        SamplingParams(temperature=0.0, max_tokens=120, logprobs=0,
                       structured_outputs=StructuredOutputs(json=SCHEMA)),
        SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True, logprobs=0,
                       thinking_budget=ThinkingBudget(10, start, end, starts_inside=True,
                                                      grace_tokens=4)),
        SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True, logprobs=0,
                       repetition_detection={"min_pattern_size": 2, "max_pattern_size": 8,
                                             "min_count": 3}),
    ]


def test_every_sampler_feature_gives_the_same_output_with_speculation(engines):
    off, on = engines
    cases = _cases(off)
    prompts = ["The keeper of the light", "Once", "The record:", "def f(x):"]
    requests = [prompts[i % len(prompts)] for i in range(len(cases))]
    want = off.generate(requests, cases)
    before = on.engine.spec.stats()
    got = on.generate(requests, cases)
    stats = on.engine.spec.stats()
    assert stats.accepted - before.accepted > 50 and stats.drafted > stats.accepted
    for i, (w, g) in enumerate(zip(want, got, strict=True)):
        a, b = w.outputs[0], g.outputs[0]
        assert b.token_ids == a.token_ids, f"case {i}"
        assert (b.finish_reason, b.stop_reason) == (a.finish_reason, a.stop_reason), i
        # Logprobs of the emitted tokens: a verify's rows go through the same kernels as
        # decodes, in a wider matrix product (float rounding may differ by ~1e-6).
        for step, (la, lb) in enumerate(zip(a.logprobs, b.logprobs, strict=True)):
            assert la.keys() == lb.keys(), (i, step)
            assert all(abs(la[t] - lb[t]) <= 1e-4 for t in la), (i, step, la, lb)
    assert on.kv_stats().num_blocks_in_use == 0


def test_beam_search_never_speculates(engines):
    off, on = engines
    params = SamplingParams(num_beams=3, max_tokens=12, ignore_eos=True)
    before = on.engine.spec.stats().drafted
    want = off.generate(["The keeper"], params)[0].outputs[0].token_ids
    assert on.generate(["The keeper"], params)[0].outputs[0].token_ids == want
    assert on.engine.spec.stats().drafted == before
