"""The Mamba-2 mixer's pieces against the plain recurrence they compute.

`ssd_scan` (chunked state space dual form, chunks on the absolute block grid) must give the
outputs and boundary states of h_t = exp(dt_t a) h_{t-1} + dt_t x_t b_t, y_t = c_t . h_t
run one token at a time, from any start position and initial state.
"""

from __future__ import annotations

import pytest
import torch

from met.layers.mamba import GatedRMSNorm, ssd_scan


def _recurrence(x, dt, a, b, c, h0):
    h = h0.clone()
    ys, states = [], []
    for t in range(x.shape[0]):
        inject = (dt[t][:, None] * x[t])[..., None] * b[t][:, None, :]
        h = h * torch.exp(dt[t] * a)[:, None, None] + inject
        ys.append((h * c[t][:, None, :]).sum(-1))
        states.append(h.clone())
    return torch.stack(ys), states


@pytest.mark.parametrize("start,length", [(0, 1), (0, 16), (0, 37), (5, 11), (13, 40), (16, 3)])
def test_ssd_scan_matches_recurrence(start, length):
    gen = torch.Generator().manual_seed(start * 100 + length)
    heads, p, n, chunk = 4, 8, 6, 16
    x = torch.randn(length, heads, p, generator=gen)
    dt = torch.rand(length, heads, generator=gen) * 0.3
    a = -torch.rand(heads, generator=gen) * 4 - 0.5
    b = torch.randn(length, heads, n, generator=gen)
    c = torch.randn(length, heads, n, generator=gen)
    h0 = torch.randn(heads, p, n, generator=gen)
    y, states = ssd_scan(x, dt, a, b, c, h0, start % chunk, chunk)
    want_y, want_states = _recurrence(x, dt, a, b, c, h0)
    torch.testing.assert_close(y, want_y, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(states[0], h0)
    torch.testing.assert_close(states[-1], want_states[-1], atol=1e-4, rtol=1e-4)
    # states[j]: after the tokens before absolute position (start // chunk + j) * chunk.
    for j in range(1, states.shape[0] - 1):
        done = (start // chunk + j) * chunk - start
        torch.testing.assert_close(states[j], want_states[done - 1], atol=1e-4, rtol=1e-4)


def test_gated_rms_norm_normalises_each_group():
    norm = GatedRMSNorm(8, 4, 1e-6, torch.float32)
    norm.weight.data.fill_(1.0)
    y = torch.randn(3, 8)
    gate = torch.randn(3, 8)
    out = norm(y, gate)
    h = y * torch.nn.functional.silu(gate)
    for g in range(2):
        part = h[:, 4 * g:4 * g + 4]
        want = part / part.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()
        torch.testing.assert_close(out[:, 4 * g:4 * g + 4], want)


def test_gated_delta_rule_matches_transformers_chunked_form():
    """met's token-by-token delta rule (decode rows batched) gives transformers' chunked
    form (chunk 64, the prefill reference) on 70 tokens from a non-zero state."""
    from transformers.models.qwen3_next import modeling_qwen3_next as ref

    from met.layers.gated_delta import GatedDeltaNet

    class Cfg:
        hidden_size, linear_num_value_heads, linear_num_key_heads = 32, 4, 2
        linear_key_head_dim, linear_value_head_dim, linear_conv_kernel_dim = 8, 8, 4
        rms_norm_eps, hidden_act = 1e-6, "silu"

    net = GatedDeltaNet(Cfg, torch.float32)
    gen = torch.Generator().manual_seed(0)
    t, nk, nv, dk, dv = 70, 2, 4, 8, 8
    conv = torch.randn(t, 2 * nk * dk + nv * dv, generator=gen)
    g = -torch.rand(t, nv, generator=gen)
    beta = torch.rand(t, nv, generator=gen)
    s0 = torch.randn(1, nv, dk, dv, generator=gen) * 0.1
    s, outs = s0, []
    for i in range(t):
        s, out = net._rule(conv[i:i + 1], g[i:i + 1], beta[i:i + 1], s)
        outs.append(out[0])
    q, k, v = conv.split([nk * dk, nk * dk, nv * dv], dim=-1)
    want, final = ref.torch_chunk_gated_delta_rule(
        q.view(1, t, nk, dk), k.view(1, t, nk, dk), v.view(1, t, nv, dv), g=g[None],
        beta=beta[None], initial_state=s0, output_final_state=True,
        use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(torch.stack(outs), want[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(s, final, atol=1e-4, rtol=1e-4)
