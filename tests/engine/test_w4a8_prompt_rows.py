"""w4a8 with prompt rows through bfloat16 weights (AMX-BF16; `CausalLM.prompt_rows_first`):
a prompt position and a generated one go through different kernels, so a request's tokens
and logprobs must still be bitwise the same alone, batched, chunked, after a preemption
(whose recompute runs generated tokens as generated rows) and on prefix-cache hits, including
a multi-turn prompt that repeats an earlier reply (whose blocks were computed as generated
rows and are not served to a prompt). Each test runs on the tiny Llama with 16-dim heads
(prompt rows attend one by one through the decode kernel) and with 64-dim heads (prompt rows
attend on AMX-BF16 tiles, met.kernels.prompt_attention, where the CPU has them)."""

from __future__ import annotations

import pytest

import met.layers.attention as attention
from met import LLM, SamplingParams
from met.kernels import w4a8
from met.kernels.prompt_attention import prompt_attention_available

TOP2 = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
BLOCK = 16


def _prompts() -> list[list[int]]:
    lengths = [3, 16, 17, 31, 40, 58, 70]
    return [[(7 * i + 13 * j + 5) % 200 + 20 for j in range(n)]
            for i, n in enumerate(lengths)]


def _run(llm: LLM, prompts: list[list[int]], params: SamplingParams = TOP2):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert llm.kv_stats().num_blocks_in_use == 0, "a finished request still holds KV blocks"
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@pytest.fixture(scope="module", params=[16, 64], ids=["head_dim16", "head_dim64"])
def head_dim(request) -> int:
    return request.param


@pytest.fixture(scope="module")
def make(tiny_checkpoint, head_dim):
    model = str(tiny_checkpoint("llama", head_dim=head_dim))

    def build(**kw) -> LLM:
        kw.setdefault("max_model_len", 256)
        return LLM(model, dtype="bfloat16", quantization="w4a8", **kw)

    return build


@pytest.fixture(scope="module")
def alone(make):
    llm = make(enable_prefix_caching=False)
    return [_run(llm, [p])[0] for p in _prompts()]


def test_the_split_runs_where_the_cpu_has_amx_bf16(make):
    llm = make()
    policy = llm.engine.batch_policy  # decided once by the engine, passed down
    assert policy.prompt_rows_first == w4a8.prompt_rows_available()
    assert llm.engine.runner.policy is policy
    assert llm.engine.scheduler.split_at_prompt_end == policy.prompt_rows_first
    assert llm.engine.kv.separate_generated == policy.prompt_rows_first


def test_prompt_rows_attend_on_tiles_where_heads_are_64_wide(make, head_dim, monkeypatch):
    calls = []
    tiles = attention.prompt_attention

    def counting(q, *args):
        calls.append(q.shape[0])
        return tiles(q, *args)

    monkeypatch.setattr(attention, "prompt_attention", counting)
    llm = make(enable_prefix_caching=False)
    _run(llm, _prompts()[:2])
    expected = head_dim == 64 and llm.engine.batch_policy.prompt_rows_first
    assert expected == (head_dim == 64 and prompt_attention_available())
    # Two layers, each attending both prompts' rows in one call (one step: 3 + 16 rows).
    assert calls == ([19, 19] if expected else [])


def test_batched_and_chunked_equal_alone_bit_for_bit(make, alone):
    llm = make(enable_prefix_caching=False)
    assert _run(llm, _prompts()) == alone
    assert _run(llm, _prompts()[::-1]) == alone[::-1]
    assert _run(make(enable_prefix_caching=False, max_num_batched_tokens=16), _prompts()) == alone


def test_preemption_recomputes_generated_tokens_as_generated_rows(make, alone, head_dim):
    # 10 blocks of 16 tokens (bfloat16: k, v × 2 layers × 16 slots × 2 kv heads × head_dim ×
    # 2 bytes each) for 7 requests of up to 6 blocks: the scheduler must preempt, and the
    # recompute of a request's generated tokens must give their KV bit for bit again.
    per_block = 2 * 2 * BLOCK * 2 * head_dim * 2
    llm = make(enable_prefix_caching=False, kv_cache_memory=10 * per_block)
    assert llm.kv_stats().num_blocks_total == 10
    assert _run(llm, _prompts()) == alone
    assert llm.engine.scheduler.num_preemptions > 0, "the small pool never forced a preemption"


def test_prefix_cache_hits_equal_a_cold_run_including_a_repeated_reply(make, alone):
    llm = make()
    split = llm.engine.batch_policy.prompt_rows_first
    assert _run(llm, _prompts()) == alone
    again = llm.generate([{"prompt_token_ids": p} for p in _prompts()], TOP2)
    assert [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in again] == alone
    for prompt, out in zip(_prompts(), again, strict=True):  # prompt blocks are shared
        assert out.num_cached_tokens == (len(prompt) - 1) // BLOCK * BLOCK

    # A second turn: the first prompt, its reply, then more. The reply's KV was computed as
    # generated rows; in this prompt the same tokens are prompt rows.
    first = _prompts()[4]
    reply = llm.generate([{"prompt_token_ids": first}],
                         SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    turn = first + reply[0].outputs[0].token_ids + [21, 22, 23]
    warm = llm.generate([{"prompt_token_ids": turn}], TOP2)[0]
    cold = _run(make(enable_prefix_caching=False), [turn])[0]
    assert (warm.outputs[0].token_ids, warm.outputs[0].logprobs) == cold
    # Only blocks wholly inside the first prompt are served; with every row alike (no
    # AMX-BF16) the blocks holding the reply are served too.
    served = len(first) // BLOCK if split else (len(first) + 40 - 1) // BLOCK
    assert warm.num_cached_tokens == served * BLOCK
    assert llm.kv_stats().num_blocks_in_use == 0
