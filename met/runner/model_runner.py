"""ModelRunner: owns the model and its KV tensors; turns a scheduled step into logits."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from met.kernels import kv_cache
from met.layers.batch import ForwardBatch, SeqSpan, StateStep
from met.layers.mamba import MambaStateCache
from met.models.base import CausalLM
from met.runner.batch_plan import BatchPolicy, ScheduledRequest, SchedulerOutput
from met.runner.pooling import pooling_rows


@dataclass(frozen=True)
class StepLogits:
    """Float32 logits for the requests whose last scheduled token reached their end."""

    request_ids: list[str]
    logits: torch.Tensor  # [sum(num_rows), vocab]: each request's rows, in order
    # Requests that asked for prompt logprobs: request id → (first position, logits of the
    # prompt positions this step computed, each predicting the token after it).
    prompt_logits: dict[str, tuple[int, torch.Tensor]] = field(default_factory=dict)
    # Logit rows per request: 1, or 1 + its drafts when it verifies speculative tokens (row
    # j then predicts the token after draft j). Empty: one row each.
    num_rows: list[int] = field(default_factory=list)
    # Pooling requests (embeddings): request id → (first position, float32 final-norm hidden
    # rows this step computed that its pooling needs; `met.runner.pooling`).
    pooled: dict[str, tuple[int, torch.Tensor]] = field(default_factory=dict)


def kv_bytes_per_block(model: CausalLM, block_size: int, dtype: torch.dtype,
                       kv_cache_dtype: str = "auto") -> int:
    layers, kv_heads, head_dim = model.kv_layout
    return layers * block_size * kv_cache.bytes_per_token(kv_heads, head_dim, dtype,
                                                          kv_cache_dtype, model.kv_v_head_dim)


class ModelRunner:
    """Runs the model over the flat batch of one step and returns the logits to sample."""

    def __init__(self, model: CausalLM, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, kv_cache_dtype: str = "auto",
                 *, policy: BatchPolicy, attention_backend: str = "cpu-native",
                 state_rows: int = 0):
        self.model = model
        self.policy = policy  # the engine's, decided once (`BatchPolicy`)
        self.block_size = block_size
        self.device = device
        self.attention_backend = attention_backend
        # The engine's LoRA slots (met.lora.slots.LoRAManager), set after construction;
        # None: no adapters.
        self.lora = None
        self._kv_shape = (num_blocks, dtype, kv_cache_dtype)
        self.kv_caches: list[kv_cache.KVCache] = []
        # A hybrid model's recurrent state: per mixer layer, ``state_rows`` rows (state slots,
        # then prefix-cache snapshots; met.cache.state_slots numbers them).
        self._state_shape = (state_rows, dtype)
        self.state_caches: list[MambaStateCache] = []
        self.allocate_kv()

    def allocate_kv(self) -> None:
        """(Re)allocate the KV tensors, zeroed (at build, and on waking from sleep)."""
        num_blocks, dtype, kv_cache_dtype = self._kv_shape
        layers, kv_heads, head_dim = self.model.kv_layout
        # Head-major, slot-flat: one index_select per request gathers its context per head.
        self.kv_caches = [
            kv_cache.allocate(kv_heads, num_blocks * self.block_size, head_dim, dtype,
                              self.device, kv_cache_dtype, backend=self.attention_backend,
                              v_head_dim=self.model.kv_v_head_dim)
            for _ in range(layers)
        ]
        self._allocate_state()

    def _allocate_state(self) -> None:
        layout = self.model.state_layout
        rows, dtype = self._state_shape
        if layout is None:
            return
        if rows < 1:
            raise ValueError("state_rows: a hybrid model's runner needs state rows (its "
                             "engine's state slots)")
        self.state_caches = [MambaStateCache.allocate(layout, rows, dtype, self.device)
                             for _ in range(layout.num_layers)]

    def free_kv(self) -> None:
        """Drop the KV tensors (sleep): nothing may run until ``allocate_kv``."""
        self.kv_caches = []
        self.state_caches = []

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput, block_tables: dict[str, list[int]]) -> StepLogits:
        items, prompt_rows = self.policy.order(step.scheduled)
        batch, sample_rows, sample_ids, num_rows = self._build_batch(items, prompt_rows,
                                                                     block_tables)
        if self.state_caches:
            batch = replace(batch, state=self._state_step(items))
        lora = self.lora
        if lora is not None:  # each row runs its request's adapter slot (-1: none)
            lora.set_rows([item.request.lora_slot for item in items
                           for _ in range(item.num_new_tokens)], self.device)
        try:
            hidden = self.model(batch, self.kv_caches)
        finally:
            if lora is not None:
                lora.clear_rows()
        prompt_logits = self._prompt_logits(items, hidden)
        pooled = pooling_rows(items, hidden, self.model.compute_logits)
        if not sample_rows:
            return StepLogits([], torch.empty(0), prompt_logits, pooled=pooled)
        rows = torch.tensor(sample_rows, device=self.device)
        return StepLogits(sample_ids, self.model.compute_logits(hidden[rows]), prompt_logits,
                          num_rows, pooled)

    def _state_step(self, items: list[ScheduledRequest]) -> StateStep:
        """Set each request's state slot up for this step (a prefix hit restores its
        snapshot, a fresh start zeroes it) and say which boundary states to save."""
        for cache in self.state_caches:
            cache.verify.clear()  # the last step's rollback points
        for item in items:
            slot = item.state_slot
            if slot < 0:
                raise RuntimeError(f"request {item.request.request_id!r} runs on a hybrid "
                                   "model without a state slot")
            for cache in self.state_caches:
                if item.state_restore >= 0:
                    cache.copy_row(item.state_restore, slot)
                elif item.request.num_computed_tokens == 0:
                    cache.zero_row(slot)
        saves = tuple((i, offset, row) for i, item in enumerate(items)
                      for offset, row in item.state_saves)
        keep = frozenset(i for i, item in enumerate(items) if item.spec_token_ids)
        return StateStep(self.state_caches, tuple(item.state_slot for item in items), saves,
                         self.block_size, keep)

    def rollback_state(self, slot: int, num_tokens: int) -> None:
        """After a verify: the state of ``slot`` as of its first ``num_tokens`` tokens of the
        step (the target's token and the accepted drafts)."""
        for cache in self.state_caches:
            cache.rollback(slot, num_tokens)

    def _prompt_logits(self, items: list[ScheduledRequest],
                       hidden: torch.Tensor) -> dict[str, tuple[int, torch.Tensor]]:
        """All-row logits, only for requests that asked for prompt logprobs: those of the
        prompt positions 0..P-2 this step computed (the last prompt position's logits are
        the usual sampled row)."""
        out: dict[str, tuple[int, torch.Tensor]] = {}
        q_start = 0
        for item in items:
            req, n = item.request, item.num_new_tokens
            start = req.num_computed_tokens
            stop = min(start + n, req.num_prompt_tokens - 1)
            if req.params.prompt_logprobs is not None and start < stop:
                rows = hidden[q_start:q_start + stop - start]
                out[req.request_id] = (start, self.model.compute_logits(rows))
            q_start += n
        return out

    def _build_batch(
        self, items: list[ScheduledRequest], prompt_rows: int,
        block_tables: dict[str, list[int]]
    ) -> tuple[ForwardBatch, list[int], list[str], list[int]]:
        ids: list[int] = []
        positions: list[int] = []
        sample_rows: list[int] = []
        sample_ids: list[str] = []
        num_rows: list[int] = []
        apart: list[bool] = []
        # per request: row, start, end, blocks, prompt length
        bounds: list[tuple[int, int, int, int, int]] = []
        blocks: list[int] = []  # every request's context blocks, one after another
        for item in items:
            req, n = item.request, item.num_new_tokens
            start = req.num_computed_tokens
            end = start + n
            q_start = len(ids)
            drafts = item.spec_token_ids
            ids.extend(req.all_token_ids[start:end - len(drafts)])
            ids.extend(drafts)
            positions.extend(range(start, end))
            table = block_tables[req.request_id][: -(-end // self.block_size)]
            bounds.append((q_start, start, end, len(table), req.num_prompt_tokens))
            apart.append(bool(drafts))
            blocks.extend(table)
            # Caught up: the next token('s checks); a pooling request samples none.
            if end == req.num_tokens + len(drafts) and req.params.pooling is None:
                first = q_start + n - 1 - len(drafts)
                sample_rows.extend(range(first, q_start + n))
                sample_ids.append(req.request_id)
                num_rows.append(1 + len(drafts))
        # Every request's context slots as views into one tensor: two tensor ops per step
        # instead of two per request (per-request ops dominated wide decode steps).
        bs = self.block_size
        all_slots = (torch.tensor(blocks, dtype=torch.long)[:, None] * bs
                     + torch.arange(bs)).flatten().to(self.device)
        spans: list[SeqSpan] = []
        new_slots: list[torch.Tensor] = []
        first = 0
        for (q_start, start, end, num_blocks, prompt_len), rows_apart in zip(bounds, apart,
                                                                            strict=True):
            ctx_slots = all_slots[first:first + end]
            first += num_blocks * bs
            new_slots.append(ctx_slots[start:end])
            spans.append(SeqSpan(q_start, end - start, end, ctx_slots, rows_apart, prompt_len))
        dev = self.device
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            slot_mapping=torch.cat(new_slots),
            seqs=tuple(spans),
            row_attention=self.model.row_attention,
            prompt_rows=prompt_rows,
        )
        return batch, sample_rows, sample_ids, num_rows
