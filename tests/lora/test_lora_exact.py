"""LoRA adapters served by met equal transformers + peft on the same tiny checkpoint and
adapter: greedy tokens exact, alone and mixed in one batch with other adapters and the base."""

from __future__ import annotations

import peft
import pytest
import torch
from tiny_models import ARCHS, greedy_trace, load_hf_model_with, oracle_prompts

from met import LLM, SamplingParams
from met.lora.adapter import AdapterError

MAX_NEW = 12
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


# Phi-3's checkpoint (so peft) has fused modules: met splits their B rows into the parts.
PHI3 = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]


def _targets(arch: str) -> list[str]:
    if arch == "phi3":
        return PHI3
    if arch == "deepseek_v3":  # MLA has only o_proj of these (its q/kv are low-rank pairs)
        return ["o_proj"]
    return ALL[:4] if arch == "qwen3_moe" else ALL  # its MLP is experts, not projections


def make_adapter(model_dir, out_dir, seed: int, rank: int = 8, targets=ALL, **extra):
    """A random PEFT adapter (B nonzero, so it changes the output), saved as PEFT does."""
    torch.manual_seed(seed)
    base = load_hf_model_with(model_dir)
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets,
                             init_lora_weights=False, **extra)
    model = peft.get_peft_model(base, config)
    with torch.no_grad():  # big enough to move greedy tokens off the base model's
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(3.0)
    model.save_pretrained(out_dir)
    return out_dir


def hf_tokens(model, prompt: list[int]) -> list[int]:
    return greedy_trace(model, prompt, MAX_NEW).tokens


def peft_model(model_dir, adapter_dir):
    return peft.PeftModel.from_pretrained(load_hf_model_with(model_dir), str(adapter_dir)).eval()


LOGPROB_ATOL = 1e-4


def greedy() -> SamplingParams:
    return SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, logprobs=1)


@pytest.mark.parametrize("arch", ARCHS)
def test_mixed_adapters_in_one_batch_match_peft(arch, tiny_checkpoint, tmp_path):
    model_dir = tiny_checkpoint(arch)
    a = make_adapter(model_dir, tmp_path / "a", seed=1, targets=_targets(arch))
    b = make_adapter(model_dir, tmp_path / "b", seed=2, rank=4, targets=_targets(arch))
    prompts = oracle_prompts(arch)[:2]
    llm = LLM(str(model_dir), dtype="float32", quantization="none", max_model_len=256,
              lora_modules={"a": str(a), "b": str(b)}, max_loras=2)
    names = ["a", "b", None, "a", "b", None]
    batch = [prompts[i % 2] for i in range(len(names))]
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], greedy(), lora=names)
    refs = {"a": peft_model(model_dir, a), "b": peft_model(model_dir, b),
            None: load_hf_model_with(model_dir)}
    for prompt, name, out in zip(batch, names, outs, strict=True):
        want = greedy_trace(refs[name], prompt, MAX_NEW)
        comp = out.outputs[0]
        assert list(comp.token_ids) == want.tokens, f"adapter {name}"
        for step, (tok, entry) in enumerate(zip(comp.token_ids, comp.logprobs, strict=True)):
            got = float(getattr(entry[tok], "logprob", entry[tok]))
            assert abs(got - want.logprobs[step]) <= LOGPROB_ATOL, (
                f"adapter {name}, step {step}: logprob {got} vs peft {want.logprobs[step]}")
    base = [list(o.outputs[0].token_ids) for o, n in zip(outs, names, strict=True) if n is None]
    tuned = [list(o.outputs[0].token_ids) for o, n in zip(outs, names, strict=True) if n == "a"]
    assert base != tuned, "the adapter did not change the output: the test proves nothing"
    assert llm.kv_stats().num_blocks_in_use == 0
    assert all(r == 0 for r in llm.engine.lora.refs), "a slot stayed pinned"


def test_merged_weights_give_the_same_tokens(tiny_checkpoint, tmp_path):
    model_dir = tiny_checkpoint("llama")
    a = make_adapter(model_dir, tmp_path / "a", seed=3, use_rslora=True)
    merged = peft_model(model_dir, a).merge_and_unload()
    prompt = oracle_prompts("llama")[0]
    llm = LLM(str(model_dir), dtype="float32", quantization="none", max_model_len=256,
              lora_modules={"a": str(a)})
    out = llm.generate([{"prompt_token_ids": prompt}], greedy(), lora="a")[0]
    assert list(out.outputs[0].token_ids) == hf_tokens(merged, prompt)


