"""The decoder layers in one native call (met.layers.layer_stack): the same tokens and the
same logprobs, bit for bit, as the Python loop of fused ops it replaces."""

from __future__ import annotations

import dataclasses

import pytest
from test_fused_ops import PROMPTS, _logprobs_and_tokens

from met import LLM, SamplingParams
from met.layers import layer_stack


def _count_stack_calls(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = layer_stack._op()
    assert real is not None, "the layer-stack kernel should build on this machine"
    monkeypatch.setattr(layer_stack, "_op",
                        lambda: lambda *args: calls.append(1) or real(*args))
    return calls


@pytest.mark.parametrize("arch,head_dim,kv_cache_dtype,stacked", [
    ("llama", 16, "model", True),
    ("mistral", 16, "model", True),  # every layer's sliding window
    ("qwen2", 16, "model", True),  # q/k/v biases
    ("llama", 64, "int8", True),  # an int8 cache
    # int8 rows of 16 values: attention takes the reference path, so the Python loop runs
    ("llama", 16, "int8", False),
])
def test_stack_gives_the_python_loops_tokens_and_logprobs_bit_for_bit(
        tiny_checkpoint, monkeypatch, arch, head_dim, kv_cache_dtype, stacked):
    llm = LLM(str(tiny_checkpoint(arch, head_dim=head_dim)), dtype="float32",
              quantization="w4a8", kv_cache_dtype=kv_cache_dtype, max_model_len=256)
    calls = _count_stack_calls(monkeypatch)
    stack_tokens, stack_logprobs = _logprobs_and_tokens(llm, max_tokens=12)
    # Prefill (each prompt row attends alone under w4a8) and decode steps both ran here.
    assert len(calls) >= 12 if stacked else not calls
    monkeypatch.setattr(layer_stack.LayerStack, "run", lambda self, *args: None)
    llm.reset_prefix_cache()
    loop_tokens, loop_logprobs = _logprobs_and_tokens(llm, max_tokens=12)
    assert stack_tokens == loop_tokens
    assert stack_logprobs == loop_logprobs


def test_models_without_4bit_projections_keep_the_python_loop(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint("llama")), dtype="bfloat16", quantization=None,
              max_model_len=128)
    model = llm.engine.runner.model
    assert model._fused_layers, "the bfloat16 model takes the fused loop"
    assert model._layer_stack is None
    out = llm.generate([{"prompt_token_ids": PROMPTS[1]}],
                       SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


def test_build_refuses_layers_that_differ(tiny_checkpoint):
    """One call serves every layer with one window plan and one set of head counts."""
    llm = LLM(str(tiny_checkpoint("llama")), dtype="float32", quantization="w4a8",
              max_model_len=128)
    model = llm.engine.runner.model
    layers = list(model._fused_layers)
    projections = [(layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                    layer.mlp.down_proj) for layer in model.model.layers]
    first = model.model.layers[0].input_layernorm
    assert layer_stack.build(layers, projections, first.weight, first.eps) is not None
    windowed = layers[:-1] + [dataclasses.replace(layers[-1], window=8)]
    assert layer_stack.build(windowed, projections, first.weight, first.eps) is None
