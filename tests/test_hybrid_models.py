"""Hybrid state-space models on state slots: Bamba (Mamba-2 mixers + attention) and
Qwen3-Next (gated delta-net + gated attention).

Beyond the oracle (tests/test_oracle_models.py runs both alone, batched, chunked and from
the prefix cache against transformers), these check what is particular to recurrent state:
a prefix hit restores the state snapshot at its last block and really skips the cached
tokens; a hit whose boundary lost its snapshot falls back to an earlier one (or recomputes);
chunked prefill and batching carry each request's own state; slots bound admission, are
given back at finish, abort and preemption; speculative verifies roll the state back past
rejected drafts; a hybrid drafter is refused.
"""

from __future__ import annotations

import json
import shutil

import pytest
from test_oracle_models import (
    BLOCK_SIZE,
    LOGPROB_ATOL,
    _lp,
    assert_matches_hf,
    generate_checked,
    greedy_params,
    make_llm,
)
from tiny_models import MAX_NEW_TOKENS, VOCAB, hf_greedy_trace, oracle_prompt, oracle_prompts

from met.cache.prefix_hash import extend_block_hashes
from met.config import SpeculativeConfig
from met.spec.decoder import SpecDecoder

# Mamba-2 (Bamba) and gated delta-net (Qwen3-Next) hybrids.
HYBRIDS = ("bamba", "qwen3_next")


def _record_steps(llm, probe=None):
    """Wrap the runner: the tokens each step computes (or ``probe()`` per step)."""
    seen: list = []
    run = llm.engine.runner.execute

    def execute(step, tables):
        seen.append(step.num_tokens if probe is None else probe())
        return run(step, tables)

    llm.engine.runner.execute = execute
    return seen


def _same_outputs(a, b):
    for x, y in zip(a, b, strict=True):
        assert list(x.outputs[0].token_ids) == list(y.outputs[0].token_ids)
        for ex, ey, tok in zip(x.outputs[0].logprobs, y.outputs[0].logprobs,
                               x.outputs[0].token_ids, strict=True):
            assert abs(_lp(ex[tok]) - _lp(ey[tok])) <= LOGPROB_ATOL


@pytest.mark.parametrize("arch", HYBRIDS)
def test_prefix_hit_restores_state_and_skips_compute(arch, tiny_checkpoint):
    model_dir = tiny_checkpoint(arch)
    llm = make_llm(model_dir, enable_prefix_caching=True)
    prompt = oracle_prompt(arch, 75)
    computed = _record_steps(llm)
    (miss,) = generate_checked(llm, [{"prompt_token_ids": prompt}], greedy_params())
    assert miss.num_cached_tokens == 0
    miss_tokens = sum(computed)
    assert miss_tokens == len(prompt) + MAX_NEW_TOKENS - 1
    computed.clear()
    (hit,) = generate_checked(llm, [{"prompt_token_ids": prompt}], greedy_params())
    assert hit.num_cached_tokens == 64  # the last whole block before the final token
    assert sum(computed) == miss_tokens - 64  # the cached prompt tokens did not run
    assert llm.engine.state_stats().num_restores == 1
    assert_matches_hf(miss, model_dir, prompt)
    assert_matches_hf(hit, model_dir, prompt)


@pytest.mark.parametrize("arch", HYBRIDS)
def test_restored_state_is_what_the_hit_continues_from(arch, tiny_checkpoint):
    """The hit test is sensitive: with the snapshots' state wiped (KV kept), the same hit
    no longer reproduces transformers."""
    model_dir = tiny_checkpoint(arch)
    llm = make_llm(model_dir, enable_prefix_caching=True)
    prompt = oracle_prompt(arch, 75)
    (miss,) = generate_checked(llm, [{"prompt_token_ids": prompt}], greedy_params())
    slots = llm.engine.state.num_slots
    for cache in llm.engine.runner.state_caches:
        cache.conv[slots:].zero_()
        cache.ssm[slots:].zero_()
    (wrong,) = generate_checked(llm, [{"prompt_token_ids": prompt}], greedy_params())
    assert wrong.num_cached_tokens == 64
    assert list(wrong.outputs[0].token_ids) != list(miss.outputs[0].token_ids)


