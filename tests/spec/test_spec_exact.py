"""Speculative decoding changes no output: at temperature 0 every architecture's tokens and
logprobs equal transformers' with drafts verified (some right, some wrong), alone, batched,
in prefill chunks and under preemption; no KV block outlives a request. At temperature > 0
the output distribution is the target's (a two-sample test against speculation off), and a
seeded request gives the same tokens with speculation on or off, whatever its batch mates."""

from __future__ import annotations

import json

import pytest
from scipy.stats import chi2_contingency
from tiny_models import (
    ARCHS,
    MAX_NEW_TOKENS,
    hf_greedy_trace,
    length_dependent_rope,
    oracle_prompt,
    oracle_prompts,
)

from met import LLM, SamplingParams
from met.config import SpeculativeConfig
from met.spec.decoder import SpecDecoder

BLOCK_SIZE = 16


def _llm(model_dir, **kwargs) -> LLM:
    kwargs = {"dtype": "float32", "block_size": BLOCK_SIZE, "max_model_len": 256} | kwargs
    return LLM(str(model_dir), **kwargs)


def _greedy(max_tokens: int = MAX_NEW_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0)


class PlantedOracle:
    """Drafts transformers' own greedy continuation with every third draft wrong: each
    verify then accepts a run of drafts and rejects the rest (rolled back)."""

    name = "oracle"

    def __init__(self, refs: dict[tuple[int, ...], list[int]], vocab: int):
        self.refs = refs  # prompt → HF greedy continuation
        self.vocab = vocab

    def propose(self, request_id, tokens, k):
        for prompt, ref in self.refs.items():
            if tuple(tokens[:len(prompt)]) == prompt:
                i = len(tokens) - len(prompt)
                drafts = list(ref[i:i + k])
                for j in range(2, len(drafts), 3):
                    drafts[j] = (drafts[j] + 1) % self.vocab
                return drafts
        return []

    def finished(self, request_id, tokens):
        pass


def _speculating(llm: LLM, proposer, k: int = 4) -> SpecDecoder:
    spec = SpecDecoder(SpeculativeConfig(num_speculative_tokens=k, gate=False), proposer)
    llm.engine.spec = spec
    return spec


def _refs(model_dir, prompts) -> dict[tuple[int, ...], list[int]]:
    return {tuple(p): hf_greedy_trace(model_dir, p, MAX_NEW_TOKENS).tokens for p in prompts}


def _assert_hf(outs, refs, model_dir, prompts):
    for out, prompt in zip(outs, prompts, strict=True):
        ref = hf_greedy_trace(model_dir, prompt, MAX_NEW_TOKENS)
        comp = out.outputs[0]
        assert comp.token_ids == ref.tokens, f"{len(prompt)}-token prompt"
        assert len(comp.logprobs) == len(ref.tokens)
        for step, (tok, entry) in enumerate(zip(comp.token_ids, comp.logprobs, strict=True)):
            assert abs(entry[tok] - ref.logprobs[step]) <= 1e-4, (len(prompt), step)


