"""Attention sinks (gpt-oss) in the plain varlen reference: a learned logit per head that
joins each row's softmax denominator and attends to nothing."""

from __future__ import annotations

import math

import torch

from met.kernels.varlen import VarlenMeta, attention_reference


def _case(seed=0):
    gen = torch.Generator().manual_seed(seed)
    heads, kv_heads, d, slots = 4, 2, 16, 40
    k = torch.randn(kv_heads, slots, d, generator=gen)
    v = torch.randn(kv_heads, slots, d, generator=gen)
    # Two sequences: 3 new rows over a 9-token context, 1 row over a 12-token context.
    perm = torch.randperm(slots, generator=gen)
    meta = VarlenMeta.build([(0, 3, 9, perm[:9]), (3, 1, 12, perm[9:21])], "cpu")
    q = torch.randn(4, heads, d, generator=gen)
    return q, k, v, meta


def _by_hand(q, k, v, meta, scale, sinks, window=None):
    out = torch.zeros_like(q)
    group = q.shape[1] // k.shape[0]
    for i, n in enumerate(meta.q_lens):
        qs, ctx, s0 = int(meta.q_start[i]), int(meta.ctx_len[i]), int(meta.slot_start[i])
        slots = meta.slots[s0:s0 + ctx]
        for r in range(n):
            pos = ctx - n + r
            for h in range(q.shape[1]):
                keys = [j for j in range(pos + 1) if window is None or pos - j < window]
                kh, vh = k[h // group, slots[keys]], v[h // group, slots[keys]]
                s = (kh.double() @ q[qs + r, h].double()) * scale
                w = torch.exp(s - s.max())
                denom = w.sum() + math.exp(float(sinks[h]) - float(s.max()))
                out[qs + r, h] = ((w / denom) @ vh.double()).float()
    return out


def test_sinks_join_the_denominator():
    q, k, v, meta = _case()
    sinks = torch.tensor([-1.0, 0.0, 1.5, 3.0])
    scale = 16**-0.5
    for window in (None, 4):
        got = attention_reference(q, k, v, None, None, meta, scale, window, sinks=sinks)
        torch.testing.assert_close(got, _by_hand(q, k, v, meta, scale, sinks, window),
                                   rtol=1e-5, atol=1e-5)
    # A sink takes its share: a large one shrinks the output towards zero.
    plain = attention_reference(q, k, v, None, None, meta, scale)
    big = attention_reference(q, k, v, None, None, meta, scale, sinks=torch.full((4,), 50.0))
    assert big.abs().max() < 1e-6 * plain.abs().max() + 1e-12


def test_very_negative_sinks_are_plain_attention():
    q, k, v, meta = _case(1)
    plain = attention_reference(q, k, v, None, None, meta, 0.25)
    torch.testing.assert_close(
        attention_reference(q, k, v, None, None, meta, 0.25, sinks=torch.full((4,), -1e4)),
        plain, rtol=0, atol=0)
