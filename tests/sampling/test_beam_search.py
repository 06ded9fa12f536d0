"""Beam search equals transformers' ``generate(num_beams=…)`` on tiny random models."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from tiny_models import oracle_prompts

from met import LLM, SamplingParams
from met.sampling.beam_search import BeamSearchState

MAX_NEW = 10


@pytest.fixture(scope="module")
def setup(tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoint("llama")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                              attn_implementation="eager").eval()
    llm = LLM(str(path), dtype="float32", max_model_len=256)
    return hf, llm


def _hf_beams(hf, prompt, num_beams, eos_ids, **kw):
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, num_beams=num_beams,
                          num_return_sequences=num_beams, do_sample=False,
                          eos_token_id=eos_ids, pad_token_id=eos_ids[0], output_scores=True,
                          return_dict_in_generate=True, **kw)
    seqs = []
    for row in out.sequences.tolist():
        gen = row[len(prompt):]
        # strip the padding after the first stop token
        for j, t in enumerate(gen):
            if t in eos_ids:
                gen = gen[: j + 1]
                break
        seqs.append(gen)
    return seqs, out.sequences_scores.tolist()


def _frequent_token(hf, prompt) -> int:
    """A token the model emits often after ``prompt``: used as an extra stop token, so
    hypotheses finish early and the EOS / length-penalty rules are exercised."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                          pad_token_id=0)
    return Counter(out[0, len(prompt):].tolist()).most_common(1)[0][0]


@pytest.mark.parametrize("num_beams, length_penalty, early_stopping", [
    (2, 1.0, False), (4, 1.0, False), (3, 0.5, True), (4, 2.0, "never"), (3, -1.0, False),
])
def test_beams_equal_transformers(setup, num_beams, length_penalty, early_stopping):
    hf, llm = setup
    model_eos = hf.generation_config.eos_token_id
    model_eos = [model_eos] if isinstance(model_eos, int) else list(model_eos)
    for prompt in oracle_prompts("llama")[:3]:
        stop = _frequent_token(hf, prompt)
        eos_ids = model_eos + [stop]
        want, want_scores = _hf_beams(hf, prompt, num_beams, eos_ids,
                                      length_penalty=length_penalty,
                                      early_stopping=early_stopping)
        out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(
            max_tokens=MAX_NEW, num_beams=num_beams, length_penalty=length_penalty,
            early_stopping=early_stopping, stop_token_ids=[stop]))[0]
        got = [o.token_ids for o in out.outputs]
        assert got == want, (prompt, got, want)
        scores = [o.cumulative_logprob for o in out.outputs]
        assert scores == pytest.approx(want_scores, abs=1e-4)
        if length_penalty <= 1.0:  # (a high penalty rightly prefers the longest beams)
            assert any(len(w) < MAX_NEW for w in want)  # the stop token ended some beams
    assert llm.kv_stats().num_blocks_in_use == 0


def test_best_beam_beats_or_equals_greedy(setup):
    """The reason to use beam search: the returned beam's total logprob is at least greedy's."""
    _, llm = setup
    prompt = {"prompt_token_ids": oracle_prompts("llama")[1]}
    greedy = llm.generate(prompt, SamplingParams(max_tokens=MAX_NEW, temperature=0.0,
                                                 ignore_eos=True, logprobs=0))[0].outputs[0]
    greedy_total = sum(lp[t] for t, lp in zip(greedy.token_ids, greedy.logprobs, strict=True))
    beam = llm.generate(prompt, SamplingParams(max_tokens=MAX_NEW, num_beams=4,
                                               ignore_eos=True, length_penalty=0.0))[0]
    assert beam.outputs[0].cumulative_logprob >= greedy_total - 1e-5
    assert len(beam.outputs) == 4


def test_beam_and_plain_requests_in_one_call(setup):
    _, llm = setup
    prompts = [{"prompt_token_ids": p} for p in oracle_prompts("llama")[:2]]
    plain = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    alone = llm.generate(prompts[0], plain)[0].outputs[0].token_ids
    outs = llm.generate(prompts, [plain, SamplingParams(max_tokens=6, num_beams=2)])
    assert outs[0].outputs[0].token_ids == alone
    assert len(outs[1].outputs) == 2


@pytest.mark.parametrize("kwargs, match", [
    ({"num_beams": 0}, "num_beams"),
    ({"early_stopping": "sometimes"}, "early_stopping"),
    ({"length_penalty": float("inf")}, "length_penalty"),
])
def test_invalid_beam_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_state_rejects_more_results_than_beams():
    with pytest.raises(ValueError, match="n: must be in"):
        BeamSearchState(2, 8, frozenset({0}), num_results=3)