def _generate(llm: LLM, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert llm.kv_stats().num_blocks_in_use == 0, "KV blocks outlived their requests"
    return outs


@pytest.mark.parametrize("arch", ARCHS)
def test_verified_drafts_match_hf_alone_and_batched(arch, tiny_checkpoint):
    model_dir = tiny_checkpoint(arch)
    prompts = oracle_prompts(arch)
    refs = _refs(model_dir, prompts)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    llm = _llm(model_dir, enable_prefix_caching=False)
    spec = _speculating(llm, PlantedOracle(refs, vocab))
    outs = [_generate(llm, [p], _greedy())[0] for p in prompts]
    _assert_hf(outs, refs, model_dir, prompts)
    outs = _generate(llm, prompts, _greedy())
    _assert_hf(outs, refs, model_dir, prompts)
    stats = spec.stats()
    # Right drafts were kept and wrong ones rolled back, many times over.
    assert stats.accepted > 2 * len(prompts) and stats.drafted > stats.accepted
    assert stats.mean_accepted_length > 2.0


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen3_moe"])
def test_verified_drafts_match_hf_chunked_cached_and_preempted(arch, tiny_checkpoint):
    """A 16-token budget (drafts trimmed to what is left of it, beside prefill chunks), the
    prefix cache on (a second pass hits blocks that verification wrote), and a KV pool too
    small for every request (drafts never preempt; preemption drops them)."""
    model_dir = tiny_checkpoint(arch)
    prompts = oracle_prompts(arch)
    refs = _refs(model_dir, prompts)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    chunked = _llm(model_dir, max_num_batched_tokens=BLOCK_SIZE, max_num_seqs=4)
    _speculating(chunked, PlantedOracle(refs, vocab))
    for _ in range(2):
        _assert_hf(_generate(chunked, prompts, _greedy()), refs, model_dir, prompts)
    assert chunked.kv_stats().num_blocks_cached > 0

    config = json.loads((model_dir / "config.json").read_text())
    per_block = (2 * config["num_hidden_layers"] * BLOCK_SIZE * config["num_key_value_heads"]
                 * config["head_dim"] * 4)
    small = _llm(model_dir, kv_cache_memory=12 * per_block, enable_prefix_caching=False)
    spec = _speculating(small, PlantedOracle(refs, vocab))
    _assert_hf(_generate(small, prompts, _greedy()), refs, model_dir, prompts)
    assert small.engine.scheduler.num_preemptions > 0
    assert spec.stats().accepted > 0


@pytest.mark.parametrize("method", ["ngram", "suffix"])
@pytest.mark.parametrize("arch", ARCHS)
def test_ngram_and_suffix_match_hf(arch, method, tiny_checkpoint):
    """The real proposers through the user's switch: random tiny models fall into loops,
    which prompt lookup drafts."""
    model_dir = tiny_checkpoint(arch)
    prompts = oracle_prompts(arch)
    refs = _refs(model_dir, prompts)
    llm = _llm(model_dir, speculative_config={"method": method, "gate": False})
    for _ in range(2):  # the second pass: suffix finds the first pass's requests
        _assert_hf(_generate(llm, prompts, _greedy()), refs, model_dir, prompts)
    stats = llm.engine.spec.stats()
    assert stats.method == method and stats.drafted > 0


def test_request_that_opts_out_never_drafts(tiny_checkpoint):
    model_dir = tiny_checkpoint("llama")
    prompt = oracle_prompt("llama", 40)
    llm = _llm(model_dir, speculative_config={"method": "ngram", "gate": False})
    off = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True,
                         speculative=False)
    _generate(llm, [prompt], off)
    assert llm.engine.spec.stats().drafted == 0
    _generate(llm, [prompt], _greedy())
    assert llm.engine.spec.stats().drafted > 0


class GreedyDrafts:
    """Drafts the greedy continuation: at temperature > 0 some samples equal it (accepted)
    and some do not (the rest rejected), so both paths shape the sampled distribution."""

    name = "greedy"

    def __init__(self, ref: list[int], prompt_len: int):
        self.ref, self.prompt_len = ref, prompt_len

    def propose(self, request_id, tokens, k):
        # The greedy path's next tokens after this request's output so far, shifted to it.
        i = len(tokens) - self.prompt_len
        return list(self.ref[i:i + k])

    def finished(self, request_id, tokens):
        pass


def _sampled(llm: LLM, prompt, n: int, params: SamplingParams) -> list[tuple[int, ...]]:
    outs = _generate(llm, [prompt] * n, params)
    return [tuple(o.outputs[0].token_ids) for o in outs]


def test_sampling_distribution_is_the_targets(tiny_checkpoint):
    """Unseeded requests at temperature 0.8, top_k 3 (a few outcomes per step): the joint
    distribution of the 2nd and 3rd tokens with speculation on is that of speculation off
    (chi-squared two-sample test). Keeping one wrong first draft in three, instead of only
    drafts that equal the target's sample, fails this test (p ~ 1e-10)."""
    model_dir = tiny_checkpoint("llama")
    prompt = oracle_prompt("llama", 17)
    ref = hf_greedy_trace(model_dir, prompt, 8).tokens
    params = SamplingParams(max_tokens=3, temperature=0.8, top_k=3, ignore_eos=True)
    n = 1500
    off = _llm(model_dir, max_num_seqs=256, seed=1)
    on = _llm(model_dir, max_num_seqs=256, seed=2)
    spec = _speculating(on, GreedyDrafts(ref, len(prompt)), k=2)
    a = _sampled(off, prompt, n, params)
    b = _sampled(on, prompt, n, params)
    assert spec.stats().accepted > n // 4 and spec.stats().drafted > spec.stats().accepted
    keys = sorted({s[1:] for s in a} | {s[1:] for s in b})
    table = [[sum(s[1:] == k for s in a) for k in keys], [sum(s[1:] == k for s in b) for k in keys]]
    p = chi2_contingency(table).pvalue
    assert p > 1e-3, (p, keys, table)


