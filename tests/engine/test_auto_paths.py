"""``dtype="auto"`` / ``quantization="auto"``: the fastest correct path for the machine and the
model file. bfloat16 only where the CPU multiplies it in hardware (AMX-BF16 / AVX512-BF16),
int4 only for Q4_0 / Q4_1 GGUF weights (whose integers it keeps exactly), float32 and no
quantization whenever asked for explicitly. The CPU's flags are mocked both ways here; the
embedded Q4_1 GGUF itself is tested in tests/e2e/test_real_models.py."""

from __future__ import annotations

import pytest
import torch
from tiny_models import oracle_prompts

from met import LLM, SamplingParams
from met.config import EngineConfig, cpu_has_native_bf16, resolve_dtype
from met.kernels import w4a8
from met.loader import model_loader
from met.loader.gguf import Q4Blocks
from met.loader.model_loader import load_model

CPU = torch.device("cpu")


@pytest.fixture
def bf16_cpu(monkeypatch):
    """A CPU with AMX-BF16 (the flag torch reports), whatever this machine has."""
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"amx_bf16": True})


@pytest.fixture
def plain_cpu(monkeypatch):
    """A CPU without native bfloat16 matrix support (AVX2 only)."""
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx2": True})


@pytest.mark.parametrize("flags, native", [
    ({"amx_bf16": True, "avx512_bf16": False}, True),
    ({"amx_bf16": False, "avx512_bf16": True}, True),
    ({"amx_tile": True, "amx_int8": True, "avx512_f": True}, False),
    ({}, False),
])
def test_native_bf16_is_read_from_the_cpu_flags(monkeypatch, flags, native):
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: flags)
    assert cpu_has_native_bf16() is native
    assert resolve_dtype("auto", "cpu") == (torch.bfloat16 if native else torch.float32)


def test_auto_dtype_on_a_cpu_with_bf16_units(bf16_cpu):
    assert EngineConfig().torch_dtype == torch.bfloat16
    assert EngineConfig(dtype="float32").torch_dtype == torch.float32  # the exact reference


def test_auto_dtype_on_a_cpu_without_bf16_units(plain_cpu):
    assert EngineConfig().torch_dtype == torch.float32
    assert EngineConfig(quantization="none").torch_dtype == torch.float32
    # An explicit quantization still runs its kernels' bfloat16 activations; w4a8's kernels
    # quantize float32 rows themselves, so it keeps float32 where bfloat16 is emulated.
    assert EngineConfig(quantization="int4").torch_dtype == torch.bfloat16
    assert EngineConfig(quantization="w4a8").torch_dtype == torch.float32
    assert EngineConfig(quantization="w4a8", dtype="bfloat16").torch_dtype == torch.bfloat16
    assert EngineConfig(dtype="bfloat16").torch_dtype == torch.bfloat16


def test_auto_dtype_on_cuda_stays_bfloat16(plain_cpu):
    assert resolve_dtype("auto", "cuda:0") == torch.bfloat16


def test_quantization_spellings():
    assert EngineConfig().quantization == "auto"
    assert EngineConfig(quantization="none").quantization is None
    assert EngineConfig(quantization=None).quantization is None
    assert EngineConfig(quantization="int8").quantization == "int8"


@pytest.mark.parametrize("bad", ["int2", "INT4", "", "q4_1"])
def test_an_invalid_quantization_names_the_field_and_the_choices(bad):
    with pytest.raises(ValueError, match=r"quantization: must be one of auto, none, int8, int4"):
        EngineConfig(quantization=bad)