@pytest.mark.parametrize("arch", HYBRIDS)
def test_shared_prefix_hits_a_mid_prompt_snapshot(arch, tiny_checkpoint):
    """A request sharing only the first 40 tokens restores the state at position 32 (saved
    while the other prompt's one prefill chunk ran through it) and continues exactly."""
    model_dir = tiny_checkpoint(arch)
    llm = make_llm(model_dir, enable_prefix_caching=True)
    prompt = oracle_prompt(arch, 75)
    generate_checked(llm, [{"prompt_token_ids": prompt[:40]}], greedy_params(max_tokens=1))
    (out,) = generate_checked(llm, [{"prompt_token_ids": prompt}], greedy_params())
    assert out.num_cached_tokens == 32
    assert_matches_hf(out, model_dir, prompt)


@pytest.mark.parametrize("dropped,cached", [((3,), 48), ((1,), 64), ((0, 1, 2, 3), 0)])
@pytest.mark.parametrize("arch", HYBRIDS)
def test_hit_without_snapshot_falls_back(arch, dropped, cached, tiny_checkpoint):
    """Blocks whose KV is cached but whose state snapshot is gone: the hit stops at the last
    block that has one (none: the prompt runs from the start), never at a wrong state."""
    model_dir = tiny_checkpoint(arch)
    llm = make_llm(model_dir, enable_prefix_caching=True)
    prompt = oracle_prompt(arch, 75)
    generate_checked(llm, [{"prompt_token_ids": prompt}], greedy_params())
    hashes: list = []
    extend_block_hashes(hashes, prompt, BLOCK_SIZE)
    for i in dropped:
        llm.engine.state.forget(hashes[i])
        assert llm.engine.kv.pool.lookup(hashes[i]) is not None  # the KV stays cached
    (out,) = generate_checked(llm, [{"prompt_token_ids": prompt}], greedy_params())
    assert out.num_cached_tokens == cached
    assert_matches_hf(out, model_dir, prompt)


@pytest.mark.parametrize("arch", HYBRIDS)
def test_no_snapshot_rows_means_no_hit(arch, tiny_checkpoint):
    model_dir = tiny_checkpoint(arch)
    llm = make_llm(model_dir, enable_prefix_caching=True, state_snapshots=0)
    prompt = oracle_prompt(arch, 40)
    for _ in range(2):
        (out,) = generate_checked(llm, [{"prompt_token_ids": prompt}], greedy_params())
        assert out.num_cached_tokens == 0
        assert_matches_hf(out, model_dir, prompt)


@pytest.mark.parametrize("arch", HYBRIDS)
def test_snapshots_stay_within_their_bound(arch, tiny_checkpoint):
    model_dir = tiny_checkpoint(arch)
    llm = make_llm(model_dir, enable_prefix_caching=True, state_snapshots=3)
    prompts = oracle_prompts(arch)
    outs = generate_checked(llm, [{"prompt_token_ids": p} for p in prompts], greedy_params())
    stats = llm.engine.state_stats()
    assert stats.num_snapshots == 3 == stats.num_snapshot_rows
    for out, prompt in zip(outs, prompts, strict=True):
        assert_matches_hf(out, model_dir, prompt)
    again = generate_checked(llm, [{"prompt_token_ids": p} for p in prompts], greedy_params())
    for out, prompt in zip(again, prompts, strict=True):
        assert_matches_hf(out, model_dir, prompt)


