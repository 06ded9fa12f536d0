"""Each step: running requests first, then waiting ones, under one token budget.

A request's work is always `num_tokens - num_computed_tokens`: one token for a decode,
the rest of the prompt for a prefill. A non-final chunk ends on a KV block boundary so
later chunks stay on the block grid. When blocks run out the newest running request is
preempted: its blocks are freed (their hashes stay cached) and it re-prefills later.

With ``split_at_prompt_end`` (set by the engine from its `BatchPolicy`) a chunk never holds
both prompt and generated tokens: the recompute of a preempted request runs its prompt, then
its generated tokens, as separate chunks.

A hybrid model's requests also hold a state slot (``state``, `met.cache.state_slots`): taken
at admission, given back at finish and preemption. A prefix hit is cut back to the last
block whose state snapshot exists, and each step asks for snapshots at the cached block
boundaries it computes through.
"""

from __future__ import annotations

from collections import deque

from met.cache.kv_manager import KVCacheManager
from met.cache.state_slots import StateSlots
from met.runner.batch_plan import ScheduledRequest, SchedulerOutput
from met.scheduler.request import Request, RequestStatus


class Scheduler:
    """Owns the waiting queue and running list; decides what each step computes."""

    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 split_at_prompt_end: bool = False, lora=None,
                 state: StateSlots | None = None):
        self.kv = kv
        # A hybrid model's state slots and snapshots; None for attention-only models.
        self.state = state
        # The engine's LoRA slots (met.lora.slots.LoRAManager: acquire(name) -> slot | None,
        # release(slot)); None without adapters.
        self.lora = lora
        self.split_at_prompt_end = split_at_prompt_end
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0  # total since start: tests and metrics read it

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._chunk_len(req, req.num_computed_tokens, budget)
            if n == 0:
                i += 1
                continue
            drafts = self._drafts(req, n, budget)
            if drafts:
                self._publish_blocks(req, req.num_computed_tokens + n)
                scheduled.append(self._item(req, n + len(drafts), drafts))
                budget -= n + len(drafts)
                i += 1
                continue
            while not self.kv.allocate(req.request_id, req.num_computed_tokens + n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                break  # req preempted itself: nothing after it is left in running
            self._publish_blocks(req, req.num_computed_tokens + n)
            scheduled.append(self._item(req, n))
            budget -= n
            i += 1

        # Admit new work only when nobody had to be evicted this step. A request whose
        # adapter finds every slot pinned by other adapters waits; those behind it may go.
        j = 0
        while (not preempted and j < len(self.waiting) and budget > 0
               and len(self.running) < self.max_num_seqs
               and (self.state is None or self.state.num_free_slots > 0)):
            req = self.waiting[j]
            if not self._pin_adapter(req):
                j += 1
                continue
            prefix = self.kv.find_prefix(req.request_id, req.all_token_ids, req.cache_extra_keys,
                                         req.num_prompt_tokens)
            pooling = req.params.pooling
            if req.params.prompt_logprobs is not None or (pooling is not None
                                                          and pooling.pooling == "mean"):
                # Every prompt position must run to give its logits (as vLLM) or to be
                # pooled (a mean needs each position's hidden state); last-token pooling
                # and scores read only the last position, which a hit never covers.
                prefix = []
            restore = -1
            if self.state is not None:
                prefix, restore = self._state_prefix(prefix)
            start = len(prefix) * self.kv.block_size
            n = self._chunk_len(req, start, budget)
            if n == 0 or not self.kv.allocate(req.request_id, start + n, prefix):
                self._unpin_adapter(req)
                break
            del self.waiting[j]
            if self.state is not None:
                req.state_slot = self.state.acquire(req.request_id)
                if restore >= 0:
                    self.state.note_restore()
            req.num_computed_tokens = start
            if req.num_cached_tokens is None:
                req.num_cached_tokens = start
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._publish_blocks(req, start + n)
            scheduled.append(self._item(req, n, restore=restore))
            budget -= n
        return SchedulerOutput(scheduled, preempted)

    def _item(self, req: Request, n: int, drafts: tuple[int, ...] = (),
              restore: int = -1) -> ScheduledRequest:
        """What the runner gets for ``req`` this step (after its blocks were published)."""
        if self.state is None:
            return ScheduledRequest(req, n, drafts)
        return ScheduledRequest(req, n, drafts, state_slot=req.state_slot,
                                state_restore=restore, state_saves=self._state_saves(req, n))

    def _state_prefix(self, prefix: list[int]) -> tuple[list[int], int]:
        """A hybrid model's prefix hit: cut back to its last block with a state snapshot
        (none: no hit, the prompt runs from the start), and the snapshot's row."""
        for k in range(len(prefix), 0, -1):
            row = self.state.restore_row(self.kv.pool.block_hash[prefix[k - 1]])
            if row is not None:
                return prefix[:k], row
        return [], -1

    def _state_saves(self, req: Request, n: int) -> tuple[tuple[int, int], ...]:
        """(tokens into this chunk, snapshot row) for each block boundary the step computes
        through whose block the prefix cache indexed and no snapshot holds yet."""
        bs, start = self.kv.block_size, req.num_computed_tokens
        saves = []
        for boundary in range((start // bs + 1) * bs, start + n + 1, bs):
            block_hash = self.kv.block_hash(req.request_id, boundary // bs - 1)
            row = None if block_hash is None else self.state.reserve(block_hash)
            if row is not None:
                saves.append((boundary - start, row))
        return tuple(saves)

    def _pin_adapter(self, req: Request) -> bool:
        """Pin the slot of ``req``'s adapter (none: True); False while none is free."""
        if req.lora_name is None or req.lora_slot >= 0:
            return True
        slot = self.lora.acquire(req.lora_name)
        if slot is None:
            return False
        req.lora_slot = slot
        return True

    def _unpin_adapter(self, req: Request) -> None:
        if req.lora_slot >= 0:
            self.lora.release(req.lora_slot)
            req.lora_slot = -1

    def _drafts(self, req: Request, n: int, budget: int) -> tuple[int, ...]:
        """The drafts this decode verifies: what the budget and free blocks allow without
        preempting anyone (speculation never evicts a request)."""
        if n != 1 or not req.spec_token_ids or req.num_computed_tokens != req.num_tokens - 1:
            return ()
        drafts = tuple(req.spec_token_ids[:budget - 1])
        if not drafts or not self.kv.allocate(req.request_id,
                                              req.num_computed_tokens + 1 + len(drafts)):
            return ()
        return drafts

    def _publish_blocks(self, req: Request, num_tokens: int) -> None:
        """Index the full blocks this step will have computed, before the step runs.

        A request admitted later in the same step can then hit them: every layer writes
        the whole batch's KV before any request attends, so n samples of one prompt (or
        any prompts sharing a prefix) submitted together compute that prefix once.
        """
        self.kv.commit(req.request_id, req.all_token_ids, num_tokens, req.cache_extra_keys,
                       req.num_prompt_tokens)

    def _chunk_len(self, req: Request, start: int, budget: int) -> int:
        end = req.num_tokens
        if self.split_at_prompt_end and start < req.num_prompt_tokens:
            end = req.num_prompt_tokens
        remaining = end - start
        if remaining <= budget:
            return remaining
        # A partial chunk stops on a block boundary; 0 if none fits in the budget.
        end = (start + budget) // self.kv.block_size * self.kv.block_size
        return max(0, end - start)

    def _preempt(self, req: Request) -> None:
        self.kv.free(req.request_id)
        self._free_state(req)
        self._unpin_adapter(req)
        req.spec_token_ids = []
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        req.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(req)

    def finish(self, req: Request, reason: str) -> None:
        """Mark finished and free its blocks at once (also used for aborts)."""
        if req.status is not RequestStatus.FINISHED and req.lora_name is not None:
            self.lora.unhold(req.lora_name)
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        self.kv.free(req.request_id)
        self._free_state(req)
        self._unpin_adapter(req)

    def _free_state(self, req: Request) -> None:
        if self.state is not None:
            self.state.free(req.request_id)
            req.state_slot = -1
