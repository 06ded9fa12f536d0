"""Scaled ropes beyond the shared oracle (test_oracle_models.py runs llama_yarn,
llama_dynamic and llama_longrope alone, batched, chunked and from the prefix cache).

Checked here: each scaling changes the output (so the oracle really tests it); for the
length-dependent ropes, transformers' cached generate (the reference met follows) differs
from a full-context forward (so the choice of reference matters); and a prefix-cache hit
between prompts of different lengths is served only KV rotated as a miss would rotate it.
"""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import (
    MAX_NEW_TOKENS,
    SCALED_ROPE_ORIGINAL_MAX_POS,
    generate_trace,
    greedy_trace,
    hf_greedy_trace,
    load_hf_model_with,
    oracle_prompt,
    oracle_prompts,
)

from met import LLM, SamplingParams

SCALED = ("llama_yarn", "llama_dynamic", "llama_longrope")


def _trace(model_dir, model, prompt, n=MAX_NEW_TOKENS):
    rope = json.loads((model_dir / "config.json").read_text())["rope_parameters"]
    if rope["rope_type"] in ("dynamic", "longrope"):
        return generate_trace(model, prompt, n)
    return greedy_trace(model, prompt, n)


@pytest.mark.parametrize("arch", SCALED)
def test_hf_rope_scaling_matters(arch, tiny_checkpoint):
    model_dir = tiny_checkpoint(arch)
    theta = json.loads((model_dir / "config.json").read_text())["rope_parameters"]["rope_theta"]
    for prompt in oracle_prompts(arch)[1:]:
        assert len(prompt) + MAX_NEW_TOKENS > SCALED_ROPE_ORIGINAL_MAX_POS
        plain = load_hf_model_with(
            model_dir, rope_parameters={"rope_type": "default", "rope_theta": theta})
        a = hf_greedy_trace(model_dir, prompt, MAX_NEW_TOKENS)
        b = _trace(model_dir, plain, prompt)
        assert a.tokens != b.tokens or max(
            abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) > 1e-2


@pytest.mark.parametrize("arch", ["llama_dynamic", "llama_longrope"])
def test_hf_generate_differs_from_full_context(arch, tiny_checkpoint):
    """transformers rotates a whole context for its length in a cache-free forward, but
    keeps cached keys in generate: the two disagree past the original length."""
    model_dir = tiny_checkpoint(arch)
    prompt = oracle_prompt(arch, 17)  # crosses the original length (32) while decoding
    gen = generate_trace(load_hf_model_with(model_dir), prompt, MAX_NEW_TOKENS)
    full = greedy_trace(load_hf_model_with(model_dir), prompt, MAX_NEW_TOKENS)
    assert max(abs(x - y) for x, y in zip(gen.logprobs, full.logprobs, strict=True)) > 1e-3


@pytest.mark.parametrize("arch", ["llama_dynamic", "llama_longrope"])
def test_prefix_hit_across_prompt_lengths_matches_hf(arch, tiny_checkpoint):
    """Prompts sharing 64 tokens, of 75 and 70 tokens: dynamic NTK rotates each for its
    own length, so the second may not reuse the first's blocks; longrope rotates both with
    its long factors, so it may. A prompt within the original length shares blocks with
    neither."""
    model_dir = tiny_checkpoint(arch)
    llm = LLM(str(model_dir), dtype="float32", block_size=16, max_model_len=256)
    long_ = oracle_prompt(arch, 75)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=0)
    for prompt, hit in ((long_, 0), (long_[:70], 0 if arch == "llama_dynamic" else 64),
                        (long_[:30], 0)):
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params)
        ref = generate_trace(load_hf_model_with(model_dir), prompt, 4)
        assert min(ref.margins) > 1e-3  # no near-tie: the comparison is decisive
        assert list(out.outputs[0].token_ids) == ref.tokens
        got = [float(getattr(e[t], "logprob", e[t]))
               for t, e in zip(ref.tokens, out.outputs[0].logprobs, strict=True)]
        assert torch.allclose(torch.tensor(got), torch.tensor(ref.logprobs), atol=1e-4)
        assert out.num_cached_tokens == hit, (len(prompt), out.num_cached_tokens)
