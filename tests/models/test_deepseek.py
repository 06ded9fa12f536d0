"""DeepSeek-V3 through the engine: the KV cache holds the compressed latent only, bfloat16
runs on the plain PyTorch modules, an int8 latent cache serves, multi-token-prediction
layers in a checkpoint are skipped. (Greedy tokens vs transformers: test_oracle_models.py,
arch deepseek_v3.)"""

from __future__ import annotations

import json
import shutil

import torch
from safetensors.torch import load_file, save_file
from tiny_models import (
    DEEPSEEK_KV_LORA_RANK,
    DEEPSEEK_NOPE_DIM,
    DEEPSEEK_ROPE_DIM,
    DEEPSEEK_V_DIM,
    NUM_HEADS,
    NUM_LAYERS,
    hf_greedy_trace,
    oracle_prompts,
)

from met import LLM, SamplingParams
from met.runner.model_runner import kv_bytes_per_block

BLOCK = 16


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=0)


def test_kv_cache_holds_only_the_latent(tiny_checkpoint):
    """Per token and layer the cache stores kv_lora_rank + qk_rope_head_dim values (one row,
    no values), the size the engine reports and allocates: 48 float32 values, where full
    per-head K and V would be 4 * (32 + 24) = 224."""
    llm = LLM(str(tiny_checkpoint("deepseek_v3")), dtype="float32", block_size=BLOCK,
              max_model_len=256, kv_cache_memory=1 << 20)
    engine = llm.engine
    latent = DEEPSEEK_KV_LORA_RANK + DEEPSEEK_ROPE_DIM
    full_kv = NUM_HEADS * (DEEPSEEK_NOPE_DIM + DEEPSEEK_ROPE_DIM + DEEPSEEK_V_DIM)
    assert engine.loaded.model.kv_layout == (NUM_LAYERS, 1, latent)
    per_block = kv_bytes_per_block(engine.loaded.model, BLOCK, torch.float32)
    assert per_block == NUM_LAYERS * BLOCK * latent * 4
    assert per_block * full_kv // latent == NUM_LAYERS * BLOCK * full_kv * 4  # 4.7x smaller
    num_blocks = engine.kv_stats().num_blocks_total
    assert num_blocks == (1 << 20) // per_block
    caches = engine.runner.kv_caches
    assert len(caches) == NUM_LAYERS
    for cache in caches:
        assert cache.k.shape == (1, num_blocks * BLOCK, latent)
        assert cache.v.numel() == 0
    assert engine.kv_pool_bytes == num_blocks * per_block
    # ... and it serves: a request's latents go where its block table says.
    prompt = oracle_prompts("deepseek_v3")[1]
    (out,) = llm.generate([{"prompt_token_ids": prompt}], _greedy(4))
    ref = hf_greedy_trace(tiny_checkpoint("deepseek_v3"), prompt, 4)
    assert list(out.outputs[0].token_ids) == ref.tokens


def test_bfloat16_runs_and_agrees_with_float32(tiny_checkpoint):
    """bfloat16 on CPU (where the fused Llama paths would otherwise run) goes through the
    plain modules; where transformers' float32 top-1 is clear (margin > 0.5), bfloat16's
    first greedy token is the same."""
    model_dir = tiny_checkpoint("deepseek_v3")
    llm = LLM(str(model_dir), dtype="bfloat16", block_size=BLOCK, max_model_len=256,
              enable_prefix_caching=False)
    model = llm.engine.loaded.model
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert not hasattr(model, "_fused_layers") and not model.prompt_rows_first
    prompts = oracle_prompts("deepseek_v3")
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(8))
    checked = 0
    for out, prompt in zip(outs, prompts, strict=True):
        ref = hf_greedy_trace(model_dir, prompt, 8)
        assert len(out.outputs[0].token_ids) == 8
        if ref.margins[0] > 0.5:
            assert out.outputs[0].token_ids[0] == ref.tokens[0], len(prompt)
            checked += 1
    assert checked >= 2


