"""prompt_logprobs: for each prompt token after the first, its logprob given the tokens
before it (and the top-k there), equal to transformers' full-context log-softmax — through
chunked prefill, in a batch with other requests, and after the prompt is in the prefix cache
(such a request skips the cache so that every position runs)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import _full_context_logits, load_hf_model

from met import LLM, SamplingParams

PROMPT = [20 + (7 * j) % 150 for j in range(41)]
OTHER = [30 + (11 * j) % 120 for j in range(23)]
TOP = 3


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return str(tiny_checkpoint("llama"))


@pytest.fixture(scope="module")
def reference(ckpt):
    with torch.no_grad():
        return torch.log_softmax(_full_context_logits(load_hf_model(ckpt), PROMPT), dim=-1)


def _check(entries, ref, top: int) -> None:
    assert len(entries) == len(PROMPT) and entries[0] is None
    for pos in range(1, len(PROMPT)):
        row, entry = ref[pos - 1], entries[pos]
        tok = PROMPT[pos]
        assert entry[tok] == pytest.approx(float(row[tok]), abs=1e-4), pos
        want = dict(zip(row.topk(top).indices.tolist(), row.topk(top).values.tolist(),
                        strict=True))
        got = {t: v for t, v in entry.items() if t != tok or tok in want}
        assert sorted(got) == sorted(want), pos
        for t, v in want.items():
            assert got[t] == pytest.approx(v, abs=1e-4), (pos, t)


def test_prompt_logprobs_match_transformers_with_chunked_prefill(ckpt, reference):
    # 16-token steps: the 41-token prompt runs in three chunks, next to another request.
    llm = LLM(ckpt, dtype="float32", max_model_len=128, block_size=8,
              max_num_batched_tokens=16)
    params = SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=TOP)
    outs = llm.generate([{"prompt_token_ids": PROMPT}, {"prompt_token_ids": OTHER}],
                        [params, SamplingParams(max_tokens=3, temperature=0.0)])
    _check(outs[0].prompt_logprobs, reference, TOP)
    assert outs[1].prompt_logprobs is None
    # prompt_logprobs=0: only each prompt token's own logprob.
    zero = llm.generate([{"prompt_token_ids": PROMPT}],
                        SamplingParams(max_tokens=1, prompt_logprobs=0))[0].prompt_logprobs
    assert all(len(e) == 1 and PROMPT[i] in e for i, e in enumerate(zero) if i)


def test_prompt_logprobs_skip_the_prefix_cache(ckpt, reference):
    llm = LLM(ckpt, dtype="float32", max_model_len=128, block_size=8)
    plain = SamplingParams(max_tokens=2, temperature=0.0)
    llm.generate([{"prompt_token_ids": PROMPT}], plain)
    hit = llm.generate([{"prompt_token_ids": PROMPT}], plain)[0]
    assert hit.num_cached_tokens > 0  # the premise: the prompt is cached
    out = llm.generate([{"prompt_token_ids": PROMPT}],
                       SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=TOP))[0]
    assert out.num_cached_tokens == 0
    _check(out.prompt_logprobs, reference, TOP)
    assert out.outputs[0].token_ids == hit.outputs[0].token_ids


def test_invalid_prompt_logprobs_names_the_field():
    with pytest.raises(ValueError, match="^prompt_logprobs:"):
        SamplingParams(prompt_logprobs=21)


def test_prompt_logprobs_survive_preemption(ckpt, reference):
    # 13 blocks of 8 tokens: two 41-token prompts (6 blocks each) are admitted, then their
    # decodes need a 7th block each, so one is preempted and its prompt recomputed; the
    # recompute must not add entries (each prompt token has exactly one).
    per_block = 2 * 2 * 8 * 2 * 16 * 4  # (k,v) x layers x block x kv_heads x head_dim x fp32
    llm = LLM(ckpt, dtype="float32", max_model_len=128, block_size=8,
              kv_cache_memory=13 * per_block)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                            prompt_logprobs=TOP)
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * 3, params)
    assert llm.engine.scheduler.num_preemptions > 0, "the tiny pool never forced a preemption"
    for out in outs:
        _check(out.prompt_logprobs, reference, TOP)
