"""Batched sampler: per-row parameters become tensors, one vectorised pass per step.

Randomness comes from an exponential race (argmax of p / E, E ~ Exp(1)), which samples
exactly from p. Each seeded request draws its E from its own generator, so its tokens
never depend on its batch mates or its row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from met.scheduler.request import Request


@dataclass(frozen=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]  # per row, when the request asked for them


class Sampler:
    """Turns float32 logits [N, V] for N requests into one token each."""

    def __init__(self, seed: int = 0):
        # Unseeded requests share this engine generator (reproducible for a fixed run).
        self.generator = torch.Generator().manual_seed(seed)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SampleResult:
        logits = logits.float()
        raw_logprobs = None
        if any(r.params.logprobs is not None for r in requests):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        logits = _mask_until_min_tokens(logits, requests)

        tokens = logits.argmax(dim=-1)
        sampled_rows = [i for i, r in enumerate(requests) if not r.params.greedy]
        if sampled_rows:
            rows = torch.tensor(sampled_rows)
            sub = [requests[i] for i in sampled_rows]
            tokens[rows] = self._sample(logits[rows], sub)

        token_list = tokens.tolist()
        logprobs = [
            _logprob_entry(raw_logprobs[i], token_list[i], r.params.logprobs)
            if raw_logprobs is not None and r.params.logprobs is not None else None
            for i, r in enumerate(requests)
        ]
        return SampleResult(token_list, logprobs)

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        temps = torch.tensor([r.params.temperature for r in requests]).unsqueeze(1)
        logits = logits / temps
        logits = _apply_top_k(logits, [r.params.top_k for r in requests])
        logits = _apply_top_p(logits, [r.params.top_p for r in requests])
        probs = torch.softmax(logits, dim=-1)
        race = torch.empty_like(probs)
        for i, r in enumerate(requests):
            race[i].exponential_(generator=r.generator or self.generator)
        return (probs / race).argmax(dim=-1)


def _mask_until_min_tokens(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    for i, r in enumerate(requests):
        if r.num_output_tokens < r.params.min_tokens:
            stop_ids = set(r.params.stop_token_ids)
            if not r.params.ignore_eos:
                stop_ids |= r.eos_token_ids
            if stop_ids:
                logits[i, list(stop_ids)] = float("-inf")
    return logits


def _apply_top_k(logits: torch.Tensor, top_ks: list[int]) -> torch.Tensor:
    vocab = logits.shape[-1]
    ks = [k if 0 < k < vocab else vocab for k in top_ks]
    if all(k == vocab for k in ks):
        return logits
    k_t = torch.tensor(ks).unsqueeze(1)
    kth = logits.sort(dim=-1, descending=True).values.gather(1, k_t - 1)
    return logits.masked_fill(logits < kth, float("-inf"))


def _apply_top_p(logits: torch.Tensor, top_ps: list[float]) -> torch.Tensor:
    if all(p >= 1.0 for p in top_ps):
        return logits
    p_t = torch.tensor(top_ps).unsqueeze(1)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    # Drop a token when the mass strictly before it already reaches top_p (keeps >= 1).
    drop = (probs.cumsum(dim=-1) - probs) >= p_t
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _logprob_entry(row: torch.Tensor, token: int, top: int) -> dict[int, float]:
    entry = {token: float(row[token])}
    if top:
        values, ids = row.topk(top)
        for v, t in zip(values.tolist(), ids.tolist(), strict=True):
            entry.setdefault(t, v)
    return entry