@pytest.mark.parametrize("arch", HYBRIDS)
def test_chunked_prefill_equals_one_chunk(arch, tiny_checkpoint):
    model_dir = tiny_checkpoint(arch)
    prompts = [{"prompt_token_ids": p} for p in oracle_prompts(arch)]
    whole = make_llm(model_dir, enable_prefix_caching=False)
    chunked = make_llm(model_dir, max_num_batched_tokens=BLOCK_SIZE, max_num_seqs=4,
                       enable_prefix_caching=False)
    steps = _record_steps(chunked)
    _same_outputs(generate_checked(whole, prompts, greedy_params()),
                  generate_checked(chunked, prompts, greedy_params()))
    assert max(steps) == BLOCK_SIZE  # the 75-token prompt really ran in 16-token chunks


@pytest.mark.parametrize("arch", HYBRIDS)
def test_batched_equals_alone(arch, tiny_checkpoint):
    model_dir = tiny_checkpoint(arch)
    llm = make_llm(model_dir, enable_prefix_caching=False)
    prompts = [{"prompt_token_ids": p} for p in oracle_prompts(arch)]
    alone = [generate_checked(llm, [p], greedy_params())[0] for p in prompts]
    _same_outputs(alone, generate_checked(llm, prompts, greedy_params()))


@pytest.mark.parametrize("arch", HYBRIDS)
def test_slots_bound_admission(arch, tiny_checkpoint):
    model_dir = tiny_checkpoint(arch)
    llm = make_llm(model_dir, max_num_seqs=2, enable_prefix_caching=True)
    in_use = _record_steps(llm, lambda: llm.engine.state_stats().num_slots_in_use)
    prompts = oracle_prompts(arch)
    outs = generate_checked(llm, [{"prompt_token_ids": p} for p in prompts], greedy_params())
    assert max(in_use) == 2
    for out, prompt in zip(outs, prompts, strict=True):
        assert_matches_hf(out, model_dir, prompt)


