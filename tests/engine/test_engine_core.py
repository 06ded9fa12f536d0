"""EngineCore behaviour a user of the offline API or the server would notice."""

from __future__ import annotations

import pytest

from met import LLM, SamplingParams
from met.engine.core import EngineCore


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(str(tiny_checkpoint("llama")), dtype="float32", max_model_len=128, max_num_seqs=4)


def test_prompt_plus_max_tokens_over_max_model_len_is_a_clear_error(llm):
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([{"prompt_token_ids": [5] * 100}], SamplingParams(max_tokens=50))
    assert llm.kv_stats().num_blocks_in_use == 0


def test_abort_frees_blocks_at_once(llm):
    core: EngineCore = llm.engine
    core.add_request("a", list(range(10, 50)), SamplingParams(max_tokens=30, ignore_eos=True))
    core.step()
    assert core.kv_stats().num_blocks_in_use == 3  # 40 prompt tokens + 1 -> 3 blocks of 16
    core.abort_request("a")
    assert core.kv_stats().num_blocks_in_use == 0
    assert not core.has_unfinished()


def test_new_prefills_share_one_forward_and_respect_max_num_seqs(llm):
    core: EngineCore = llm.engine
    for i in range(6):
        core.add_request(f"r{i}", [20 + i] * 10, SamplingParams(max_tokens=3, ignore_eos=True))
    sched = core.scheduler.schedule()
    # Four prefills (max_num_seqs=4) go into the same step; two wait.
    assert [s.request.request_id for s in sched.scheduled] == ["r0", "r1", "r2", "r3"]
    assert len(core.scheduler.waiting) == 2
    for i in range(6):
        core.abort_request(f"r{i}")
    assert core.kv_stats().num_blocks_in_use == 0


def test_stop_token_ids_and_max_tokens_finish_reasons(llm):
    prompt = {"prompt_token_ids": list(range(30, 45))}
    free = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    tokens = free[0].outputs[0].token_ids
    assert free[0].outputs[0].finish_reason == "length" and len(tokens) == 8
    stop_at = tokens[3]
    stopped = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                                    stop_token_ids=[stop_at]))
    out = stopped[0].outputs[0]
    first = tokens.index(stop_at)
    assert out.token_ids == tokens[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at


def test_min_tokens_holds_back_stop_tokens(llm):
    prompt = {"prompt_token_ids": list(range(30, 45))}
    tokens = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0,
                                                   ignore_eos=True))[0].outputs[0].token_ids
    out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                                stop_token_ids=[tokens[0]], min_tokens=4))
    produced = out[0].outputs[0].token_ids
    assert len(produced) >= 4 and tokens[0] not in produced[:4]


def test_out_of_vocab_prompt_is_rejected(llm):
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate([{"prompt_token_ids": [1, 2, 10**6]}], SamplingParams(max_tokens=2))


def test_seed_makes_sampling_reproducible_and_seeds_differ(llm):
    prompt = {"prompt_token_ids": list(range(50, 70))}
    a = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=1.0, seed=7))
    b = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=1.0, seed=7))
    c = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=1.0, seed=8))
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids
    assert a[0].outputs[0].token_ids != c[0].outputs[0].token_ids