def _q4(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` as a Q4_1 GGUF would hold it: the dequantized values, carrying their
    integers (groups of 32 along the input, a scale and a minimum per group)."""
    n, k = weight.shape
    w = weight.float().reshape(n, k // 32, 32)
    lo = w.amin(-1)
    scale = ((w.amax(-1) - lo) / 15).clamp(min=1e-8)
    q = torch.round((w - lo[..., None]) / scale[..., None]).clamp(0, 15)
    out = (q * scale[..., None] + lo[..., None]).reshape(n, k)
    out.q4_blocks = Q4Blocks(q.to(torch.uint8).reshape(n, k), scale, lo)
    return out


@pytest.fixture
def q4_checkpoint(tiny_checkpoint, monkeypatch):
    """The tiny Llama, its projections loaded as if from a Q4_1 GGUF (the head stays as is,
    like the embedded model's Q8_0 embedding)."""
    real = model_loader.iter_safetensors

    def as_q4(path):
        for name, tensor in real(path):
            yield name, _q4(tensor) if name.endswith("proj.weight") else tensor

    monkeypatch.setattr(model_loader, "iter_safetensors", as_q4)
    return str(tiny_checkpoint("llama"))


def _gaps_from_reference(llm: LLM, ref: LLM) -> list[float]:
    """|Δ logprob| of ``ref``'s 8 greedy tokens on 3 prompts, scored teacher-forced under
    ``llm``."""
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
    gaps = []
    for prompt in oracle_prompts("llama")[:3]:
        out = ref.generate({"prompt_token_ids": prompt}, greedy)[0].outputs[0]
        forced = llm.generate({"prompt_token_ids": prompt + out.token_ids},
                              SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
        gaps += [abs(forced.prompt_logprobs[len(prompt) + i][t] - out.logprobs[i][t])
                 for i, t in enumerate(out.token_ids)]
    return gaps


@pytest.fixture(params=["this CPU", "no w4a8 kernel"])
def small_server_choice(request, monkeypatch):
    """What auto picks for a few-sequence server: w4a8 on a CPU with AVX512-VNNI or AVX2,
    int4 on one without (the second case simulated on any CPU)."""
    if request.param == "no w4a8 kernel":
        monkeypatch.setattr(w4a8, "available", lambda: False)
    return "w4a8" if w4a8.available() else "int4"


def test_auto_quantizes_q4_weights_for_few_sequences_and_stays_close(
        q4_checkpoint, bf16_cpu, small_server_choice, caplog):
    """auto → bfloat16 + w4a8 (int4 without VNNI), said in one INFO line; float32's greedy
    tokens scored under it move by < 0.1 nats on average."""
    with caplog.at_level("INFO", logger="met.loader.model_loader"):
        auto = LLM(q4_checkpoint, max_model_len=256, max_num_seqs=4)
    assert (auto.engine.dtype, auto.engine.quantization) == (torch.bfloat16,
                                                             small_server_choice)
    said = [r.getMessage() for r in caplog.records if "quantization auto" in r.getMessage()]
    assert len(said) == 1 and small_server_choice in said[0] and "Q4_0/Q4_1" in said[0]

    ref = LLM(q4_checkpoint, dtype="float32", quantization="none", max_model_len=256)
    assert (ref.engine.dtype, ref.engine.quantization) == (torch.float32, None)
    gaps = _gaps_from_reference(auto, ref)
    assert sum(gaps) / len(gaps) < 0.1, gaps  # (measured int4: 0.018 mean, 0.05 max)
    assert auto.kv_stats().num_blocks_in_use == 0


def test_auto_many_sequence_server_is_w4a8_with_vnni_else_bfloat16(q4_checkpoint, bf16_cpu,
                                                                    small_server_choice,
                                                                    caplog):
    """The default server (64 sequences): w4a8 where the CPU has AVX512-VNNI (ahead of both
    peers at every concurrency, docs/benchmarks.md); without it int4's few-row kernel does
    not pay above 4 sequences, so auto leaves the Q4 weights dequantized and says why."""
    with caplog.at_level("INFO", logger="met.loader.model_loader"):
        llm = LLM(q4_checkpoint, max_model_len=64)
    if small_server_choice == "w4a8":
        assert (llm.engine.dtype, llm.engine.quantization) == (torch.bfloat16, "w4a8")
        return
    assert (llm.engine.dtype, llm.engine.quantization) == (torch.bfloat16, None)
    assert any("quantization auto → none: up to 64 sequences" in r.getMessage()
               and "no w4a8 kernel" in r.getMessage() for r in caplog.records)
    assert LLM(q4_checkpoint, max_model_len=64, max_num_seqs=5).engine.quantization is None


def test_auto_without_bf16_units_is_float32_w4a8_and_stays_close(q4_checkpoint, plain_cpu,
                                                                  caplog):
    """No native bfloat16 (e.g. AMD Zen 3): auto keeps float32 activations and runs the Q4
    weights through w4a8 (the AVX2 kernel suffices), said in the log; float32's greedy
    tokens scored under it move by < 0.1 nats on average. ``--dtype float32`` asked for by
    name stays the exact reference (no quantization), and so does auto without a kernel."""
    assert w4a8.available()  # x86-64 CI machines have AVX2 at least
    with caplog.at_level("INFO", logger="met.loader.model_loader"):
        auto = LLM(q4_checkpoint, max_model_len=256)
    assert (auto.engine.dtype, auto.engine.quantization) == (torch.float32, "w4a8")
    assert any("quantization auto → w4a8" in r.getMessage() and "no native bfloat16"
               in r.getMessage() for r in caplog.records)
    ref = LLM(q4_checkpoint, dtype="float32", max_model_len=256)
    assert (ref.engine.dtype, ref.engine.quantization) == (torch.float32, None)
    gaps = _gaps_from_reference(auto, ref)
    assert sum(gaps) / len(gaps) < 0.1, gaps
    # float32 rows alone and batched: the same tokens (one kernel for any row count)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in oracle_prompts("llama")[:3]]
    batched = [o.outputs[0].token_ids for o in auto.generate(prompts, greedy)]
    assert batched == [auto.generate(p, greedy)[0].outputs[0].token_ids for p in prompts]
    assert auto.kv_stats().num_blocks_in_use == 0


def test_auto_without_bf16_units_or_a_w4a8_kernel_keeps_float32(q4_checkpoint, plain_cpu,
                                                                  monkeypatch):
    monkeypatch.setattr(w4a8, "available", lambda: False)
    llm = LLM(q4_checkpoint, max_model_len=64, max_num_seqs=1)
    assert (llm.engine.dtype, llm.engine.quantization) == (torch.float32, None)


def test_none_disables_quantization_of_q4_weights(q4_checkpoint, bf16_cpu):
    for off in ("none", None):
        llm = LLM(q4_checkpoint, quantization=off, max_model_len=64)
        assert (llm.engine.dtype, llm.engine.quantization) == (torch.bfloat16, None)


def test_auto_leaves_a_safetensors_checkpoint_unquantized(tiny_checkpoint, bf16_cpu, caplog):
    """Float weights would be re-fit to int4 (lossy): auto keeps them, in bfloat16."""
    with caplog.at_level("INFO", logger="met.loader.model_loader"):
        loaded = load_model(str(tiny_checkpoint("llama")), EngineConfig().torch_dtype, CPU, 64,
                            quantization="auto")
    assert loaded.quantization is None
    assert next(loaded.model.parameters()).dtype == torch.bfloat16
    assert any("quantization auto → none: not a Q4_0/Q4_1 GGUF (0 of" in r.getMessage()
               for r in caplog.records)


def test_explicit_quantization_is_kept(tiny_checkpoint, plain_cpu):
    llm = LLM(str(tiny_checkpoint("llama")), quantization="int8", max_model_len=64)
    assert (llm.engine.dtype, llm.engine.quantization) == (torch.bfloat16, "int8")


def test_auto_does_not_pick_int4_when_only_some_weights_are_q4(tiny_checkpoint, bf16_cpu,
                                                              monkeypatch):
    real = model_loader.iter_safetensors

    def some_q4(path):
        for name, tensor in real(path):
            yield name, _q4(tensor) if name.endswith("mlp.up_proj.weight") else tensor

    monkeypatch.setattr(model_loader, "iter_safetensors", some_q4)
    llm = LLM(str(tiny_checkpoint("llama")), max_model_len=64, max_num_seqs=1)
    assert (llm.engine.dtype, llm.engine.quantization) == (torch.bfloat16, None)
