"""The kernel registries (met.kernels.registry): what runs where, forcing, and every entry
that runs on this machine checked against the reference on every tiny architecture."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_oracle_models import (
    assert_matches_hf,
    generate_checked,
    greedy_params,
    make_llm,
)
from tiny_models import ARCHS, oracle_prompts

from met import LLM
from met.config import EngineConfig
from met.kernels import registry
from met.kernels.capability import probe

CPU = registry.LinearSpec(None, torch.bfloat16, "cpu")


def _without(*flags: str):
    cap = probe()
    return dataclasses.replace(cap, flags=cap.flags - set(flags))


def test_auto_takes_the_first_entry_that_runs_and_says_why_the_others_did_not():
    spec = registry.LinearSpec("w4a8", torch.bfloat16, "cpu")
    avx2_only = _without("avx512f", "avx512_vnni", "avx512_bf16", "amx_tile")
    plan = registry.plan(spec, cap=avx2_only)
    assert plan.linear.name == "w4a8-avx2"
    assert ("w4a8-vnni", "this CPU has no AVX512-VNNI (ISA avx2)") in plan.rejected
    bare = _without(*probe().flags)
    assert registry.plan(spec, cap=bare).linear.name == "w4a8-torch"
    assert registry.plan(spec, cap=bare).attention.name == "torch"
    gpu = registry.plan(registry.LinearSpec("w4a8", torch.bfloat16, "cuda"))
    assert gpu.linear.name == "w4a8-torch" and gpu.attention.name == "triton"


def test_a_forced_entry_that_cannot_run_is_refused_naming_the_reason():
    spec = registry.LinearSpec("w4a8", torch.bfloat16, "cpu")
    with pytest.raises(ValueError, match=r"--linear-backend w4a8-vnni: cannot run .*"
                                         r"no AVX512-VNNI"):
        registry.plan(spec, "w4a8-vnni", cap=_without("avx512_vnni"))
    with pytest.raises(ValueError, match="--linear-backend: unknown 'fast'"):
        registry.plan(spec, "fast")
    with pytest.raises(ValueError, match=r"--attention-backend cpu-native: .*CPU only"):
        registry.plan(registry.LinearSpec(None, torch.float32, "cuda"), attention="cpu-native")
    with pytest.raises(ValueError, match="runs quantization w4a8, but quantization is int8"):
        EngineConfig(quantization="int8", linear_backend="w4a8-avx2")
    assert EngineConfig(linear_backend="w4a8-avx2").quantization == "w4a8"


def _runs_here(method: registry.LinearMethod) -> bool:
    spec = registry.LinearSpec(method.quantization, torch.bfloat16, "cpu")
    return method.reason(spec, probe()) is None


W4A8_HERE = [m.name for m in registry.LINEAR_METHODS if m.quantization == "w4a8"
             and _runs_here(m)]
# triton (in the interpreter without a GPU) is run by tests/kernels/test_triton_attention.py,
# with chunked prefill and prefix hits.
ATTENTION_HERE = [b.name for b in registry.ATTENTION_BACKENDS
                  if b.reason("cpu", probe(), forced=True) is None and b.name != "triton"]


@pytest.mark.parametrize("attention", ATTENTION_HERE)
@pytest.mark.parametrize("arch", ARCHS)
def test_every_attention_backend_matches_transformers(arch, attention, tiny_checkpoint):
    """float32, greedy: each attention backend that runs here gives transformers' tokens
    (and logprobs within 1e-4) on every tiny architecture, prompts batched."""
    model_dir = tiny_checkpoint(arch)
    llm = make_llm(model_dir, attention_backend=attention, enable_prefix_caching=False)
    assert llm.engine.loaded.kernel_plan.attention.name == attention
    prompts = oracle_prompts(arch)
    outs = generate_checked(llm, [{"prompt_token_ids": p} for p in prompts],
                            greedy_params(logprobs=1))
    for out, prompt in zip(outs, prompts, strict=True):
        assert_matches_hf(out, model_dir, prompt)


@pytest.mark.parametrize("arch", ARCHS)
def test_every_w4a8_method_gives_the_same_tokens(arch, tiny_checkpoint):
    """The w4a8 entries that run here compute one formula: the native ones give bit for bit
    the same tokens and logprobs; the PyTorch reference (another float summation order in
    bfloat16) the same first 16 greedy tokens of every prompt, chosen logprobs within 0.2
    until the first divergence (a late near-tie may then fork: seen on gemma3 at step 21)."""
    model_dir = tiny_checkpoint(arch)
    prompts = [{"prompt_token_ids": p} for p in oracle_prompts(arch)]
    results = {}
    for name in W4A8_HERE:
        llm = LLM(str(model_dir), dtype="bfloat16", linear_backend=name, block_size=16,
                  max_model_len=256, enable_prefix_caching=False)
        assert llm.engine.loaded.kernel_plan.linear.name == name
        outs = generate_checked(llm, prompts, greedy_params(logprobs=1))
        results[name] = [[(tok, float(getattr(lp[tok], "logprob", lp[tok])))
                          for tok, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs,
                                             strict=True)] for o in outs]
    native = [n for n in results if n != "w4a8-torch"]
    assert native, "no native w4a8 kernel runs on this x86-64 CPU"
    for name in native[1:]:
        assert results[name] == results[native[0]], f"{name} differs from {native[0]}"
    for got, ref in zip(results[native[0]], results["w4a8-torch"], strict=True):
        pairs = enumerate(zip(got, ref, strict=False))
        same = next((i for i, (a, b) in pairs if a[0] != b[0]), len(got))
        assert same >= min(16, len(got)), f"diverges from w4a8-torch at step {same}"
        for (_, a), (_, b) in zip(got[:same], ref[:same], strict=True):
            assert abs(a - b) <= 0.2


GGUF_HERE = [m.name for m in registry.LINEAR_METHODS if m.quantization == "gguf"
             and _runs_here(m)]


@pytest.mark.parametrize("arch", ARCHS)
def test_every_gguf_method_gives_the_same_tokens(arch, tiny_checkpoint):
    """--quantization gguf on a float checkpoint (its weights as Q8_0 blocks), float32: the
    native kernel and the gguf-py reference multiply the same values in float32, so the
    same greedy tokens, logprobs within 1e-4."""
    model_dir = tiny_checkpoint(arch)
    prompts = [{"prompt_token_ids": p} for p in oracle_prompts(arch)]
    results = {}
    for name in GGUF_HERE:
        llm = LLM(str(model_dir), dtype="float32", linear_backend=name, max_model_len=256,
                  enable_prefix_caching=False)
        assert llm.engine.loaded.kernel_plan.linear.name == name
        outs = generate_checked(llm, prompts, greedy_params(logprobs=1))
        results[name] = [[(tok, float(getattr(lp[tok], "logprob", lp[tok])))
                          for tok, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs,
                                             strict=True)] for o in outs]
    assert "gguf-torch" in results and len(results) >= 2, results.keys()
    for name, got in results.items():
        for a, b in zip(got, results["gguf-torch"], strict=True):
            assert [t for t, _ in a] == [t for t, _ in b], f"{name} tokens differ"
            assert max(abs(x - y) for (_, x), (_, y) in zip(a, b, strict=True)) < 1e-4
