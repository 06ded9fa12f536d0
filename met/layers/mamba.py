"""The Mamba-2 mixer (selective state space, SSD form) over a flat batch with state slots.

A mixer layer keeps, per request, two pieces of recurrent state in rows of its
`MambaStateCache` (the request's state slot, `StateStep.slots`):

- conv: the last ``kernel - 1`` inputs of the causal depthwise convolution [C, K-1];
- ssm: the recurrent state h [H, P, N] (float32).

A prompt chunk runs the chunked SSD scan from its slot's state; a decode row runs one step
of the recurrence, all decode rows at once. The scan's chunks sit on the absolute positions'
grid of ``StateStep.chunk`` (the KV block size), so the state at every block boundary of a
chunk is a by-product: `StateStep.saves` copies the requested ones into snapshot rows (the
prefix cache's state at that block, `met.cache.state_slots`). A speculative verify chunk
(`StateStep.keep`) runs the scan one token per chunk and keeps the state after each of its
tokens, so the engine can roll the slot back to the last accepted draft (`rollback`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from met.layers.activations import get_activation
from met.layers.batch import ForwardBatch, StateStep
from met.layers.linear import Linear


@dataclass(frozen=True)
class MambaLayout:
    """What the runner needs to allocate one mixer layer's state rows."""

    num_layers: int  # mixer layers in the model
    conv_dim: int  # channels of the convolution (x, B and C side by side)
    conv_len: int  # kernel - 1 inputs kept
    num_heads: int
    head_dim: int
    state_size: int


@dataclass
class MambaStateCache:
    """One mixer layer's state, one row per state slot or snapshot."""

    conv: torch.Tensor  # [rows, conv_dim, conv_len], the activation dtype
    ssm: torch.Tensor  # [rows, num_heads, head_dim, state_size], float32
    # This step's verify chunks: slot → (conv, ssm) state after each of their tokens.
    verify: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @staticmethod
    def allocate(layout: MambaLayout, rows: int, dtype: torch.dtype,
                 device: torch.device) -> MambaStateCache:
        return MambaStateCache(
            conv=torch.zeros(rows, layout.conv_dim, layout.conv_len, dtype=dtype, device=device),
            ssm=torch.zeros(rows, layout.num_heads, layout.head_dim, layout.state_size,
                            dtype=torch.float32, device=device))

    def copy_row(self, src: int, dst: int) -> None:
        self.conv[dst] = self.conv[src]
        self.ssm[dst] = self.ssm[src]

    def zero_row(self, row: int) -> None:
        self.conv[row].zero_()
        self.ssm[row].zero_()

    def rollback(self, slot: int, num_tokens: int) -> None:
        """Make ``slot`` hold its state after the first ``num_tokens`` tokens of this step's
        verify chunk (the rest were rejected drafts)."""
        conv, ssm = self.verify[slot]
        self.conv[slot] = conv[num_tokens - 1]
        self.ssm[slot] = ssm[num_tokens - 1]

    def nbytes(self) -> int:
        return (self.conv.numel() * self.conv.element_size()
                + self.ssm.numel() * self.ssm.element_size())


class DepthwiseConv(nn.Module):
    """The causal depthwise convolution's weights (Hugging Face's nn.Conv1d names)."""

    def __init__(self, channels: int, kernel: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel, dtype=dtype), False)
        self.bias = nn.Parameter(torch.empty(channels, dtype=dtype), False) if bias else None


