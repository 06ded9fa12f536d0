"""The LoRA delta's two kernels, batch invariance with mixed adapters, and adapters kept in
memory by --max-cpu-loras."""

from __future__ import annotations

import pytest
import torch
from test_lora_exact import greedy, hf_tokens, make_adapter, peft_model
from tiny_models import oracle_prompts

from met import LLM, SamplingParams, StructuredOutputs
from met.kernels.lora import add_lora, add_lora_native
from met.lora.adapter import AdapterError


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m, k, n", [(1, 64, 96), (7, 100, 37), (33, 576, 960)])
def test_native_kernel_matches_the_reference(dtype, m, k, n):
    """Rows with and without adapters, sizes that are not whole vectors; slots in the
    model's dtype (bfloat16 slots for a bfloat16 model)."""
    g = torch.Generator().manual_seed(m * k + n)
    slots, rank = 3, 24
    a = torch.randn(slots, rank, k, generator=g).to(dtype)
    bt = (torch.randn(slots, rank, n, generator=g) * 0.05).to(dtype)
    row_slots = torch.randint(-1, slots, (m,), generator=g, dtype=torch.int32)
    x = torch.randn(m, k, generator=g).to(dtype)
    y = torch.randn(m, n, generator=g).to(dtype)
    groups = [(s, torch.nonzero(row_slots == s).flatten())
              for s in sorted(set(row_slots.tolist()) - {-1})]
    exact = y.double().clone()
    for s, rows in groups:
        exact[rows] += (x[rows].double() @ a[s].double().T) @ bt[s].double()
    want = add_lora(y.clone(), x, a, bt, groups).double()
    got = add_lora_native(y.clone(), x, a, bt, row_slots).double()
    if dtype == torch.float32:
        assert torch.allclose(got, exact, rtol=1e-5, atol=1e-4)
        assert torch.allclose(want, exact, rtol=1e-5, atol=1e-4)
    else:
        # The kernel rounds once, after its float32 sums: within one bfloat16 ulp of the
        # exact result. The reference rounds the delta first, then the sum: within one ulp
        # of the delta's size too.
        ulp = 2.0 ** (torch.floor(torch.log2(exact.abs().clamp_min(1e-30))) - 7)
        assert ((got - exact).abs() <= ulp).all()
        delta = (exact - y.double()).abs()
        assert ((want - exact).abs() <= ulp + delta * 2 ** -7).all()
    base = row_slots < 0
    assert torch.equal(got[base], y.double()[base]), "a row without an adapter changed"


def test_native_rows_do_not_depend_on_their_batch():
    g = torch.Generator().manual_seed(0)
    a, bt = torch.randn(4, 16, 200, generator=g), torch.randn(4, 16, 150, generator=g)
    row_slots = torch.tensor([0, 1, 0, 0, 2, 0, 0, 3, 0, 1], dtype=torch.int32)
    x, y = torch.randn(10, 200, generator=g), torch.randn(10, 150, generator=g)
    together = add_lora_native(y.clone(), x, a, bt, row_slots)
    for i in range(10):
        alone = add_lora_native(y[i:i + 1].clone(), x[i:i + 1], a, bt, row_slots[i:i + 1])
        assert torch.equal(alone[0], together[i]), f"row {i}"


def test_the_torch_backend_also_matches_peft(tiny_checkpoint, tmp_path):
    model_dir = tiny_checkpoint("llama")
    a = make_adapter(model_dir, tmp_path / "a", seed=1)
    prompt = oracle_prompts("llama")[0]
    llm = LLM(str(model_dir), dtype="float32", quantization="none", max_model_len=256,
              lora_modules={"a": str(a)}, lora_backend="torch")
    assert llm.engine.lora.backend == "torch"
    outs = llm.generate([{"prompt_token_ids": prompt}] * 2, greedy(), lora=["a", None])
    assert list(outs[0].outputs[0].token_ids) == hf_tokens(peft_model(model_dir, a), prompt)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_seeded_sampling_is_batch_invariant_with_mixed_adapters(arch, tiny_checkpoint,
                                                                 tmp_path):
    """Each request alone, then all of them in one batch under different adapters (and
    none): the same tokens."""
    model_dir = tiny_checkpoint(arch)
    a = make_adapter(model_dir, tmp_path / "a", seed=1)
    b = make_adapter(model_dir, tmp_path / "b", seed=2, rank=4)
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, top_k=50, seed=77,
                            ignore_eos=True)
    prompts = [[(7 * i + 13 * j + 5) % 200 + 20 for j in range(n)]
               for i, n in enumerate([3, 9, 17, 23, 31, 40])]
    names = ["a", "b", None, "a", "b", "a"]
    llm = LLM(str(model_dir), dtype="float32", quantization="none", max_model_len=256,
              enable_prefix_caching=False, lora_modules={"a": str(a), "b": str(b)})
    alone = [list(llm.generate([{"prompt_token_ids": p}], params, lora=n)[0]
                  .outputs[0].token_ids) for p, n in zip(prompts, names, strict=True)]
    together = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora=names)
    assert [list(o.outputs[0].token_ids) for o in together] == alone
    assert alone[0] != alone[2] or alone[3] != alone[2], "the adapters changed nothing"