def test_int8_latent_cache_serves(tiny_checkpoint):
    """--kv-cache-dtype int8: each latent row int8 with one float32 scale (48 + 4 bytes per
    token and layer); greedy tokens stay transformers' on the first steps of every prompt."""
    model_dir = tiny_checkpoint("deepseek_v3")
    llm = LLM(str(model_dir), dtype="float32", block_size=BLOCK, max_model_len=256,
              kv_cache_dtype="int8", enable_prefix_caching=False)
    cache = llm.engine.runner.kv_caches[0]
    assert cache.k.dtype == torch.int8 and cache.v.numel() == 0
    per_block = kv_bytes_per_block(llm.engine.loaded.model, BLOCK, torch.float32, "int8")
    assert per_block == NUM_LAYERS * BLOCK * (DEEPSEEK_KV_LORA_RANK + DEEPSEEK_ROPE_DIM + 4)
    prompts = oracle_prompts("deepseek_v3")
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(4))
    for out, prompt in zip(outs, prompts, strict=True):
        ref = hf_greedy_trace(model_dir, prompt, 4)
        assert out.outputs[0].token_ids[0] == ref.tokens[0], len(prompt)


def test_multi_token_prediction_layers_are_skipped(tiny_checkpoint, tmp_path):
    """DeepSeek-V3 checkpoints carry their MTP module as one extra decoder layer after the
    last; met loads the model without it."""
    src = tiny_checkpoint("deepseek_v3")
    model_dir = tmp_path / "with-mtp"
    shutil.copytree(src, model_dir)
    tensors = load_file(str(model_dir / "model.safetensors"))
    extra = {k.replace(f"model.layers.{NUM_LAYERS - 1}.", f"model.layers.{NUM_LAYERS}."):
             v.clone()
             for k, v in tensors.items() if k.startswith(f"model.layers.{NUM_LAYERS - 1}.")}
    extra[f"model.layers.{NUM_LAYERS}.eh_proj.weight"] = torch.zeros(64, 128)
    save_file(tensors | extra, str(model_dir / "model.safetensors"))
    config = json.loads((model_dir / "config.json").read_text())
    assert config["num_hidden_layers"] == NUM_LAYERS
    prompt = oracle_prompts("deepseek_v3")[2]
    llm = LLM(str(model_dir), dtype="float32", block_size=BLOCK, max_model_len=256)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], _greedy(6))
    assert list(out.outputs[0].token_ids) == hf_greedy_trace(src, prompt, 6).tokens


def test_small_latent_pool_preempts_and_matches_hf(tiny_checkpoint):
    """A pool sized in latent blocks that cannot hold every request at once: requests wait
    or are preempted, and every greedy token is still transformers'."""
    model_dir = tiny_checkpoint("deepseek_v3")
    per_block = NUM_LAYERS * BLOCK * (DEEPSEEK_KV_LORA_RANK + DEEPSEEK_ROPE_DIM) * 4
    llm = LLM(str(model_dir), dtype="float32", block_size=BLOCK, max_model_len=256,
              kv_cache_memory=12 * per_block, enable_prefix_caching=False)
    assert llm.kv_stats().num_blocks_total == 12
    prompts = oracle_prompts("deepseek_v3")
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(32))
    for out, prompt in zip(outs, prompts, strict=True):
        assert list(out.outputs[0].token_ids) == hf_greedy_trace(model_dir, prompt, 32).tokens
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.kv_stats().num_blocks_in_use == 0


