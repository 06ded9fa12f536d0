"""Correctness oracle: met's greedy decoding must reproduce transformers token for token.

For every tiny architecture (tests/tiny_models.py: llama, llama3 rope scaling, tied
embeddings, mistral sliding window, qwen2 qkv bias, qwen3 q/k norm, gemma3 mixed
sliding/full layers, qwen3 MoE, deepseek_v3 MLA with
grouped-routing MoE) and prompts of 5, 17, 40 and 75 tokens (under, across and
well past 16-token block boundaries; past the sliding window of 8; past llama3's original
context of 64), met's greedy tokens must equal transformers' and each chosen token's logprob
must match within 1e-4, whether a prompt runs alone, batched with others, in 16-token
prefill chunks, or from the prefix cache. After every generate call no KV block may still be
held by a request.

The HF-side tests at the bottom check the oracle itself: every tested greedy step has a clear
top-1 / top-2 margin (no test hinges on a tie), continuations are not degenerate, and the
features under test (sliding window, llama3 rope, biases, norms) actually change the output.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from tiny_models import (
    ARCHS,
    GEMMA_NORMS,
    HYBRID_NUM_LAYERS,
    MAX_NEW_TOKENS,
    PROMPT_LENS,
    SLIDING_WINDOW,
    TEXT_PROMPTS,
    all_test_prompts,
    greedy_trace,
    hf_greedy_trace,
    load_hf_model,
    load_hf_model_with,
    load_tokenizer,
    oracle_prompt,
    oracle_prompts,
    text_prompt_ids,
)

from met import LLM, SamplingParams

BLOCK_SIZE = 16
MAX_MODEL_LEN = 256
LOGPROB_ATOL = 1e-4
# Smallest top-1 minus top-2 logit gap allowed on any tested greedy step (logits have std ~4,
# float32 disagreement between implementations is ~1e-5). Observed minima: see tiny_models.
MIN_MARGIN = 1e-2
# Smallest gap between the k-th and (k+1)-th router probability (top-2 of 4 experts).
MIN_ROUTER_GAP = 2e-5
# The MoE archs and their router module's name under layer.mlp in transformers.
MOE_ROUTERS = [("qwen3_moe", "gate"), ("mixtral", "gate"), ("gpt_oss", "router")]


def greedy_params(max_tokens: int = MAX_NEW_TOKENS, logprobs: int = 0) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=logprobs
    )


def make_llm(model_dir, **kwargs) -> LLM:
    kwargs = {"dtype": "float32", "block_size": BLOCK_SIZE, "max_model_len": MAX_MODEL_LEN} | kwargs
    return LLM(str(model_dir), **kwargs)


def _lp(value) -> float:
    """A logprob entry as a float (accepts a plain float or a vLLM-style Logprob object)."""
    return float(getattr(value, "logprob", value))


def generate_checked(llm: LLM, prompts, params: SamplingParams):
    """llm.generate, then the invariants every call must keep."""
    outs = llm.generate(prompts, params)
    assert len(outs) == len(prompts)
    in_use = llm.kv_stats().num_blocks_in_use
    assert in_use == 0, f"{in_use} KV blocks still held by requests after generate() returned"
    state = llm.engine.state_stats()  # hybrid models: no state slot outlives its request
    assert state is None or state.num_slots_in_use == 0, (
        f"{state.num_slots_in_use} state slots still held after generate() returned")
    return outs


def assert_matches_hf(out, model_dir, prompt_ids: list[int], max_tokens: int = MAX_NEW_TOKENS):
    """met's RequestOutput ``out`` equals transformers' greedy run on ``prompt_ids``."""
    ref = hf_greedy_trace(model_dir, prompt_ids, max_tokens)
    assert list(out.prompt_token_ids) == list(prompt_ids)
    comp = out.outputs[0]
    got = list(comp.token_ids)
    if got != ref.tokens:
        i = next((j for j, (a, b) in enumerate(zip(got, ref.tokens, strict=False)) if a != b), None)
        if i is None:
            i = min(len(got), len(ref.tokens))
        pytest.fail(
            f"prompt of {len(prompt_ids)} tokens: greedy output diverges from transformers at "
            f"step {i} (absolute position {len(prompt_ids) + i}); HF top-1/top-2 margin there "
            f"{ref.margins[i] if i < len(ref.margins) else float('nan'):.4f}\n"
            f"  met: {got}\n  hf:  {ref.tokens}"
        )
    assert comp.finish_reason == "length"
    assert comp.logprobs is not None and len(comp.logprobs) == len(got)
    worst = 0.0
    for step, (tok, entry) in enumerate(zip(got, comp.logprobs, strict=False)):
        assert tok in entry, f"step {step}: chosen token {tok} missing from logprobs {entry}"
        err = abs(_lp(entry[tok]) - ref.logprobs[step])
        worst = max(worst, err)
        assert err <= LOGPROB_ATOL, (
            f"prompt of {len(prompt_ids)} tokens, step {step}: logprob {_lp(entry[tok])!r} vs "
            f"transformers {ref.logprobs[step]!r} (|diff| {err:.2e} > {LOGPROB_ATOL})"
        )
    return worst


# --------------------------------------------------------------------------------------------
# met vs transformers


@pytest.fixture(scope="module")
def shared_llm(tiny_checkpoint):
    """One met engine per arch (prefix caching off, so tests sharing it stay independent)."""
    engines: dict[str, LLM] = {}

    def get(arch: str) -> LLM:
        if arch not in engines:
            engines[arch] = make_llm(tiny_checkpoint(arch), enable_prefix_caching=False)
        return engines[arch]

    yield get
    engines.clear()


@pytest.mark.parametrize("prompt_len", PROMPT_LENS)
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_hf(arch, prompt_len, tiny_checkpoint, shared_llm):
    model_dir = tiny_checkpoint(arch)
    llm = shared_llm(arch)
    prompt = oracle_prompt(arch, prompt_len)
    (out,) = generate_checked(llm, [{"prompt_token_ids": prompt}], greedy_params())
    assert_matches_hf(out, model_dir, prompt)


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_greedy_matches_hf_and_prefix_cache(arch, tiny_checkpoint):
    """All prompts in one call (mixed lengths), then again: the second pass hits the prefix
    cache and must still reproduce transformers exactly."""
    model_dir = tiny_checkpoint(arch)
    llm = make_llm(model_dir, enable_prefix_caching=True)
    prompts = oracle_prompts(arch)
    requests = [{"prompt_token_ids": p} for p in prompts]

    first = generate_checked(llm, requests, greedy_params())
    for out, prompt in zip(first, prompts, strict=False):
        assert_matches_hf(out, model_dir, prompt)

    second = generate_checked(llm, requests, greedy_params())
    for out, prompt in zip(second, prompts, strict=False):
        assert_matches_hf(out, model_dir, prompt)
        cached = out.num_cached_tokens
        assert 0 <= cached < len(prompt), (len(prompt), cached)
        assert cached % BLOCK_SIZE == 0, f"cached {cached} is not whole {BLOCK_SIZE}-token blocks"
        if len(prompt) > BLOCK_SIZE:
            assert cached > 0, f"{len(prompt)}-token prompt seen before but nothing was cached"
    stats = llm.kv_stats()
    assert stats.num_blocks_cached > 0
    assert stats.num_blocks_cached <= stats.num_blocks_total


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_matches_hf(arch, tiny_checkpoint):
    """A 16-token step budget splits every prompt over 16 tokens into prefill chunks that run
    alongside other requests' decodes."""
    model_dir = tiny_checkpoint(arch)
    llm = make_llm(
        model_dir, max_num_batched_tokens=BLOCK_SIZE, max_num_seqs=4, enable_prefix_caching=False
    )
    prompts = oracle_prompts(arch)
    outs = generate_checked(llm, [{"prompt_token_ids": p} for p in prompts], greedy_params())
    for out, prompt in zip(outs, prompts, strict=False):
        assert_matches_hf(out, model_dir, prompt)


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma3", "qwen3_moe", "mixtral", "gpt_oss"])
def test_small_kv_pool_matches_hf(arch, tiny_checkpoint):
    """A KV pool too small for all requests at once (forces waiting / preemption) changes
    nothing in the output."""
    model_dir = tiny_checkpoint(arch)
    config = json.loads((model_dir / "config.json").read_text())
    # float32 K and V for every layer of one 16-token block.
    per_block = (
        2 * config["num_hidden_layers"] * BLOCK_SIZE * config["num_key_value_heads"]
        * config["head_dim"] * 4
    )
    llm = make_llm(model_dir, kv_cache_memory=12 * per_block, enable_prefix_caching=False)
    prompts = oracle_prompts(arch)
    need_each = [-(-(len(p) + MAX_NEW_TOKENS) // BLOCK_SIZE) for p in prompts]  # 3, 4, 5, 7
    # The pool must fit the largest request but not all of them at once.
    assert max(need_each) <= llm.kv_stats().num_blocks_total < sum(need_each)
    outs = generate_checked(llm, [{"prompt_token_ids": p} for p in prompts], greedy_params())
    for out, prompt in zip(outs, prompts, strict=False):
        assert_matches_hf(out, model_dir, prompt)
    assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_text_prompts_match_token_ids(arch, tiny_checkpoint, shared_llm):
    model_dir = tiny_checkpoint(arch)
    llm = shared_llm(arch)
    tokenizer = load_tokenizer(str(model_dir))
    ids = [list(tokenizer(t).input_ids) for t in TEXT_PROMPTS]
    assert ids == [text_prompt_ids(model_dir, t) for t in TEXT_PROMPTS]

    from_text = generate_checked(llm, list(TEXT_PROMPTS), greedy_params())
    from_ids = generate_checked(llm, [{"prompt_token_ids": i} for i in ids], greedy_params())
    for a, b, prompt in zip(from_text, from_ids, ids, strict=False):
        assert list(a.prompt_token_ids) == prompt
        assert list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids)
        assert_matches_hf(a, model_dir, prompt)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_topk_logprobs_match_hf(arch, tiny_checkpoint, shared_llm):
    k = 5
    model_dir = tiny_checkpoint(arch)
    llm = shared_llm(arch)
    prompt = oracle_prompt(arch, 40)
    (out,) = generate_checked(llm, [{"prompt_token_ids": prompt}], greedy_params(logprobs=k))
    assert_matches_hf(out, model_dir, prompt)
    ref = hf_greedy_trace(model_dir, prompt, MAX_NEW_TOKENS)
    for step, entry in enumerate(out.outputs[0].logprobs):
        want = ref.topk(step, k)
        # The chosen (greedy, so top-1) token plus the top k: exactly k distinct ids.
        assert set(entry) == set(want), (step, sorted(entry), sorted(want))
        for tok, lp in want.items():
            assert abs(_lp(entry[tok]) - lp) <= LOGPROB_ATOL, (step, tok, _lp(entry[tok]), lp)


@pytest.mark.parametrize("arch", ["llama3_rope", "qwen3_moe"])
def test_legacy_config_keys_match_hf(arch, tiny_checkpoint, tmp_path):
    """The same weights with a config.json in the pre-5.x Hub spelling (top-level rope_theta +
    rope_scaling, num_experts) that most published checkpoints still use."""
    src = tiny_checkpoint(arch)
    model_dir = tmp_path / f"{arch}-legacy"
    shutil.copytree(src, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    rope = dict(config.pop("rope_parameters"))
    config["rope_theta"] = rope.pop("rope_theta")
    if rope.get("rope_type", "default") != "default":
        config["rope_scaling"] = rope
    if "num_local_experts" in config:
        config["num_experts"] = config.pop("num_local_experts")
    (model_dir / "config.json").write_text(json.dumps(config, indent=2))

    llm = make_llm(model_dir, enable_prefix_caching=False)
    prompts = oracle_prompts(arch)
    outs = generate_checked(llm, [{"prompt_token_ids": p} for p in prompts], greedy_params())
    for out, prompt in zip(outs, prompts, strict=False):
        # The reference is the original checkpoint: the legacy spelling must mean the same.
        assert_matches_hf(out, src, prompt)
    # ... and transformers itself reads the legacy spelling identically.
    legacy = load_hf_model_with(model_dir)
    want = hf_greedy_trace(src, prompts[-1], 8).tokens
    assert greedy_trace(legacy, prompts[-1], 8).tokens == want


# --------------------------------------------------------------------------------------------
# the oracle itself (transformers only)


@pytest.mark.parametrize("arch", ARCHS)
def test_hf_reference_is_decisive(arch, tiny_checkpoint):
    """No tested greedy step is a near-tie, and no continuation is degenerate."""
    model_dir = tiny_checkpoint(arch)
    for prompt in all_test_prompts(arch, model_dir):
        ref = hf_greedy_trace(model_dir, prompt, MAX_NEW_TOKENS)
        assert len(ref.tokens) == MAX_NEW_TOKENS
        worst = min(range(len(ref.margins)), key=ref.margins.__getitem__)
        assert ref.margins[worst] >= MIN_MARGIN, (
            f"{arch}: {len(prompt)}-token prompt has a near-tie at step {worst} "
            f"(top-1 minus top-2 logit {ref.margins[worst]:.2e} < {MIN_MARGIN}); re-pick "
            f"SPECS[{arch!r}].seed_offset in tiny_models.py"
        )
        distinct = len(set(ref.tokens))
        assert distinct >= 8, f"{arch}: degenerate continuation ({distinct} distinct): {ref.tokens}"
        # A non-trivial distribution: the chosen token is likely but not certain.
        mean_lp = sum(ref.logprobs) / len(ref.logprobs)
        assert -3.0 < mean_lp < -0.1, f"{arch}: mean chosen logprob {mean_lp:.3f}"


@pytest.mark.parametrize("arch,router", MOE_ROUTERS)
def test_hf_moe_routing_is_decisive(arch, router, tiny_checkpoint):
    """MoE archs: the k-th and (k+1)-th expert are never near-tied on a tested sequence, so
    a float32 rounding difference cannot flip which experts run."""
    model_dir = tiny_checkpoint(arch)
    model = load_hf_model(str(model_dir))
    k = model.config.num_experts_per_tok
    gaps: list[float] = []

    def hook(_module, _inputs, output):
        probs = torch.softmax(output[0].to(torch.float64), dim=-1)
        top = probs.sort(dim=-1, descending=True).values
        gaps.append(float((top[:, k - 1] - top[:, k]).min()))

    handles = [getattr(layer.mlp, router).register_forward_hook(hook)
               for layer in model.model.layers]
    try:
        with torch.inference_mode():
            for prompt in all_test_prompts(arch, model_dir):
                ref = hf_greedy_trace(model_dir, prompt, MAX_NEW_TOKENS)
                model(input_ids=torch.tensor([prompt + ref.tokens]), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    assert gaps and min(gaps) >= MIN_ROUTER_GAP, min(gaps)


def test_hf_deepseek_routing_is_decisive(tiny_checkpoint):
    """deepseek_v3: on every tested sequence the kept expert group wins clearly over the
    other (sum of its two best biased scores) and, inside it, the 2nd and 3rd biased
    scores are apart, so no rounding difference can change which experts run."""
    model_dir = tiny_checkpoint("deepseek_v3")
    model = load_hf_model(str(model_dir))
    group_gaps: list[float] = []
    expert_gaps: list[float] = []

    def hook(module, _inputs, output):
        choice = torch.sigmoid(output[0].to(torch.float64)) + module.e_score_correction_bias
        grouped = choice.view(choice.shape[0], module.num_group, -1)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1).sort(dim=-1, descending=True)
        group_gaps.append(float((group_scores.values[:, 0] - group_scores.values[:, 1]).min()))
        best = grouped[torch.arange(choice.shape[0]), group_scores.indices[:, 0]]
        top = best.sort(dim=-1, descending=True).values
        expert_gaps.append(float((top[:, 1] - top[:, 2]).min()))

    gates = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    assert gates and all(g.num_group == 2 and g.topk_group == 1 for g in gates)
    handles = [g.register_forward_hook(hook) for g in gates]
    try:
        with torch.inference_mode():
            for prompt in all_test_prompts("deepseek_v3", model_dir):
                ref = hf_greedy_trace(model_dir, prompt, MAX_NEW_TOKENS)
                model(input_ids=torch.tensor([prompt + ref.tokens]), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    assert min(group_gaps) >= MIN_ROUTER_GAP, min(group_gaps)
    assert min(expert_gaps) >= MIN_ROUTER_GAP, min(expert_gaps)


def _diverges(model_a, model_b, prompt) -> bool:
    a = greedy_trace(model_a, prompt, MAX_NEW_TOKENS)
    b = greedy_trace(model_b, prompt, MAX_NEW_TOKENS)
    if a.tokens != b.tokens:
        return True
    return max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=False)) > 1e-2


@pytest.mark.parametrize("arch", ["mistral", "gemma3", "mixtral", "gpt_oss"])
def test_hf_sliding_window_matters(arch, tiny_checkpoint):
    """Ignoring the window, or getting its width off by one, would change the output, so
    met's window handling is really tested. (transformers: the query at position q sees keys
    q - sliding_window < k <= q, i.e. sliding_window keys including itself.)"""
    model_dir = tiny_checkpoint(arch)
    assert json.loads((model_dir / "config.json").read_text())["sliding_window"] == SLIDING_WINDOW
    reference = load_hf_model(str(model_dir))
    prompts = oracle_prompts(arch)
    unwindowed = load_hf_model_with(model_dir, sliding_window=4096)
    for prompt in prompts:
        assert _diverges(reference, unwindowed, prompt), len(prompt)
    for width in (SLIDING_WINDOW - 1, SLIDING_WINDOW + 1):
        off_by_one = load_hf_model_with(model_dir, sliding_window=width)
        for prompt in prompts[2:]:
            assert _diverges(reference, off_by_one, prompt), (width, len(prompt))


def test_hf_llama3_rope_scaling_matters(tiny_checkpoint):
    model_dir = tiny_checkpoint("llama3_rope")
    config = json.loads((model_dir / "config.json").read_text())
    assert config["rope_parameters"]["rope_type"] == "llama3"
    rope = config["rope_parameters"]
    plain = load_hf_model_with(
        model_dir, rope_parameters={"rope_type": "default", "rope_theta": rope["rope_theta"]}
    )
    prompts = oracle_prompts("llama3_rope")
    # Positions past original_max_position_embeddings (64) are generated...
    assert len(prompts[-1]) + MAX_NEW_TOKENS > rope["original_max_position_embeddings"]
    # ... and the scaled frequencies change what is generated.
    assert all(_diverges(load_hf_model(str(model_dir)), plain, p) for p in prompts[1:])


def _tensors(model_dir) -> dict[str, torch.Tensor]:
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.parametrize("arch", ARCHS)
def test_checkpoint_exercises_its_features(arch, tiny_checkpoint):
    """Biases non-zero, norm weights not at their identity init, tied models without an
    lm_head tensor, MoE experts stored per expert (the Hub layout), tokenizer round trip."""
    model_dir = tiny_checkpoint(arch)
    config = json.loads((model_dir / "config.json").read_text())
    tensors = _tensors(model_dir)
    assert all(t.dtype == torch.float32 for t in tensors.values())
    hybrid = arch in ("bamba", "qwen3_next")
    assert config["num_hidden_layers"] == (HYBRID_NUM_LAYERS if hybrid else 2)
    assert config["hidden_size"] == 64
    assert config["head_dim"] == 16 and config["num_attention_heads"] == 4
    # MLA (deepseek_v3) has one latent per token; the reference needs kv heads == heads.
    assert config["num_key_value_heads"] == (4 if arch == "deepseek_v3" else 2)
    assert 256 <= config["vocab_size"] <= 512
    assert tensors["model.embed_tokens.weight"].shape[0] == config["vocab_size"]

    norms = [t for k, t in tensors.items() if k.endswith("norm.weight")]
    identity = 0.0 if arch in GEMMA_NORMS else 1.0  # gemma stores w of (1 + w)
    assert norms and all(t.sub(identity).abs().max() > 0.1 for t in norms)
    assert all(t.std() > 0.05 for t in norms)
    if arch == "qwen2":
        biases = [k for k in tensors if k.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias"))]
        assert len(biases) == 3 * 2 and all(tensors[k].abs().min() > 0 for k in biases)
    if arch in ("qwen3", "qwen3_moe", "gemma3", "olmo2"):
        assert "model.layers.0.self_attn.q_norm.weight" in tensors
        assert "model.layers.0.self_attn.k_norm.weight" in tensors
    tied = config.get("tie_word_embeddings", False)
    assert tied == (arch in ("llama_tied", "gemma3", "gemma2"))
    assert ("lm_head.weight" in tensors) == (not tied)
    if arch == "qwen3_moe":
        assert "model.layers.0.mlp.experts.3.gate_proj.weight" in tensors
        assert "model.layers.1.mlp.experts.0.down_proj.weight" in tensors
        assert "model.layers.0.mlp.gate.weight" in tensors
    if arch == "deepseek_v3":
        assert config["q_lora_rank"] and "model.layers.0.self_attn.q_a_layernorm.weight" in tensors
        assert tensors["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"].shape == (
            config["kv_lora_rank"] + config["qk_rope_head_dim"], 64)
        assert config["v_head_dim"] != config["qk_nope_head_dim"] + config["qk_rope_head_dim"]
        assert "model.layers.0.mlp.gate_proj.weight" in tensors  # first_k_dense_replace 1
        assert "model.layers.1.mlp.experts.7.down_proj.weight" in tensors
        assert "model.layers.1.mlp.shared_experts.up_proj.weight" in tensors
        assert tensors["model.layers.1.mlp.gate.e_score_correction_bias"].abs().min() > 0
        assert config["n_group"] == 2 and config["topk_group"] == 1
    if arch in ("gemma3", "gemma2"):
        assert config["layer_types"] == ["sliding_attention", "full_attention"]
        assert config["query_pre_attn_scalar"] != config["head_dim"]
    if arch == "mixtral":  # the Hub's Mixtral layout
        assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in tensors
        assert "model.layers.1.block_sparse_moe.experts.0.w2.weight" in tensors
        assert "model.layers.0.block_sparse_moe.gate.weight" in tensors
    if arch == "gpt_oss":
        assert config["layer_types"] == ["sliding_attention", "full_attention"]
        assert tensors["model.layers.0.self_attn.sinks"].shape == (config["num_attention_heads"],)
        for part in ("router.bias", "experts.gate_up_proj_bias", "experts.down_proj_bias"):
            assert tensors[f"model.layers.1.mlp.{part}"].abs().min() > 0, part
    if arch == "bamba":  # mamba, attention, mamba; every mixer parameter away from its init
        assert config["attn_layer_indices"] == [1]
        assert "model.layers.1.self_attn.q_proj.weight" in tensors
        for layer in (0, 2):
            for name in ("A_log", "D", "dt_bias", "conv1d.bias"):
                t = tensors[f"model.layers.{layer}.mamba.{name}"]
                assert t.std() > 0.05, (layer, name)
    if arch == "qwen3_next":  # linear, full, linear attention; the full one's q is doubled
        assert config["layer_types"][1] == "full_attention"
        assert tensors["model.layers.1.self_attn.q_proj.weight"].shape[0] == 2 * 4 * 16
        for layer in (0, 2):
            for name in ("A_log", "dt_bias"):
                assert tensors[f"model.layers.{layer}.linear_attn.{name}"].std() > 0.05
    if arch == "phi3":  # the Hub layout: fused projections
        assert "model.layers.0.self_attn.qkv_proj.weight" in tensors
        assert "model.layers.1.mlp.gate_up_proj.weight" in tensors
        assert "model.layers.0.self_attn.q_proj.weight" not in tensors
        assert config["rope_parameters"]["partial_rotary_factor"] < 1
    if arch == "olmo2":  # full-width q/k norms, post-norms only
        assert tensors["model.layers.0.self_attn.q_norm.weight"].shape == (64,)
        assert tensors["model.layers.0.self_attn.k_norm.weight"].shape == (32,)
        assert "model.layers.0.post_feedforward_layernorm.weight" in tensors
        assert "model.layers.0.input_layernorm.weight" not in tensors

    tokenizer = load_tokenizer(str(model_dir))
    assert len(tokenizer) == config["vocab_size"]
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert config["eos_token_id"] == tokenizer.eos_token_id == eos
    text = TEXT_PROMPTS[0]
    assert tokenizer.decode(tokenizer(text).input_ids, skip_special_tokens=True) == text
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_hf_gpt_oss_sinks_and_swiglu_limit_matter(tiny_checkpoint):
    """Dropping the attention sinks, or not clamping the SwiGLU, changes gpt_oss's output,
    so met's sinks and clamps are really tested."""
    model_dir = tiny_checkpoint("gpt_oss")
    reference = load_hf_model(str(model_dir))
    no_sinks = load_hf_model_with(model_dir)
    with torch.no_grad():
        for layer in no_sinks.model.layers:
            layer.self_attn.sinks.fill_(-1e4)
    unclamped = load_hf_model_with(model_dir, swiglu_limit=1e4)
    for prompt in oracle_prompts("gpt_oss"):
        assert _diverges(reference, no_sinks, prompt), len(prompt)
        assert _diverges(reference, unclamped, prompt), len(prompt)


@pytest.mark.parametrize(("arch", "overrides"), [
    ("gemma2", {"attn_logit_softcapping": None}),
    ("gemma2", {"final_logit_softcapping": None}),
    ("phi3", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                  "partial_rotary_factor": 1.0}}),
    ("granite", {"embedding_multiplier": 1.0}),
    ("granite", {"residual_multiplier": 1.0}),
    ("granite", {"attention_multiplier": 0.25}),
    ("granite", {"logits_scaling": 1.0}),
])
def test_hf_family_features_matter(arch, overrides, tiny_checkpoint):
    """Dropping one family feature (a softcap, partial rotary, a Granite multiplier) changes
    transformers' output on the tested prompts, so met's handling of it is really tested."""
    model_dir = tiny_checkpoint(arch)
    reference = load_hf_model(str(model_dir))
    without = load_hf_model_with(model_dir, **overrides)
    prompts = oracle_prompts(arch)
    assert sum(_diverges(reference, without, p) for p in prompts) >= 2, overrides


def test_hf_deepseek_group_limit_and_bias_matter(tiny_checkpoint):
    """deepseek_v3: routing over all experts (no group limit), or without the correction
    bias, changes what is generated, so met's group-limited, bias-steered routing is really
    tested by the oracle."""
    model_dir = tiny_checkpoint("deepseek_v3")
    reference = load_hf_model(str(model_dir))
    prompts = oracle_prompts("deepseek_v3")
    ungrouped = load_hf_model_with(model_dir, n_group=1, topk_group=1)
    assert any(_diverges(reference, ungrouped, p) for p in prompts)
    unbiased = load_hf_model_with(model_dir)
    with torch.no_grad():
        for layer in unbiased.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.zero_()
    assert any(_diverges(reference, unbiased, p) for p in prompts)