@pytest.mark.parametrize("arch", HYBRIDS)
def test_small_kv_pool_preempts_and_matches_hf(arch, tiny_checkpoint):
    """Preemption frees the slot; the re-prefill (from a restored snapshot or from the
    start) gives the same tokens."""
    model_dir = tiny_checkpoint(arch)
    config = json.loads((model_dir / "config.json").read_text())
    attention_layers = (len(config["attn_layer_indices"]) if arch == "bamba"
                        else config["layer_types"].count("full_attention"))
    per_block = (2 * attention_layers * BLOCK_SIZE * config["num_key_value_heads"]
                 * config["head_dim"] * 4)
    for caching in (False, True):
        llm = make_llm(model_dir, kv_cache_memory=12 * per_block,
                       enable_prefix_caching=caching)
        prompts = oracle_prompts(arch)
        need_each = [-(-(len(p) + MAX_NEW_TOKENS) // BLOCK_SIZE) for p in prompts]
        assert max(need_each) <= llm.kv_stats().num_blocks_total < sum(need_each)
        outs = generate_checked(llm, [{"prompt_token_ids": p} for p in prompts],
                                greedy_params())
        for out, prompt in zip(outs, prompts, strict=True):
            assert_matches_hf(out, model_dir, prompt)
        assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("arch", HYBRIDS)
def test_abort_gives_the_slot_back(arch, tiny_checkpoint):
    llm = make_llm(tiny_checkpoint(arch), enable_prefix_caching=True)
    engine = llm.engine
    engine.add_request("r", oracle_prompt(arch, 40), greedy_params())
    engine.step()
    assert engine.state_stats().num_slots_in_use == 1
    engine.abort_request("r")
    assert engine.state_stats().num_slots_in_use == 0
    assert engine.kv_stats().num_blocks_in_use == 0


class _PlantedDrafts:
    """Drafts transformers' greedy continuation with every third draft wrong, so verifies
    accept a run and reject the rest: the state must roll back past the rejected ones."""

    name = "planted"

    def __init__(self, refs: dict[tuple[int, ...], list[int]], vocab: int):
        self.refs, self.vocab = refs, vocab

    def propose(self, request_id, tokens, k):
        for prompt, ref in self.refs.items():
            if tuple(tokens[:len(prompt)]) == prompt:
                drafts = list(ref[len(tokens) - len(prompt):][:k])
                for j in range(2, len(drafts), 3):
                    drafts[j] = (drafts[j] + 1) % self.vocab
                return drafts
        return []

    def finished(self, request_id, tokens):
        pass


@pytest.mark.parametrize("engine", [
    {"enable_prefix_caching": False},
    {"max_num_batched_tokens": BLOCK_SIZE, "max_num_seqs": 4},  # chunked, cached twice
])
@pytest.mark.parametrize("arch", HYBRIDS)
def test_speculative_rollback_matches_hf(arch, engine, tiny_checkpoint):
    model_dir = tiny_checkpoint(arch)
    prompts = oracle_prompts(arch)
    refs = {tuple(p): hf_greedy_trace(model_dir, p, MAX_NEW_TOKENS).tokens for p in prompts}
    llm = make_llm(model_dir, **engine)
    spec = SpecDecoder(SpeculativeConfig(num_speculative_tokens=4, gate=False),
                       _PlantedDrafts(refs, VOCAB[arch]))
    llm.engine.spec = spec
    for _ in range(2):
        outs = generate_checked(llm, [{"prompt_token_ids": p} for p in prompts],
                                greedy_params())
        for out, prompt in zip(outs, prompts, strict=True):
            assert_matches_hf(out, model_dir, prompt)
    alone = [generate_checked(llm, [{"prompt_token_ids": p}], greedy_params())[0]
             for p in prompts[:2]]
    for out, prompt in zip(alone, prompts, strict=False):
        assert_matches_hf(out, model_dir, prompt)
    stats = spec.stats()
    assert stats.accepted > 2 * len(prompts) and stats.drafted > stats.accepted


@pytest.mark.parametrize("arch", HYBRIDS)
def test_ngram_speculation_matches_hf(arch, tiny_checkpoint):
    model_dir = tiny_checkpoint(arch)
    llm = make_llm(model_dir, speculative_config={"method": "ngram", "gate": False})
    prompts = oracle_prompts(arch)
    outs = generate_checked(llm, [{"prompt_token_ids": p} for p in prompts], greedy_params())
    for out, prompt in zip(outs, prompts, strict=True):
        assert_matches_hf(out, model_dir, prompt)


@pytest.mark.parametrize("config,message", [
    ({"method": "self", "num_draft_layers": 1}, "speculative_config.method: self"),
    ({"model": None}, "speculative_config.model: a hybrid"),
])
@pytest.mark.parametrize("arch", HYBRIDS)
def test_hybrid_drafters_are_refused(arch, config, message, tiny_checkpoint):
    """A drafter keeps no state slots: a hybrid draft (or self-speculation on a hybrid) is
    refused by name."""
    model_dir = tiny_checkpoint(arch)
    config = {k: (str(model_dir) if v is None else v) for k, v in config.items()}
    with pytest.raises(ValueError, match=message):
        make_llm(model_dir, speculative_config=config)


@pytest.mark.parametrize("arch", HYBRIDS)
def test_hybrid_without_attention_layer_is_refused(arch, tiny_checkpoint, tmp_path):
    model_dir = tmp_path / "bamba-no-attention"
    shutil.copytree(tiny_checkpoint(arch), model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    if arch == "bamba":
        config["attn_layer_indices"] = None
    else:
        config["layer_types"] = ["linear_attention"] * len(config["layer_types"])
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="attn_layer_indices" if arch == "bamba"
                       else "layer_types"):
        make_llm(model_dir)


def test_state_snapshots_flag_reaches_the_engine_config(tiny_checkpoint):
    import argparse

    from met.cli.args import add_engine_args, engine_config
    from met.config import EngineConfig

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args([str(tiny_checkpoint("bamba")), "--state-snapshots", "5"])
    assert engine_config(args).state_snapshots == 5
    with pytest.raises(ValueError, match="state_snapshots: must be >= 0"):
        EngineConfig(state_snapshots=-1)
