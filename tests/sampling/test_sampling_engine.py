"""The full sampler through the engine: a seeded request with every penalty and filter on
gives the same tokens alone, in a batch of 16 mixed requests (any row), and on a second
engine instance."""

from __future__ import annotations

import dataclasses

from met import LLM, SamplingParams

ME = SamplingParams(max_tokens=24, temperature=1.1, top_p=0.95, top_k=40, min_p=0.02,
                    top_n_sigma=3.0, repetition_penalty=1.3, presence_penalty=0.4,
                    frequency_penalty=0.3, lz_penalty=0.5, dry_multiplier=0.8,
                    logit_bias={7: 2.0}, bad_words=[(5,)], seed=2024, ignore_eos=True)
MATES = [
    SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=16, temperature=0.8, top_k=5, ignore_eos=True),
    SamplingParams(max_tokens=30, temperature=1.0, min_p=0.1, seed=3, ignore_eos=True),
    SamplingParams(max_tokens=12, temperature=1.3, repetition_penalty=2.0, ignore_eos=True),
    SamplingParams(max_tokens=24, temperature=0.7, allowed_token_ids=[30, 31, 32, 40],
                   ignore_eos=True),
    SamplingParams(max_tokens=18, temperature=1.0, dry_multiplier=2.0, lz_penalty=1.0,
                   logit_bias={9: -100}, ignore_eos=True),
]
PROMPT = [20 + (7 * j) % 150 for j in range(21)]


def _mates(n: int) -> list[tuple[list[int], SamplingParams]]:
    return [([30 + (11 * i + 3 * j) % 120 for j in range(5 + 3 * i)], MATES[i % len(MATES)])
            for i in range(n)]


def _generate(llm: LLM, items) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in items], [s for _, s in items])
    return [o.outputs[0].token_ids for o in outs]


def test_seeded_full_sampler_is_batch_and_instance_invariant(tiny_checkpoint):
    model = str(tiny_checkpoint("llama"))
    llm = LLM(model, dtype="float32", max_model_len=256)
    alone = _generate(llm, [(PROMPT, ME)])[0]
    assert len(alone) == 24 and 5 not in alone
    mates = _mates(15)
    for pos in (0, 7, 15):
        batch = mates[:pos] + [(PROMPT, ME)] + mates[pos:]
        assert _generate(llm, batch)[pos] == alone, pos
    other = LLM(model, dtype="float32", max_model_len=256, seed=99)
    assert _generate(other, [(PROMPT, ME)])[0] == alone
    assert _generate(other, [(PROMPT, dataclasses.replace(ME, seed=2025))])[0] != alone
