"""Routed experts as one grouped operation (met.layers.moe.apply_experts) against the
per-expert loop it replaced and a per-token dense reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from met.kernels.grouped_mm import grouped_mm, padded_bmm
from met.layers.moe import ClampedSwiGLUExperts, ExpertStack, apply_experts


def _stack(cls=ExpertStack, hidden=64, inter=32, experts=8, seed=0, **kw):
    stack = cls(hidden, inter, experts, torch.float32, **kw)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in stack.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    return stack


def _routing(t, experts, k, seed=1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, 64, generator=gen)
    weights, ids = torch.topk(torch.randn(t, experts, generator=gen).softmax(-1), k)
    return x, weights, ids


def _loop(x, weights, ids, stack, act):
    """The replaced implementation: one matmul chain per expert that got tokens."""
    out = torch.zeros_like(x)
    for e in torch.unique(ids).tolist():
        tok, slot = torch.where(ids == e)
        h = x[tok]
        h = act(F.linear(h, stack.gate_proj[e])) * F.linear(h, stack.up_proj[e])
        out.index_add_(0, tok, F.linear(h, stack.down_proj[e]) * weights[tok, slot, None])
    return out


def _per_token(x, weights, ids, stack, act):
    """Each token alone, each of its experts as a dense MLP (with biases where present)."""
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros(x.shape[1], dtype=torch.float64)
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = x[t].double()
            g = stack.gate_proj[e].double() @ h
            u = stack.up_proj[e].double() @ h
            if hasattr(stack, "gate_bias"):
                g, u = g + stack.gate_bias[e].double(), u + stack.up_bias[e].double()
            y = stack.down_proj[e].double() @ stack.combine(g, u, act)
            if hasattr(stack, "down_bias"):
                y = y + stack.down_bias[e].double()
            acc += float(weights[t, j]) * y
        rows.append(acc)
    return torch.stack(rows).float()


@pytest.mark.parametrize("t", [1, 3, 8, 64])
def test_grouped_equals_the_per_expert_loop(t):
    stack = _stack()
    x, weights, ids = _routing(t, 8, 2)
    got = apply_experts(x, weights, ids, stack, F.silu)
    # On the CPU every group is one dense matmul, in token order: bitwise the loop's result.
    assert torch.equal(got, _loop(x, weights, ids, stack, F.silu))
    torch.testing.assert_close(got, _per_token(x, weights, ids, stack, F.silu),
                               rtol=1e-5, atol=1e-5)


def test_padded_bmm_equals_grouped_mm():
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(6, 24, 40, generator=gen)
    counts = torch.tensor([0, 5, 1, 0, 9, 2])  # empty groups first, between and last-but-one
    offsets = counts.cumsum(0).to(torch.int32)
    x = torch.randn(int(counts.sum()), 40, generator=gen)
    ref = torch.cat([x[s:e] @ w[g].T for g, (s, e) in
                     enumerate(zip([0, *offsets[:-1].tolist()], offsets.tolist(), strict=True))])
    torch.testing.assert_close(grouped_mm(x, w, offsets), ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(padded_bmm(x, w, offsets), ref, rtol=1e-5, atol=1e-5)
    assert padded_bmm(x[:0], w, torch.zeros(6, dtype=torch.int32)).shape == (0, 24)


def test_a_tokens_output_does_not_depend_on_its_batch_mates():
    """Alone, or among 40 other tokens routed anywhere, a token gets the same result (float32
    matmuls round differently by row count, hence the 1e-6 tolerance, far below what moves
    a logprob by 1e-4)."""
    stack = _stack()
    x, weights, ids = _routing(41, 8, 2)
    batched = apply_experts(x, weights, ids, stack, F.silu)
    for t in (0, 17, 40):
        alone = apply_experts(x[t:t + 1], weights[t:t + 1], ids[t:t + 1], stack, F.silu)
        torch.testing.assert_close(batched[t:t + 1], alone, rtol=1e-6, atol=1e-6)
    # Reordering the batch permutes the outputs and changes nothing else.
    perm = torch.randperm(41, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(apply_experts(x[perm], weights[perm], ids[perm], stack, F.silu),
                               batched[perm], rtol=1e-6, atol=1e-6)


def test_biased_clamped_swiglu_experts():
    """gpt-oss's stack: per-expert biases and the clamped SwiGLU, with a limit small enough
    that both clamps bite."""
    stack = _stack(ClampedSwiGLUExperts, alpha=1.702, limit=0.5)
    x, weights, ids = _routing(12, 8, 3)
    gate = torch.einsum("th,teih->tei", x, stack.gate_proj[ids])
    assert (gate > 0.5).any() and (gate.abs() > 0.5).any()
    got = apply_experts(x, weights, ids, stack, F.silu)
    torch.testing.assert_close(got, _per_token(x, weights, ids, stack, F.silu),
                               rtol=1e-5, atol=1e-5)


def test_bad_expert_tensors_are_refused_naming_them():
    from met.kernels.gguf_blocks import from_float
    from met.layers.moe import attach_expert_blocks
    from met.models.gpt_oss import load_gpt_oss_expert_weight

    stack = _stack(ClampedSwiGLUExperts, alpha=1.702, limit=7.0)
    params = {f"model.layers.0.mlp.experts.{n}": p for n, p in stack.named_parameters()}
    mxfp4 = "model.layers.0.mlp.experts.gate_up_proj_blocks"
    with pytest.raises(ValueError, match="gate_up_proj_blocks.*MXFP4"):
        load_gpt_oss_expert_weight(mxfp4, torch.zeros(8, 64, 2, 16, dtype=torch.uint8), params)
    wrong = "model.layers.0.mlp.experts.down_proj"
    with pytest.raises(ValueError, match="down_proj.*expects"):
        load_gpt_oss_expert_weight(wrong, torch.zeros(8, 64, 32), params)  # not transposed
    with pytest.raises(ValueError, match="blk.0.ffn_up_exps"):
        attach_expert_blocks(stack.up_proj, 0, from_float(torch.zeros(32, 32)), "blk.0.ffn_up_exps")