def test_max_cpu_loras_reads_evicted_adapters_again(tiny_checkpoint, tmp_path):
    model_dir = tiny_checkpoint("llama")
    dirs = {n: make_adapter(model_dir, tmp_path / n, seed=s) for n, s in (("a", 1), ("b", 2),
                                                                          ("c", 3))}
    prompt = oracle_prompts("llama")[0]
    llm = LLM(str(model_dir), dtype="float32", quantization="none", max_model_len=256,
              lora_modules={n: str(d) for n, d in dirs.items()}, max_loras=1, max_cpu_loras=1)
    manager = llm.engine.lora
    assert sum(ad.weights is not None for ad in manager.adapters.values()) == 1
    order = ["a", "b", "c", "a"]
    outs = llm.generate([{"prompt_token_ids": prompt}] * 4, greedy(), lora=order)
    want = {n: hf_tokens(peft_model(model_dir, d), prompt) for n, d in dirs.items()}
    assert [list(o.outputs[0].token_ids) for o in outs] == [want[n] for n in order]
    assert manager.reads >= 2, "no adapter was read again: the limit did nothing"
    assert sum(ad.weights is not None for ad in manager.adapters.values()) == 1
    assert not manager.holds


def test_max_cpu_loras_below_max_loras_is_refused(tiny_checkpoint):
    with pytest.raises(ValueError, match="max_cpu_loras: must be >= max_loras"):
        LLM(str(tiny_checkpoint("llama")), enable_lora=True, max_loras=4, max_cpu_loras=2)


def test_an_adapter_a_queued_request_names_cannot_be_unloaded(tiny_checkpoint, tmp_path):
    model_dir = tiny_checkpoint("llama")
    a = make_adapter(model_dir, tmp_path / "a", seed=1)
    llm = LLM(str(model_dir), dtype="float32", quantization="none", max_model_len=256,
              lora_modules={"a": str(a)})
    llm.engine.add_request("q", [5, 6, 7], greedy(), lora="a")  # queued, not yet run
    with pytest.raises(AdapterError, match="1 queued or running request"):
        llm.unload_lora_adapter("a")
    llm.engine.abort_request("q")
    llm.unload_lora_adapter("a")
    assert "a" not in llm.engine.lora.adapters


@pytest.mark.slow
def test_base_rows_keep_the_layer_stack_and_their_tokens(tmp_path, monkeypatch):
    """The embedded model on its fast path: with LoRA enabled, a step without adapter rows
    still runs the one-call layer stack, and base requests get the tokens of a server
    without LoRA, alone and batched with adapter requests."""
    from met.bench.gates.lora import model_config, write_random_adapter
    from met.layers import layer_stack

    ran = []
    real = layer_stack.LayerStack.run

    def counting(self, *args):
        out = real(self, *args)
        ran.append(out is not None)
        return out

    monkeypatch.setattr(layer_stack.LayerStack, "run", counting)
    adapter = write_random_adapter(model_config(None), tmp_path / "a", rank=8, seed=1)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = ["The capital of France is", "def fib(n):"]
    plain = LLM(None, dtype="bfloat16", max_model_len=512)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    stack_in_plain = any(ran)
    del plain
    ran.clear()
    llm = LLM(None, dtype="bfloat16", max_model_len=512, lora_modules={"a": str(adapter)})
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert alone == want
    assert any(ran) == stack_in_plain, "LoRA turned the layer stack off for base-only steps"
    mixed = llm.generate(prompts + prompts, params, lora=[None, None, "a", "a"])
    assert [o.outputs[0].token_ids for o in mixed[:2]] == want
    assert llm.kv_stats().num_blocks_in_use == 0


def test_a_refused_request_does_not_keep_its_adapter_held(tiny_checkpoint, tmp_path):
    model_dir = tiny_checkpoint("llama")
    a = make_adapter(model_dir, tmp_path / "a", seed=1)
    llm = LLM(str(model_dir), dtype="float32", quantization="none", max_model_len=64,
              lora_modules={"a": str(a)})
    with pytest.raises(ValueError, match="max_tokens"):
        llm.engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=500), lora="a")
    bad_grammar = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputs(regex="("))
    with pytest.raises(ValueError):
        llm.engine.add_request("g", [5, 6, 7], bad_grammar, lora="a")
    assert not llm.engine.lora.holds
    llm.unload_lora_adapter("a")  # nothing holds it
