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


def test_requests_sharing_a_prompt_compute_it_once_when_submitted_together(llm):
    core: EngineCore = llm.engine
    llm.reset_prefix_cache()
    prompt = list(range(60, 100))  # 40 tokens: 2 full blocks + 8
    for i in range(4):
        core.add_request(f"s{i}", prompt, SamplingParams(max_tokens=4, temperature=1.0,
                                                         seed=i, ignore_eos=True))
    sched = core.scheduler.schedule()
    # The first computes all 40 tokens; the other three reuse its 2 full blocks this step.
    assert [s.num_new_tokens for s in sched.scheduled] == [40, 8, 8, 8]
    assert core.kv_stats().num_blocks_in_use == 3 + 3 * 1
    for i in range(4):
        core.abort_request(f"s{i}")
    assert core.kv_stats().num_blocks_in_use == 0


def test_shared_prefix_in_one_step_gives_the_same_output_as_computing_it_alone(llm):
    llm.reset_prefix_cache()
    prompts = [{"prompt_token_ids": list(range(60, 100)) + [t]} for t in (5, 6, 7)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    together = llm.generate(prompts, params)
    assert [o.num_cached_tokens for o in together] == [0, 32, 32]
    for prompt, out in zip(prompts, together, strict=True):
        llm.reset_prefix_cache()
        alone = llm.generate([prompt], params)[0]
        assert alone.num_cached_tokens == 0
        assert alone.outputs[0].token_ids == out.outputs[0].token_ids


def test_a_failed_forward_leaves_no_half_computed_prefix_in_the_cache(llm, monkeypatch):
    core: EngineCore = llm.engine
    llm.reset_prefix_cache()
    prompt = list(range(100, 140))
    core.add_request("boom", prompt, SamplingParams(max_tokens=2, ignore_eos=True))

    def fail(*_args, **_kwargs):
        raise RuntimeError("forward failed")

    monkeypatch.setattr(core.runner, "execute", fail)
    with pytest.raises(RuntimeError):
        core.step()
    monkeypatch.undo()
    core.abort_request("boom")
    assert core.kv_stats().num_blocks_cached == 0
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=2))[0]
    assert out.num_cached_tokens == 0
