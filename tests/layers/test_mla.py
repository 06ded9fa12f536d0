"""MLA and DeepSeek routing, layer by layer: weight absorption equals the up-projected
attention, the routers equal transformers' on the same logits, the softmax scale folds
YaRN's mscale as transformers does."""

from __future__ import annotations

import pytest
import torch
from tiny_models import DEEPSEEK_KV_LORA_RANK, DEEPSEEK_ROPE_DIM

from met import LLM
from met.kernels import kv_cache
from met.layers.grouped_topk import GroupedRouting, route
from met.layers.mla import rope_interleaved, softmax_scale


@pytest.fixture(scope="module")
def mla_layer(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint("deepseek_v3")), dtype="float32", max_model_len=256,
              enable_prefix_caching=False)
    return llm.engine.loaded.model.model.layers[1].self_attn


def _latent_cache(num_slots: int, seed: int, dtype=torch.float32) -> kv_cache.KVCache:
    gen = torch.Generator().manual_seed(seed)
    width = DEEPSEEK_KV_LORA_RANK + DEEPSEEK_ROPE_DIM
    cache = kv_cache.allocate(1, num_slots, width, dtype, "cpu", v_head_dim=0)
    rows = torch.randn(num_slots, 1, width, generator=gen).to(dtype)
    kv_cache.write_keys(cache, torch.arange(num_slots), rows)
    return cache


@pytest.mark.parametrize("lengths", [(1,), (7,), (3, 29, 12)])
def test_absorbed_decode_equals_up_projected_attention(mla_layer, lengths):
    """Decode rows attending in the latent space give what per-head keys and values from
    kv_b_proj give (float32, to rounding), for contexts of any length, batched."""
    attn, gen = mla_layer, torch.Generator().manual_seed(len(lengths))
    n, h = len(lengths), attn.num_heads
    cache = _latent_cache(64, seed=sum(lengths))
    perm = torch.randperm(64, generator=gen)
    slots = [perm[: length] for length in lengths]  # scattered slots, like paged blocks
    q_nope = torch.randn(n, h, attn.nope_dim, generator=gen)
    q_rot = torch.randn(n, h, attn.rope_dim, generator=gen)
    offsets = torch.tensor([0, *torch.cumsum(torch.tensor(lengths), 0).tolist()])
    got = attn._absorbed(q_nope, q_rot, cache, torch.cat(slots), offsets)
    for i in range(n):
        want = attn._expanded(q_nope[i:i + 1], q_rot[i:i + 1], cache, slots[i], None)
        torch.testing.assert_close(got[i:i + 1], want, rtol=1e-5, atol=1e-5)
    assert got.shape == (n, h, attn.v_dim)


