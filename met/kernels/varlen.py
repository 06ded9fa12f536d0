"""A step's sequences as flat varlen metadata, and the plain-PyTorch varlen attention that the
Triton kernels (met.kernels.triton.attention) are tested against.

Sequence i has q_len[i] query rows starting at row q_start[i] of the step; they are the last
q_len[i] positions of a context of ctx_len[i] tokens, whose KV slots are
``slots[slot_start[i] : slot_start[i] + ctx_len[i]]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class VarlenMeta:
    q_start: torch.Tensor  # int32 [N]
    q_len: torch.Tensor  # int32 [N]
    ctx_len: torch.Tensor  # int32 [N]
    slot_start: torch.Tensor  # int32 [N]
    slots: torch.Tensor  # int64: every sequence's context slots
    q_lens: tuple[int, ...]  # q_len on the host (for the launch grid)
    _tiles: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_seqs(self) -> int:
        return len(self.q_lens)

    @property
    def max_q_len(self) -> int:
        return max(self.q_lens, default=0)

    @classmethod
    def build(cls, spans: list[tuple[int, int, int, torch.Tensor]],
              device: torch.device | str) -> VarlenMeta:
        """From (q_start, q_len, ctx_len, ctx_slots) per sequence."""
        starts, acc = [], 0
        for _, _, ctx, _ in spans:
            starts.append(acc)
            acc += ctx

        def col(i):
            return torch.tensor([s[i] for s in spans], dtype=torch.int32, device=device)

        slots = (torch.cat([s[3] for s in spans]) if spans
                 else torch.empty(0, dtype=torch.long, device=device))
        return cls(col(0), col(1), col(2),
                   torch.tensor(starts, dtype=torch.int32, device=device),
                   slots.to(device=device, dtype=torch.long), tuple(s[1] for s in spans))

    def tiles(self, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(sequence, first query row) of every block_m-row tile of every sequence."""
        got = self._tiles.get(block_m)
        if got is None:
            seq, m0 = [], []
            for i, n in enumerate(self.q_lens):
                for start in range(0, n, block_m):
                    seq.append(i)
                    m0.append(start)
            dev = self.q_start.device
            got = self._tiles[block_m] = (torch.tensor(seq, dtype=torch.int32, device=dev),
                                          torch.tensor(m0, dtype=torch.int32, device=dev))
        return got


def dequantize(cache: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype
               ) -> torch.Tensor:
    if scale is None:
        return cache.to(dtype)
    return (cache.float() * scale.unsqueeze(-1)).to(dtype)


def attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                        meta: VarlenMeta, scale: float, window: int | None = None,
                        softcap: float | None = None, sinks: torch.Tensor | None = None
                        ) -> torch.Tensor:
    """What the Triton kernel computes, in float32 PyTorch ops, one sequence at a time.

    ``sinks`` [H] (gpt-oss): a learned logit per head that joins every row's softmax
    denominator and attends to nothing (the row's weights then sum to less than one)."""
    out = torch.zeros_like(q)
    group = q.shape[1] // k_cache.shape[0]
    for i, n in enumerate(meta.q_lens):
        qs, ctx, s0 = int(meta.q_start[i]), int(meta.ctx_len[i]), int(meta.slot_start[i])
        slots = meta.slots[s0:s0 + ctx]
        k = dequantize(k_cache[:, slots], None if k_scale is None else k_scale[:, slots],
                       torch.float32).repeat_interleave(group, 0)
        v = dequantize(v_cache[:, slots], None if v_scale is None else v_scale[:, slots],
                       torch.float32).repeat_interleave(group, 0)
        qq = q[qs:qs + n].float().transpose(0, 1)  # [H, n, D]
        s = qq @ k.transpose(1, 2) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        pos = torch.arange(ctx - n, ctx)[:, None]
        key = torch.arange(ctx)[None, :]
        mask = key <= pos
        if window:
            mask &= pos - key < window
        s = s.masked_fill(~mask.to(s.device), -math.inf)
        if sinks is None:
            p = torch.softmax(s, -1)
        else:
            sink = sinks.float().view(-1, 1, 1).expand(-1, n, 1)
            p = torch.softmax(torch.cat([s, sink], -1), -1)[..., :-1]
        out[qs:qs + n] = (p @ v).transpose(0, 1).to(q.dtype)
    return out
