"""A model that drafts: a smaller checkpoint with the target's tokenizer (method
"draft_model"), or the target's own first layers and LM head (method "self"). It runs greedy
on its own small paged KV cache, one batched forward per drafted position; what it computed
for tokens the target then accepted is kept, the rest rolled back."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from met.cache.kv_manager import KVCacheManager
from met.models.base import CausalLM
from met.runner.batch_plan import BatchPolicy, ScheduledRequest, SchedulerOutput
from met.runner.model_runner import ModelRunner
from met.sampling.params import SamplingParams

_PARAMS = SamplingParams()  # the runner reads prompt_logprobs (None) of it
_CATCH_UP_TOKENS = 2048  # tokens per catch-up forward at most (a long prompt is chunked)


@dataclass
class _Seq:
    """One request as the drafter sees it (a `StepRequest` for the runner)."""

    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int = 0
    num_prompt_tokens: int = 0  # every row runs as a generated one
    params: SamplingParams = field(default=_PARAMS)
    target_len: int = 0  # all_token_ids[:target_len] came from the target

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


class ModelDrafter:
    """A `Proposer` over a draft model (``propose_batch`` drafts for many requests in one
    forward per position)."""

    def __init__(self, name: str, model: CausalLM, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, kv_cache_dtype: str,
                 attention_backend: str):
        self.name = name
        self.model = model
        self.runner = ModelRunner(model, num_blocks, block_size, dtype, device,
                                  kv_cache_dtype, policy=BatchPolicy(),
                                  attention_backend=attention_backend)
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
        self._seqs: dict[str, _Seq] = {}

    def propose(self, request_id: str, tokens: Sequence[int], k: int) -> list[int]:
        return self.propose_batch([(request_id, tokens, k)]).get(request_id, [])

    def finished(self, request_id: str, tokens: Sequence[int]) -> None:
        if self._seqs.pop(request_id, None) is not None:
            self.kv.free(request_id)

    @torch.inference_mode()
    def propose_batch(self, items: Sequence[tuple[str, Sequence[int], int]]
                      ) -> dict[str, list[int]]:
        """Up to k greedy drafts per (request id, its tokens, k)."""
        seqs: list[tuple[_Seq, int]] = []
        for rid, tokens, k in items:
            seq = self._sync(rid, tokens)
            # KV for every target token and all drafts but the last (never fed back).
            if seq is not None and self.kv.allocate(rid, len(tokens) + k - 1):
                seqs.append((seq, k))
            elif seq is not None:
                self.finished(rid, tokens)  # no room in the draft cache: no drafts this time
        if not seqs:
            return {}
        self._catch_up([s for s, _ in seqs])
        for r in range(1, max(k for _, k in seqs)):
            self._forward([s for s, k in seqs if k > r])
        return {s.request_id: s.all_token_ids[s.target_len:] for s, _ in seqs}

    def _sync(self, rid: str, tokens: Sequence[int]) -> _Seq | None:
        """The request's draft state matched to the target's tokens now: KV of the drafts
        the target accepted is kept, the rest rolled back."""
        seq = self._seqs.get(rid)
        if seq is None:
            seq = self._seqs[rid] = _Seq(rid, list(tokens))
        else:
            keep = min(seq.num_computed_tokens, len(tokens))
            old = seq.all_token_ids
            common = seq.target_len
            while common < keep and old[common] == tokens[common]:
                common += 1
            # At least the last token runs again: its logits give the first draft.
            seq.num_computed_tokens = min(keep, common, len(tokens) - 1)
            seq.all_token_ids = list(tokens)
            self.kv.truncate(rid, seq.num_computed_tokens)
        seq.target_len = len(tokens)
        return seq

    def _catch_up(self, seqs: list[_Seq]) -> None:
        """Feed each request the target tokens its draft cache lacks; the last chunk's
        logits give the first draft."""
        pending = list(seqs)
        while pending:
            budget = _CATCH_UP_TOKENS
            step: list[_Seq] = []
            sizes: dict[str, int] = {}
            for seq in pending:
                if budget == 0:
                    break
                n = min(seq.target_len - seq.num_computed_tokens, budget)
                sizes[seq.request_id] = n
                step.append(seq)
                budget -= n
            self._forward(step, sizes)
            pending = [s for s in pending if s.num_computed_tokens < s.target_len]

    def _forward(self, seqs: list[_Seq], sizes: dict[str, int] | None = None) -> None:
        """One draft forward: ``sizes[request id]`` new tokens each (None: one); a request
        whose last token ran gets its greedy next token appended."""
        scheduled = [ScheduledRequest(s, sizes[s.request_id] if sizes else 1) for s in seqs]
        tables = {s.request_id: self.kv.block_table(s.request_id) for s in seqs}
        out = self.runner.execute(SchedulerOutput(scheduled, ()), tables)
        by_id = {s.request_id: s for s in seqs}
        for item in scheduled:
            item.request.num_computed_tokens += item.num_new_tokens
        if out.request_ids:
            for rid, token in zip(out.request_ids, out.logits.argmax(dim=-1).tolist(),
                                  strict=True):
                by_id[rid].all_token_ids.append(token)