class GatedRMSNorm(nn.Module):
    """RMSNorm of y * silu(gate) per group of ``group_size`` channels, in float32."""

    def __init__(self, dim: int, group_size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype), False)
        self.group_size = group_size
        self.eps = eps

    def forward(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        in_dtype = y.dtype
        h = y.float() * F.silu(gate.float())
        g = h.view(*h.shape[:-1], -1, self.group_size)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * g.view(h.shape).to(in_dtype)


class Mamba2Mixer(nn.Module):
    """in_proj → (gate | x B C | dt) → causal conv + act → SSD scan (+ D skip) → gated
    RMSNorm → out_proj. Hugging Face parameter names (BambaMixer / Mamba2Mixer)."""

    def __init__(self, config: Any, dtype: torch.dtype):
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.mamba_n_heads
        self.head_dim = config.mamba_d_head
        self.n_groups = config.mamba_n_groups
        self.state_size = config.mamba_d_state
        self.kernel = config.mamba_d_conv
        self.inner = int(config.mamba_expand * hidden)
        if self.num_heads * self.head_dim != self.inner:
            raise ValueError(f"mamba_d_head: {self.num_heads} heads x {self.head_dim} must "
                             f"equal mamba_expand x hidden_size = {self.inner}")
        if self.num_heads % self.n_groups:
            raise ValueError(f"mamba_n_groups: {self.n_groups} must divide mamba_n_heads "
                             f"({self.num_heads})")
        self.conv_dim = self.inner + 2 * self.n_groups * self.state_size
        bias = bool(config.mamba_proj_bias)
        self.in_proj = Linear(hidden, self.inner + self.conv_dim + self.num_heads, bias, dtype)
        self.conv1d = DepthwiseConv(self.conv_dim, self.kernel, bool(config.mamba_conv_bias),
                                    dtype)
        self.dt_bias = nn.Parameter(torch.empty(self.num_heads, dtype=dtype), False)
        self.A_log = nn.Parameter(torch.empty(self.num_heads, dtype=dtype), False)
        self.D = nn.Parameter(torch.empty(self.num_heads, dtype=dtype), False)
        self.norm = GatedRMSNorm(self.inner, self.inner // self.n_groups, config.rms_norm_eps,
                                 dtype)
        self.out_proj = Linear(self.inner, hidden, bias, dtype)
        self.act = get_activation(config.hidden_act)
        limit = getattr(config, "time_step_limit", None) or (0.0, float("inf"))
        self.dt_limit = (float(limit[0]), float(limit[1]))

    def layout(self, num_layers: int) -> MambaLayout:
        return MambaLayout(num_layers, self.conv_dim, self.kernel - 1, self.num_heads,
                           self.head_dim, self.state_size)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: MambaStateCache
                ) -> torch.Tensor:
        step = batch.state
        if step is None:
            raise RuntimeError("a Mamba-2 layer needs the step's state slots (ForwardBatch"
                               ".state), which only a hybrid model's runner provides")
        proj = self.in_proj(x)
        gate, xbc, dt = proj.split([self.inner, self.conv_dim, self.num_heads], dim=-1)
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(*self.dt_limit)
        y = torch.empty(x.shape[0], self.inner, dtype=torch.float32, device=x.device)
        saves = step.saves_by_seq()
        decodes = [i for i, s in enumerate(batch.seqs) if s.q_len == 1 and i not in saves]
        if decodes:
            self._decode(xbc, dt, y, batch, step, decodes, cache)
        for i, span in enumerate(batch.seqs):
            if span.q_len == 1 and i not in saves:
                continue
            rows = slice(span.q_start, span.q_start + span.q_len)
            keep = i in step.keep
            y[rows] = self._prefill(xbc[rows], dt[rows], span.ctx_len - span.q_len,
                                    step.slots[i], saves.get(i, ()),
                                    1 if keep else step.chunk, cache, keep)
        return self.out_proj(self.norm(y, gate).to(x.dtype))

    def _split(self, xbc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Post-conv channels → x [T, H, P] and B, C [T, H, N] (groups repeated per head),
        all float32."""
        t, g, n = xbc.shape[0], self.n_groups, self.state_size
        xs, b, c = xbc.float().split([self.inner, g * n, g * n], dim=-1)
        rep = self.num_heads // g
        b = b.view(t, g, n).repeat_interleave(rep, dim=1)
        c = c.view(t, g, n).repeat_interleave(rep, dim=1)
        return xs.reshape(t, self.num_heads, self.head_dim), b, c

    def _decode(self, xbc: torch.Tensor, dt: torch.Tensor, y: torch.Tensor,
                batch: ForwardBatch, step: StateStep, seq_ids: list[int],
                cache: MambaStateCache) -> None:
        """One recurrence step for every single-token sequence at once."""
        rows = torch.tensor([batch.seqs[i].q_start for i in seq_ids], device=xbc.device)
        slots = torch.tensor([step.slots[i] for i in seq_ids], device=xbc.device)
        window = torch.cat([cache.conv[slots], xbc[rows].to(cache.conv.dtype)[:, :, None]],
                           dim=-1)  # [B, C, K]
        cache.conv[slots] = window[:, :, 1:]
        w = self.conv1d.weight[:, 0, :]
        conv = (window * w).sum(-1)
        if self.conv1d.bias is not None:
            conv = conv + self.conv1d.bias
        xs, b, c = self._split(self.act(conv))
        a = -torch.exp(self.A_log.float())
        d = dt[rows]  # [B, H]
        h = cache.ssm[slots] * torch.exp(d * a)[:, :, None, None]
        h = h + (d[:, :, None] * xs)[..., None] * b[:, :, None, :]
        cache.ssm[slots] = h
        out = (h * c[:, :, None, :]).sum(-1) + self.D.float()[:, None] * xs
        y[rows] = out.reshape(len(seq_ids), self.inner)

    def _prefill(self, xbc: torch.Tensor, dt: torch.Tensor, start: int, slot: int,
                 saves: tuple[tuple[int, int], ...], chunk: int, cache: MambaStateCache,
                 keep: bool = False) -> torch.Tensor:
        """One sequence's ``L`` new tokens from absolute position ``start``: conv, then the
        chunked scan from the slot's state; the slot ends holding the state after them.
        ``saves``: (tokens into this chunk, snapshot row) at chunk boundaries. ``keep``
        (chunk 1): keep the state after each token in ``cache.verify``."""
        length = xbc.shape[0]
        window = torch.cat([cache.conv[slot], xbc.t().to(cache.conv.dtype)], dim=-1)
        k = self.kernel - 1
        for offset, row in saves:
            cache.conv[row] = window[:, offset:offset + k]
        cache.conv[slot] = window[:, -k:]
        conv = F.conv1d(window[None], self.conv1d.weight, self.conv1d.bias,
                        groups=self.conv_dim)[0].t()  # [L, C]
        xs, b, c = self._split(self.act(conv))
        a = -torch.exp(self.A_log.float())
        out, states = ssd_scan(xs, dt, a, b, c, cache.ssm[slot], start % chunk, chunk)
        cache.ssm[slot] = states[-1]
        if keep:
            convs = window.unfold(1, k, 1)[:, 1:].permute(1, 0, 2)  # [L, C, K-1]
            cache.verify[slot] = (convs.clone(), states[1:].clone())
        lead = start % chunk
        for offset, row in saves:
            cache.ssm[row] = states[(lead + offset) // chunk]
        out = out + self.D.float()[:, None] * xs
        return out.reshape(length, self.inner)


def ssd_scan(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             c: torch.Tensor, h0: torch.Tensor, lead: int, chunk: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """The state space dual form of h_t = exp(dt_t a) h_{t-1} + dt_t x_t b_t, y_t = c_t · h_t.

    x [L, H, P], dt [L, H], a [H], b and c [L, H, N], h0 [H, P, N], all float32. The tokens
    are laid on chunks of ``chunk`` positions, the first chunk starting ``lead`` positions
    early (padding with dt = 0 leaves the state unchanged): within a chunk the output is a
    masked quadratic form, across chunks the state is carried. Returns y [L, H, P] (without
    the D skip) and the state at every chunk boundary [n_chunks + 1, H, P, N]: states[0] is
    h0, states[j] the state after the tokens before padded position j * chunk.
    """
    length, heads, p = x.shape
    n = b.shape[-1]
    total = -(-(lead + length) // chunk) * chunk
    tail = total - lead - length

    def pad(t: torch.Tensor) -> torch.Tensor:
        return F.pad(t, (0, 0) * (t.dim() - 1) + (lead, tail))

    xdt = pad(x * dt[..., None]).view(-1, chunk, heads, p)
    bb, cc = pad(b).view(-1, chunk, heads, n), pad(c).view(-1, chunk, heads, n)
    da = pad(dt * a).view(-1, chunk, heads)  # [Z, l, H]
    cum = torch.cumsum(da, dim=1)
    # decay[z, i, j, h] = exp(sum of da over (j, i]) for j <= i: positions i and j of chunk z.
    diff = cum[:, :, None, :] - cum[:, None, :, :]
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=x.device).tril()
    decay = torch.exp(diff.masked_fill(~causal[None, :, :, None], float("-inf")))
    scores = torch.einsum("zihn,zjhn->zijh", cc, bb) * decay
    y = torch.einsum("zijh,zjhp->zihp", scores, xdt)
    # Each chunk's own contribution to the state at its end, from a zero start.
    to_end = torch.exp(cum[:, -1:, :] - cum)  # [Z, l, H]
    local = torch.einsum("zjhn,zjh,zjhp->zhpn", bb, to_end, xdt)
    chunk_decay = torch.exp(cum[:, -1, :])  # [Z, H]
    states = [h0.float().clone()]  # h0 is the slot's row, rewritten after
    for z in range(local.shape[0]):
        states.append(states[-1] * chunk_decay[z][:, None, None] + local[z])
    starts = torch.stack(states[:-1])  # [Z, H, P, N]: the state entering each chunk
    y = y + torch.einsum("zihn,zhpn->zihp", cc, starts) * torch.exp(cum)[..., None]
    y = y.reshape(total, heads, p)[lead:lead + length]
    return y, torch.stack(states)