def test_one_slot_serves_two_adapters_in_turn(tiny_checkpoint, tmp_path):
    """max_loras=1: requests of the second adapter wait for the first's to finish."""
    model_dir = tiny_checkpoint("llama")
    a = make_adapter(model_dir, tmp_path / "a", seed=1)
    b = make_adapter(model_dir, tmp_path / "b", seed=2)
    prompt = oracle_prompts("llama")[0]
    llm = LLM(str(model_dir), dtype="float32", quantization="none", max_model_len=256,
              lora_modules={"a": str(a), "b": str(b)}, max_loras=1)
    outs = llm.generate([{"prompt_token_ids": prompt}] * 4, greedy(), lora=["a", "b", "a", "b"])
    want_a = hf_tokens(peft_model(model_dir, a), prompt)
    want_b = hf_tokens(peft_model(model_dir, b), prompt)
    assert [list(o.outputs[0].token_ids) for o in outs] == [want_a, want_b, want_a, want_b]
    assert llm.engine.lora.loads >= 2


def test_the_adapter_is_part_of_the_prefix_cache_key(tiny_checkpoint, tmp_path):
    model_dir = tiny_checkpoint("llama")
    a = make_adapter(model_dir, tmp_path / "a", seed=1)
    b = make_adapter(model_dir, tmp_path / "b", seed=2)
    prompt = list(range(5, 5 + 40))  # two full blocks of 16
    llm = LLM(str(model_dir), dtype="float32", quantization="none", max_model_len=256,
              block_size=16, lora_modules={"a": str(a), "b": str(b)})
    cached = [llm.generate([{"prompt_token_ids": prompt}], greedy(), lora=name)[0].num_cached_tokens
              for name in ("a", "b", "a", None, "b")]
    assert cached == [0, 0, 32, 0, 32]


def test_bad_adapters_are_refused_naming_the_problem(tiny_checkpoint, tmp_path):
    model_dir = tiny_checkpoint("llama")
    good = make_adapter(model_dir, tmp_path / "good", seed=1, rank=8)
    llm = LLM(str(model_dir), dtype="float32", quantization="none", max_model_len=256,
              enable_lora=True, max_lora_rank=8)
    (tmp_path / "empty").mkdir()
    with pytest.raises(AdapterError, match="missing file .*adapter_config.json"):
        llm.load_lora_adapter("x", str(tmp_path / "empty"))
    big = make_adapter(model_dir, tmp_path / "big", seed=1, rank=16)
    with pytest.raises(AdapterError, match="rank 16 exceeds --max-lora-rank 8"):
        llm.load_lora_adapter("big", str(big))
    wrong = make_adapter(tiny_checkpoint("llama", head_dim=32), tmp_path / "wrong", seed=1)
    with pytest.raises(AdapterError, match="shape mismatch"):
        llm.load_lora_adapter("wrong", str(wrong))
    head = make_adapter(model_dir, tmp_path / "head", seed=1, targets=["lm_head"])
    with pytest.raises(AdapterError, match="lm_head"):
        llm.load_lora_adapter("head", str(head))
    # The engine keeps serving, and a good adapter still loads.
    llm.load_lora_adapter("good", str(good))
    with pytest.raises(ValueError, match="unknown adapter 'nope'"):
        llm.generate(["hi"], greedy(), lora="nope")
    assert llm.generate(["hi"], greedy(), lora="good")[0].outputs[0].token_ids


def test_unloading_an_adapter_in_use_is_refused(tiny_checkpoint, tmp_path):
    model_dir = tiny_checkpoint("llama")
    a = make_adapter(model_dir, tmp_path / "a", seed=1)
    llm = LLM(str(model_dir), dtype="float32", quantization="none", max_model_len=256,
              lora_modules={"a": str(a)})
    engine = llm.engine
    engine.add_request("r", [5, 6, 7], greedy(), lora="a")
    engine.step()
    with pytest.raises(AdapterError, match="running request"):
        llm.unload_lora_adapter("a")
    while engine.has_unfinished():
        engine.step()
    llm.unload_lora_adapter("a")
    with pytest.raises(ValueError, match="unknown adapter 'a'"):
        engine.add_request("s", [5, 6, 7], greedy(), lora="a")