def test_seeded_requests_are_the_same_with_speculation(tiny_checkpoint):
    """temperature 1: a seeded request's tokens with speculation on equal those without,
    alone and beside other requests (seeded or not)."""
    model_dir = tiny_checkpoint("llama")
    prompt = oracle_prompt("llama", 40)
    ref = hf_greedy_trace(model_dir, prompt, 24).tokens
    seeded = [SamplingParams(max_tokens=24, temperature=1.0, top_k=3, seed=s, ignore_eos=True)
              for s in range(8)]
    off = _llm(model_dir)
    want = [o.outputs[0].token_ids
            for o in off.generate([{"prompt_token_ids": prompt}] * 8, seeded)]
    on = _llm(model_dir)
    spec = _speculating(on, GreedyDrafts(ref, len(prompt)))
    alone = [on.generate([{"prompt_token_ids": prompt}], [p])[0].outputs[0].token_ids
             for p in seeded[:3]]
    assert alone == want[:3]
    mates = [SamplingParams(max_tokens=24, temperature=1.0, ignore_eos=True)] * 5
    outs = on.generate([{"prompt_token_ids": prompt}] * 13, seeded + mates)
    assert [o.outputs[0].token_ids for o in outs[:8]] == want
    assert on.kv_stats().num_blocks_in_use == 0
    assert spec.stats().accepted > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_draft_model_and_self_speculation_match_hf(arch, tiny_checkpoint):
    """A draft model (here the target's own checkpoint: every greedy draft must then be
    accepted, which holds only if the drafter's cache follows the target's tokens through
    acceptance and rollback exactly) and self-speculation (the first of two layers drafts:
    mostly rejected) both leave transformers' tokens unchanged, batched and alone."""
    model_dir = tiny_checkpoint(arch)
    prompts = oracle_prompts(arch)
    refs = _refs(model_dir, prompts)
    same = _llm(model_dir, speculative_config={"model": str(model_dir), "gate": False})
    _assert_hf(_generate(same, prompts, _greedy()), refs, model_dir, prompts)
    _assert_hf([_generate(same, [p], _greedy())[0] for p in prompts[:2]], refs, model_dir,
               prompts[:2])
    stats = same.engine.spec.stats()
    assert stats.method == "draft_model" and stats.drafted > 0
    if length_dependent_rope(model_dir):
        # The drafter is not told the prompt length, so a length-dependent rope (dynamic,
        # longrope) rotates its prompt as generated rows: other drafts, same output.
        assert 0 < stats.accepted <= stats.drafted, stats
    else:
        assert stats.accepted == stats.drafted, stats
    pool = same.engine.spec.proposer.kv.pool
    assert pool.num_free == pool.num_blocks  # finished requests left no draft KV behind

    self_spec = _llm(model_dir, speculative_config={"method": "self", "num_draft_layers": 1,
                                                    "gate": False})
    _assert_hf(_generate(self_spec, prompts, _greedy()), refs, model_dir, prompts)
    stats = self_spec.engine.spec.stats()
    assert stats.method == "self" and stats.drafted > stats.accepted


def test_a_draft_model_with_another_tokenizer_is_refused(tiny_checkpoint):
    with pytest.raises(ValueError, match="speculative_config.model: the draft's tokenizer"):
        _llm(tiny_checkpoint("llama"),
             speculative_config={"model": str(tiny_checkpoint("qwen2"))})
    with pytest.raises(ValueError, match="num_draft_layers: must be in"):
        _llm(tiny_checkpoint("llama"),
             speculative_config={"method": "self", "num_draft_layers": 2})


@pytest.mark.parametrize("config", [{"method": "ngram", "gate": False},
                                    {"method": "self", "num_draft_layers": 1, "gate": False}])
def test_abort_mid_speculation_frees_every_block(config, tiny_checkpoint):
    """A client that disconnects while its request verifies drafts: the target's blocks
    (drafts' included) and the drafter's are all free again."""
    llm = _llm(tiny_checkpoint("llama"), speculative_config=config)
    core = llm.engine
    for i, p in enumerate(oracle_prompts("llama")):
        core.add_request(str(i), p, _greedy(150))
    while core.spec.stats().accepted < 4 and core.spec.stats().drafted < 40:
        core.step()
    assert core.kv_stats().num_blocks_in_use > 0
    for i in range(len(oracle_prompts("llama"))):
        core.abort_request(str(i))
    assert core.kv_stats().num_blocks_in_use == 0
    drafter = getattr(core.spec.proposer, "kv", None)
    if drafter is not None:
        assert drafter.pool.num_free == drafter.pool.num_blocks
    assert not core.has_unfinished()


@pytest.mark.parametrize("engine", [{"attention_backend": "torch"}, {"dtype": "bfloat16"},
                                    {"kv_cache_dtype": "int8"}])
def test_other_paths_give_the_same_tokens_with_speculation(engine, tiny_checkpoint):
    """The PyTorch attention reference, bfloat16 and an int8 KV cache (paths whose own
    distance from transformers is tested elsewhere): speculation changes no token."""
    model_dir = tiny_checkpoint("llama")
    prompts = [{"prompt_token_ids": p} for p in oracle_prompts("llama")]
    off = _llm(model_dir, **engine)
    on = _llm(model_dir, speculative_config={"model": str(model_dir), "gate": False}, **engine)
    want = [o.outputs[0].token_ids for o in off.generate(prompts, _greedy())]
    assert [o.outputs[0].token_ids for o in on.generate(prompts, _greedy())] == want
    assert on.engine.spec.stats().accepted > 20
    assert on.kv_stats().num_blocks_in_use == 0
