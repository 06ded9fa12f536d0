"""A prompt's output must not depend on how the engine happened to schedule it.

Reference: each prompt run alone, whole prompt in one chunk, prefix cache off. Then the same
prompts batched, chunked, prefix-cache hit, and preempted must give identical tokens.
"""

from __future__ import annotations

import pytest

from met import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, top_k=50, seed=1234,
                        ignore_eos=True)


def _prompts(n: int = 10) -> list[list[int]]:
    # Mixed lengths, some crossing several 16-token blocks, all starting differently.
    lengths = [3, 9, 16, 17, 23, 31, 40, 47, 58, 70][:n]
    return [[(7 * i + 13 * j + 5) % 200 + 20 for j in range(n_tok)]
            for i, n_tok in enumerate(lengths)]


def _run(llm: LLM, prompts, params) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert llm.kv_stats().num_blocks_in_use == 0, "a finished request still holds KV blocks"
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module", params=["llama", "gemma3", "qwen3_moe", "mixtral", "gpt_oss"])
def model_dir(request, tiny_checkpoint):
    return str(tiny_checkpoint(request.param))


@pytest.fixture(scope="module")
def reference(model_dir):
    llm = LLM(model_dir, dtype="float32", max_model_len=256, enable_prefix_caching=False)
    ref = {}
    for name, params in (("greedy", GREEDY), ("seeded", SEEDED)):
        ref[name] = [_run(llm, [p], params)[0] for p in _prompts()]
    return ref


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_batched_equals_alone(model_dir, reference, kind):
    llm = LLM(model_dir, dtype="float32", max_model_len=256, enable_prefix_caching=False)
    params = GREEDY if kind == "greedy" else SEEDED
    assert _run(llm, _prompts(), params) == reference[kind]
    # Reverse order: a request's row in the batch must not matter either.
    assert _run(llm, _prompts()[::-1], params) == reference[kind][::-1]


@pytest.mark.parametrize("chunk", [16, 64])
def test_chunked_prefill_equals_whole_prompt(model_dir, reference, chunk):
    llm = LLM(model_dir, dtype="float32", max_model_len=256, max_num_batched_tokens=chunk,
              enable_prefix_caching=False)
    assert _run(llm, _prompts(), GREEDY) == reference["greedy"]
    assert _run(llm, _prompts(), SEEDED) == reference["seeded"]


def test_prefix_cache_hit_equals_miss(model_dir, reference):
    llm = LLM(model_dir, dtype="float32", max_model_len=256)
    first = llm.generate([{"prompt_token_ids": p} for p in _prompts()], GREEDY)
    again = llm.generate([{"prompt_token_ids": p} for p in _prompts()], GREEDY)
    assert [o.outputs[0].token_ids for o in first] == reference["greedy"]
    assert [o.outputs[0].token_ids for o in again] == reference["greedy"]
    for prompt, out in zip(_prompts(), again, strict=True):
        # Every full block except the one holding the last prompt token comes from cache.
        assert out.num_cached_tokens == (len(prompt) - 1) // 16 * 16
    assert llm.kv_stats().num_blocks_in_use == 0


def test_preemption_keeps_output(model_dir, reference):
    # 12 blocks of 16 tokens for 10 requests that need up to 6 blocks each: the scheduler
    # must preempt and recompute, and every output must still match.
    per_block = 2 * 2 * 16 * 2 * 16 * 4  # 2 (k,v) x layers x block x kv_heads x head_dim x fp32
    llm = LLM(model_dir, dtype="float32", max_model_len=256, kv_cache_memory=12 * per_block)
    assert llm.kv_stats().num_blocks_total == 12
    assert _run(llm, _prompts(), GREEDY) == reference["greedy"]
    assert _run(llm, _prompts(), SEEDED) == reference["seeded"]
    assert llm.engine.scheduler.num_preemptions > 0, "the tiny pool never forced a preemption"


# ---- the fast CPU paths ---------------------------------------------------------------------
# bfloat16 (fused ops, oneDNN's packed weights, one-row kernels), int8 / int4 weight-only
# (GEMV kernels for few rows, the bfloat16 matrix units for many), w8a8 and w4a8 (exact
# integer sums, prompt rows attending one at a time): a request's tokens must not
# depend on how many rows its step had, which kernel that picked, or how its prompt was cut.


INT8_GAP = pytest.mark.xfail(
    reason="int8's few-row kernel (torch's _weight_int8pack_mm) sums in another order than "
           "its many-row path: with 16-token prefill chunks 1 of 10 prompts turns at token 8",
    strict=False)


@pytest.fixture(scope="module",
                params=[None, pytest.param("int8", marks=INT8_GAP), "int4", "w8a8", "w4a8"])
def fast_path(request, tiny_checkpoint):
    model = str(tiny_checkpoint("llama"))

    def make(**kw) -> LLM:
        return LLM(model, dtype="bfloat16", quantization=request.param, max_model_len=256,
                   enable_prefix_caching=False, **kw)

    alone = make()
    reference = [_run(alone, [p], GREEDY)[0] for p in _prompts()]
    return make, reference


def test_fast_paths_batched_and_chunked_equal_alone(fast_path):
    make, reference = fast_path
    llm = make()
    assert _run(llm, _prompts(), GREEDY) == reference
    assert _run(llm, _prompts()[::-1], GREEDY) == reference[::-1]
    assert _run(make(max_num_batched_tokens=16), _prompts(), GREEDY) == reference
