"""The flat batch one engine step hands to the model."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SeqSpan:
    """One request's slice of the flat batch.

    Its query tokens are rows [q_start, q_start + q_len) of the batch; they are the last
    q_len of a context of ctx_len tokens whose KV sits at the cache slots ctx_slots.
    """

    q_start: int
    q_len: int
    ctx_len: int
    ctx_slots: torch.Tensor  # long [ctx_len]: flat KV slot of every context position


@dataclass(frozen=True)
class ForwardBatch:
    """All tokens of one step, from every scheduled request, as one flat tensor.

    Everything here is computed once per step and shared by all layers; the per-window
    attention masks are memoised on first use for the same reason.
    """

    input_ids: torch.Tensor  # long [T]
    positions: torch.Tensor  # long [T]
    slot_mapping: torch.Tensor  # long [T]: flat KV slot (block * block_size + offset) per token
    seqs: tuple[SeqSpan, ...]
    _window_plans: dict = field(default_factory=dict, compare=False, repr=False)

    def window_plan(self, window: int | None) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Per sequence: the KV slots its queries may see and the boolean mask (None = all).

        Keys older than the window of the first query are dropped from the slots outright.
        """
        plan = self._window_plans.get(window)
        if plan is None:
            plan = [_span_plan(span, window) for span in self.seqs]
            self._window_plans[window] = plan
        return plan


def _span_plan(span: SeqSpan, window: int | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    first_q = span.ctx_len - span.q_len
    k_start = 0 if window is None else max(0, first_q - window + 1)
    slots = span.ctx_slots[k_start:] if k_start else span.ctx_slots
    if span.q_len == 1 and (window is None or span.ctx_len - k_start <= window):
        return slots, None  # one query that sees every kept key: no mask needed
    dev = span.ctx_slots.device
    q_pos = torch.arange(first_q, span.ctx_len, device=dev)[:, None]
    k_pos = torch.arange(k_start, span.ctx_len, device=dev)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= (q_pos - k_pos) < window
    return slots, mask
