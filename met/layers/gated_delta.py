"""The gated delta-net mixer (Qwen3-Next's linear attention) over a flat batch with state
slots, on the same state rows as the Mamba-2 mixer (`met.layers.mamba.MambaStateCache`):

- conv: the last ``kernel - 1`` inputs of the causal depthwise convolution over q | k | v;
- ssm: the delta-rule memory S [value heads, key dim, value dim] (float32).

Each token decays S by exp(g), writes the correction beta (v - S^T k) along k, and reads
S^T q. The rule runs token by token (decode rows all at once): the state after every token
is at hand, so block-boundary snapshots (`StateStep.saves`) and speculative rollback
points (`StateStep.keep`) cost a copy each.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from met.layers.activations import get_activation
from met.layers.batch import ForwardBatch
from met.layers.linear import Linear
from met.layers.mamba import DepthwiseConv, MambaLayout, MambaStateCache


class HeadGatedRMSNorm(nn.Module):
    """RMSNorm over each head's value channels, times weight, then times silu(gate)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype), False)
        self.eps = eps

    def forward(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        in_dtype = y.dtype
        h = y.float()
        h = self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(in_dtype)
        return (h * F.silu(gate.float())).to(in_dtype)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


class GatedDeltaNet(nn.Module):
    """in_proj_qkvz / in_proj_ba → causal conv + act over q | k | v → gated delta rule →
    per-head gated RMSNorm → out_proj. Hugging Face names (Qwen3NextGatedDeltaNet)."""

    def __init__(self, config: Any, dtype: torch.dtype):
        super().__init__()
        hidden = config.hidden_size
        self.nv, self.nk = config.linear_num_value_heads, config.linear_num_key_heads
        self.dk, self.dv = config.linear_key_head_dim, config.linear_value_head_dim
        if self.nv % self.nk:
            raise ValueError(f"linear_num_key_heads: {self.nk} must divide "
                             f"linear_num_value_heads ({self.nv})")
        self.key_dim, self.value_dim = self.nk * self.dk, self.nv * self.dv
        self.kernel = config.linear_conv_kernel_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.in_proj_qkvz = Linear(hidden, 2 * self.key_dim + 2 * self.value_dim, False, dtype)
        self.in_proj_ba = Linear(hidden, 2 * self.nv, False, dtype)
        self.conv1d = DepthwiseConv(self.conv_dim, self.kernel, False, dtype)
        self.dt_bias = nn.Parameter(torch.empty(self.nv, dtype=dtype), False)
        self.A_log = nn.Parameter(torch.empty(self.nv, dtype=dtype), False)
        self.norm = HeadGatedRMSNorm(self.dv, config.rms_norm_eps, dtype)
        self.out_proj = Linear(self.value_dim, hidden, False, dtype)
        self.act = get_activation(config.hidden_act)

    def layout(self, num_layers: int) -> MambaLayout:
        return MambaLayout(num_layers, self.conv_dim, self.kernel - 1, self.nv, self.dk,
                           self.dv)

    def _project(self, x: torch.Tensor):
        """The projections in the checkpoint's per-key-head interleaved layout → conv input
        q | k | v [T, conv_dim], z [T, nv, dv], b and a [T, nv]."""
        t, r = x.shape[0], self.nv // self.nk
        qkvz = self.in_proj_qkvz(x).view(t, self.nk, 2 * self.dk + 2 * r * self.dv)
        q, k, v, z = qkvz.split([self.dk, self.dk, r * self.dv, r * self.dv], dim=-1)
        b, a = self.in_proj_ba(x).view(t, self.nk, 2 * r).split([r, r], dim=-1)
        mixed = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        return mixed, z.reshape(t, self.nv, self.dv), b.reshape(t, self.nv), a.reshape(t, self.nv)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: MambaStateCache
                ) -> torch.Tensor:
        step = batch.state
        if step is None:
            raise RuntimeError("a gated delta-net layer needs the step's state slots "
                               "(ForwardBatch.state), which only a hybrid model's runner "
                               "provides")
        mixed, z, b, a = self._project(x)
        beta = torch.sigmoid(b.float())
        g = -torch.exp(self.A_log.float()) * F.softplus(a.float() + self.dt_bias.float())
        y = torch.empty(x.shape[0], self.nv, self.dv, dtype=torch.float32, device=x.device)
        saves = step.saves_by_seq()
        singles = [i for i, s in enumerate(batch.seqs) if s.q_len == 1 and i not in saves]
        if singles:
            rows = torch.tensor([batch.seqs[i].q_start for i in singles], device=x.device)
            slots = torch.tensor([step.slots[i] for i in singles], device=x.device)
            window = torch.cat([cache.conv[slots], mixed[rows].to(cache.conv.dtype)[:, :, None]],
                               dim=-1)
            cache.conv[slots] = window[:, :, 1:]
            conv = self.act((window * self.conv1d.weight[:, 0, :]).sum(-1))
            s, out = self._rule(conv, g[rows], beta[rows], cache.ssm[slots])
            cache.ssm[slots] = s
            y[rows] = out
        for i, span in enumerate(batch.seqs):
            if span.q_len == 1 and i not in saves:
                continue
            rows = slice(span.q_start, span.q_start + span.q_len)
            y[rows] = self._sequence(mixed[rows], g[rows], beta[rows], step.slots[i],
                                     saves.get(i, ()), i in step.keep, cache)
        out = self.norm(y.to(x.dtype), z)
        return self.out_proj(out.reshape(x.shape[0], self.value_dim))

    def _rule(self, conv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, s: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """One delta-rule step for B rows at once: post-conv q | k | v [B, conv_dim], g and
        beta [B, nv], memories s [B, nv, dk, dv] → new memories, outputs [B, nv, dv]."""
        n, r = conv.shape[0], self.nv // self.nk
        q, k, v = conv.float().split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = _l2norm(q.view(n, self.nk, self.dk)).repeat_interleave(r, dim=1) * self.dk**-0.5
        k = _l2norm(k.view(n, self.nk, self.dk)).repeat_interleave(r, dim=1)
        v = v.view(n, self.nv, self.dv)
        s = s * torch.exp(g)[:, :, None, None]
        delta = (v - (s * k[..., None]).sum(-2)) * beta[..., None]
        s = s + k[..., None] * delta[:, :, None, :]
        return s, (s * q[..., None]).sum(-2)

    def _sequence(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, slot: int,
                  saves: tuple[tuple[int, int], ...], keep: bool, cache: MambaStateCache
                  ) -> torch.Tensor:
        """One sequence's new tokens from its slot's state, token by token; ``saves`` copy
        the state after that many tokens into snapshot rows, ``keep`` keeps every one."""
        length, k = mixed.shape[0], self.kernel - 1
        window = torch.cat([cache.conv[slot], mixed.t().to(cache.conv.dtype)], dim=-1)
        conv = self.act(F.conv1d(window[None], self.conv1d.weight, None,
                                 groups=self.conv_dim)[0].t())
        s = cache.ssm[slot][None].float()
        outs, states = [], []
        for t in range(length):
            s, out = self._rule(conv[t:t + 1], g[t:t + 1], beta[t:t + 1], s)
            outs.append(out[0])
            states.append(s[0])
        for offset, row in saves:
            cache.conv[row] = window[:, offset:offset + k]
            cache.ssm[row] = states[offset - 1]
        if keep:
            cache.verify[slot] = (window.unfold(1, k, 1)[:, 1:].permute(1, 0, 2).clone(),
                                  torch.stack(states))
        cache.conv[slot] = window[:, -k:]
        cache.ssm[slot] = states[-1]
        return torch.stack(outs)