def test_absorbed_decode_runs_on_an_int8_latent_cache(mla_layer):
    """An int8 latent cache (one scale per row) is read back dequantized by both paths."""
    attn, gen = mla_layer, torch.Generator().manual_seed(5)
    width = DEEPSEEK_KV_LORA_RANK + DEEPSEEK_ROPE_DIM
    cache = kv_cache.allocate(1, 16, width, torch.float32, "cpu", "int8", v_head_dim=0)
    assert cache.v.shape == (1, 16, 0) and cache.v_scale.numel() == 0
    rows = torch.randn(16, 1, width, generator=gen)
    kv_cache.write_keys(cache, torch.arange(16), rows)
    back = kv_cache.gather_keys(cache, torch.arange(16), torch.float32)
    assert (back[0] - rows[:, 0]).abs().max() <= rows.abs().amax() / 127
    q_nope = torch.randn(1, attn.num_heads, attn.nope_dim, generator=gen)
    q_rot = torch.randn(1, attn.num_heads, attn.rope_dim, generator=gen)
    got = attn._absorbed(q_nope, q_rot, cache, torch.arange(16), torch.tensor([0, 16]))
    want = attn._expanded(q_nope, q_rot, cache, torch.arange(16), None)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_interleaved_rope_matches_transformers():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        apply_rotary_pos_emb_interleave,
    )

    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(5, 4, 16, generator=gen), torch.randn(5, 1, 16, generator=gen)
    freqs = torch.randn(5, 8, generator=gen)
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos(), emb.sin()
    # transformers: [batch, heads, seq, dim] with cos [batch, seq, dim]
    want_q, want_k = apply_rotary_pos_emb_interleave(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    got_q = rope_interleaved(q, cos[:, None], sin[:, None])
    got_k = rope_interleaved(k, cos[:, None], sin[:, None])
    assert torch.equal(got_q, want_q[0].transpose(0, 1))
    assert torch.equal(got_k, want_k[0].transpose(0, 1))


def _hf_v3_router(routing: GroupedRouting, logits_weight: torch.Tensor, bias: torch.Tensor):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = DeepseekV3Config(hidden_size=logits_weight.shape[1],
                              n_routed_experts=routing.num_experts,
                              num_experts_per_tok=routing.top_k, n_group=routing.n_group,
                              topk_group=routing.topk_group,
                              norm_topk_prob=routing.norm_topk_prob,
                              routed_scaling_factor=routing.routed_scaling_factor)
    router = DeepseekV3TopkRouter(config)
    with torch.no_grad():
        router.weight.copy_(logits_weight)
        router.e_score_correction_bias.copy_(bias)
    return router


def _sorted(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = ids.argsort(dim=-1)
    return weights.gather(1, order), ids.gather(1, order)


@pytest.mark.parametrize(("experts", "top_k", "groups", "topk_group", "norm"),
                         [(8, 2, 2, 1, True), (16, 4, 4, 2, True), (8, 3, 1, 1, False),
                          (8, 1, 4, 2, True)])
def test_v3_router_matches_transformers(experts, top_k, groups, topk_group, norm):
    """Sigmoid scores, the correction bias steering the choice only, groups ranked by their
    two best biased scores, renormalisation and the routed scaling factor."""
    routing = GroupedRouting(experts, top_k, "noaux_tc", groups, topk_group, norm, 2.5)
    gen = torch.Generator().manual_seed(experts + top_k)
    weight = torch.randn(experts, 32, generator=gen)
    bias = torch.randn(experts, generator=gen) * 0.2
    x = torch.randn(50, 32, generator=gen)
    _, want_w, want_ids = _hf_v3_router(routing, weight, bias)(x)
    got_w, got_ids = route(torch.nn.functional.linear(x, weight), routing, bias)
    want_w, want_ids = _sorted(want_w, want_ids)
    got_w, got_ids = _sorted(got_w, got_ids)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_v2_router_matches_transformers(method):
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    config = DeepseekV2Config(hidden_size=32, n_routed_experts=8, num_experts_per_tok=3,
                              n_group=4, topk_group=2, topk_method=method,
                              routed_scaling_factor=1.5)
    router = DeepseekV2TopkRouter(config)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        router.weight.copy_(torch.randn(8, 32, generator=gen))
    x = torch.randn(40, 32, generator=gen)
    _, want_w, want_ids = router(x)
    routing = GroupedRouting(8, 3, method, 4, 2, False, 1.5)
    got_w, got_ids = route(torch.nn.functional.linear(x, router.weight), routing)
    want_w, want_ids = _sorted(want_w, want_ids)
    got_w, got_ids = _sorted(got_w, got_ids)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, rtol=1e-6, atol=1e-7)
    # Groups matter here: some token's best 3 experts span more than its 2 best groups.
    plain = route(torch.nn.functional.linear(x, router.weight),
                  GroupedRouting(8, 3, "greedy", routed_scaling_factor=1.5))[1]
    assert torch.equal(plain.sort(dim=-1).values, got_ids) == (method == "greedy")


@pytest.mark.parametrize("field", ["n_group", "topk_group", "num_experts_per_tok",
                                   "topk_method"])
def test_bad_routing_config_names_the_field(field):
    bad = {"n_group": dict(n_group=3), "topk_group": dict(topk_group=5),
           "num_experts_per_tok": dict(top_k=7, n_group=4, topk_group=1),
           "topk_method": dict(method="softmax_topk")}[field]
    kwargs = dict(num_experts=8, top_k=2, method="noaux_tc", n_group=2, topk_group=1) | bad
    with pytest.raises(ValueError, match=field):
        GroupedRouting(**kwargs)


@pytest.mark.parametrize("rope", [
    {"rope_type": "default", "rope_theta": 1e4},
    {"rope_type": "yarn", "rope_theta": 1e4, "factor": 40.0, "mscale": 1.0,
     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096},
    {"rope_type": "yarn", "rope_theta": 1e4, "factor": 40.0, "mscale": 1.0,
     "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096},
])
def test_softmax_scale_matches_transformers(rope):
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import yarn_apply_mscale

    config = DeepseekV3Config(qk_nope_head_dim=128, qk_rope_head_dim=64, rope_parameters=rope)
    want = yarn_apply_mscale(config.rope_parameters, (128 + 64) ** -0.5)
    assert softmax_scale(config) == pytest.approx(want, rel=1e-12)
    if rope["rope_type"] == "yarn":
        assert softmax_scale(config) > 1.1 * (128 + 64) ** -0.5