def _tiny_v2(out_dir):
    """A tiny DeepSeek-V2 (q_proj without q LoRA, softmax group_limited_greedy routing, two
    shared experts), initialised as tests/tiny_models.py does."""
    import transformers as tf
    from tiny_models import ArchSpec, _reinit, build_tokenizer

    tokenizer = build_tokenizer(384, add_bos=False)
    config = tf.DeepseekV2Config(
        vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS, max_position_embeddings=512, rms_norm_eps=1e-6,
        q_lora_rank=None, kv_lora_rank=DEEPSEEK_KV_LORA_RANK, qk_rope_head_dim=DEEPSEEK_ROPE_DIM,
        qk_nope_head_dim=DEEPSEEK_NOPE_DIM, v_head_dim=DEEPSEEK_V_DIM, moe_intermediate_size=32,
        n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=2, n_group=2, topk_group=1,
        topk_method="group_limited_greedy", routed_scaling_factor=1.5, first_k_dense_replace=1,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(0)
    model = tf.DeepseekV2ForCausalLM(config).float().eval()
    _reinit(model, "deepseek_v2", ArchSpec(), 0)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return model


def test_deepseek_v2_matches_transformers(tmp_path):
    """DeepSeek-V2 (same MLA, V2's router, complex-number rope on interleaved pairs): met's
    greedy tokens, batched, teacher-forced through transformers: each is transformers' argmax
    wherever its top-1 margin is not a near-tie (> 1e-3), and each chosen logprob is
    transformers' within 1e-4. (No seed is vetted for decisiveness here, so a near-tie may
    fork the continuation; the logprob check holds on whatever met chose.)"""
    hf = _tiny_v2(tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", block_size=BLOCK, max_model_len=256,
              max_num_batched_tokens=BLOCK, max_num_seqs=4)
    layers = llm.engine.loaded.model.model.layers
    assert hasattr(layers[0].self_attn, "q_proj")  # q_lora_rank None
    assert layers[1].mlp.gate.routing.method == "group_limited_greedy"
    prompts = oracle_prompts("deepseek_v3")
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(16))
    checked = 0
    for out, prompt in zip(outs, prompts, strict=True):
        tokens = list(out.outputs[0].token_ids)
        with torch.inference_mode():
            logits = hf(input_ids=torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:]
        logprobs = torch.log_softmax(logits.double(), dim=-1)
        top2 = logits.topk(2, dim=-1).values
        for step, tok in enumerate(tokens):
            lp = out.outputs[0].logprobs[step][tok]
            assert abs(float(getattr(lp, "logprob", lp)) - float(logprobs[step, tok])) <= 1e-4
            if top2[step, 0] - top2[step, 1] > 1e-3:
                assert tok == int(logits[step].argmax()), (len(prompt), step)
                checked += 1
    assert checked > 40


def test_yarn_rope_matches_transformers(tiny_checkpoint, tmp_path):
    """DeepSeek's rope scaling: YaRN on the rope dims (met.layers.rotary) and mscale_all_dim
    folded into the softmax scale of every dim (met.layers.mla.softmax_scale); generation
    both change the scores, exactly as transformers computes them."""
    src = tiny_checkpoint("deepseek_v3")
    model_dir = tmp_path / "yarn"
    shutil.copytree(src, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["rope_parameters"] = {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 128, "beta_fast": 32.0, "beta_slow": 1.0,
        "mscale": 1.0, "mscale_all_dim": 1.0}
    (model_dir / "config.json").write_text(json.dumps(config))
    from tiny_models import greedy_trace, load_hf_model_with

    hf = load_hf_model_with(model_dir)
    llm = LLM(str(model_dir), dtype="float32", block_size=BLOCK, max_model_len=256)
    prompts = oracle_prompts("deepseek_v3")[:3]  # HF top-1 margins >= 0.027 on these
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(16))
    for out, prompt in zip(outs, prompts, strict=True):
        ref = greedy_trace(hf, prompt, 16)
        comp = out.outputs[0]
        assert list(comp.token_ids) == ref.tokens, len(prompt)
        for tok, entry, lp in zip(comp.token_ids, comp.logprobs, ref.logprobs, strict=True):
            assert abs(float(getattr(entry[tok], "logprob", entry[tok])) - lp) <= 1e-4
    # The scaling is live: the plain-rope checkpoint gives other logprobs.
    plain = greedy_trace(load_hf_model_with(src), prompts[2], 16)
    assert max(abs(a - b) for a, b in zip(plain.logprobs, ref.logprobs, strict=False)) > 1e-2
