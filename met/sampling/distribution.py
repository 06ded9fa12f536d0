"""The distribution a sampled row draws from and the draw itself: top-n-σ → temperature →
top-k → min-p → softmax → top-p (`sampling_candidates`), then one uniform per row through
the inverse CDF (`inverse_cdf_draw`).

Cost on a CPU matters at every step: a 49k-token vocabulary, 64 rows. An exponential race
(one Exp(1) draw per token) took ~1 ms a row and a full sort for top-k / top-p ~2 ms a row;
here top-k takes the k largest logits (torch.topk) and the steps after it read only those;
top-p's cut comes from one pass and a select, applied in place (sampler_ops.top_p_cut_); the
draw sums blocks of the row before it sums tokens; every step edits one working copy in place.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from met.kernels import sampler_ops
from met.sampling.params import SamplingParams

_NEG_INF = float("-inf")
_TOP_P_FIRST = 64  # tokens top-p looks at first (more only if their mass falls short)
_DRAW_BLOCK = 256  # tokens per block of the inverse-CDF draw's first search

def sampling_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution sampled rows draw from: top-n-σ → temperature → top-k → min-p →
    softmax → top-p (renormalized), over the whole vocabulary."""
    probs, tokens, _ = sampling_candidates(logits, params)
    return probs if tokens is None else torch.zeros_like(logits).scatter_(1, tokens, probs)


def sampling_candidates(logits: torch.Tensor, params: list[SamplingParams]
                        ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """`sampling_probs`' distribution, and None; or, when every row has top-k set, only over
    each row's candidates: probabilities [N, K] and their token ids [N, K] (K the largest
    top_k), so the steps after top-k read K values a row instead of the vocabulary. Third:
    which rows' k-th logit ties the next one (those keep every tied token, so the rows stay
    whole), or None where some row has no top-k."""
    temps = [p.temperature for p in params]
    sigmas = [p.top_n_sigma for p in params]
    scaled = any(t != 1.0 for t in temps)
    temps_t = torch.tensor(temps, device=logits.device).unsqueeze(1) if scaled else None
    # One working copy of the logits, which every step below edits in place.
    if scaled and all(n <= 0 for n in sigmas):
        # Into a fresh tensor: `logits / temps_t` (a [N, 1] divisor) takes a much slower
        # broadcasting kernel.
        work = torch.div(logits, temps_t, out=torch.empty_like(logits))
    else:
        work = _apply_top_n_sigma(logits.clone(), sigmas)
        if scaled:
            work.div_(temps_t)
    work, tokens, tied = _apply_top_k(work, [p.top_k for p in params])
    work.sub_(work.amax(dim=-1, keepdim=True)).exp_()  # softmax in place: the most likely 1,
    _apply_min_p(work, [p.min_p for p in params])  # min-p on these,
    work.div_(work.sum(dim=-1, keepdim=True))  # then normalized
    return _apply_top_p(work, [p.top_p for p in params]), tokens, tied


def inverse_cdf_draw(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Row i's token: the first whose cumulative probability exceeds u_i times the row's
    total, for u_i uniform in [0, 1) — a draw from the row's distribution. The search runs
    over blocks of `_DRAW_BLOCK` tokens first (each summed in float32: ~1e-6 relative, a
    float64 copy of whole rows cost more than the rest of the draw), the blocks' running
    total and then the tokens of the block the target falls in in float64. u · total <
    total exactly (u <= 1 - 2^-53), so the pick is a token where the sum grows: one with
    probability > 0."""
    rows, vocab = probs.shape
    padded = probs if vocab % _DRAW_BLOCK == 0 else F.pad(probs, (0, -vocab % _DRAW_BLOCK))
    blocks = padded.view(rows, -1, _DRAW_BLOCK)
    block_cdf = blocks.sum(dim=-1).to(torch.float64).cumsum(dim=-1)
    target = uniforms.to(torch.float64).unsqueeze(1) * block_cdf[:, -1:]
    block = torch.searchsorted(block_cdf, target, right=True).clamp_(max=blocks.shape[1] - 1)
    before = block_cdf.gather(1, (block - 1).clamp(min=0)).masked_fill_(block == 0, 0.0)
    inner = blocks[torch.arange(rows, device=probs.device), block.squeeze(1)]
    cdf = before + inner.cumsum(dim=-1, dtype=torch.float64)
    within = torch.searchsorted(cdf, target, right=True).squeeze(1)
    # The block's sum and the running sum inside it may round apart (~1e-16): should the
    # target pass the block's end, its last token with mass (NaN rows land in range too).
    past = within >= _DRAW_BLOCK
    if bool(past.any()):
        within[past] = _DRAW_BLOCK - 1 - (inner[past].flip(1) > 0).to(torch.int8).argmax(dim=1)
    return (block.squeeze(1) * _DRAW_BLOCK + within).clamp_(max=vocab - 1)


def _apply_top_n_sigma(logits: torch.Tensor, ns: list[float]) -> torch.Tensor:
    """Keep tokens whose logit is within n population standard deviations of the row's max
    (statistics over the tokens still allowed), in place."""
    if all(n <= 0 for n in ns):
        return logits
    n_t = torch.tensor([n if n > 0 else math.inf for n in ns],
                       device=logits.device).unsqueeze(1)
    finite = torch.isfinite(logits)
    count = finite.sum(dim=-1, keepdim=True).clamp(min=1)
    vals = torch.where(finite, logits, torch.zeros_like(logits))
    mean = vals.sum(dim=-1, keepdim=True) / count
    var = (torch.where(finite, logits - mean, torch.zeros_like(logits)) ** 2).sum(
        dim=-1, keepdim=True) / count
    top = logits.max(dim=-1, keepdim=True).values
    threshold = top - n_t * var.sqrt()
    # n = inf (off): threshold is -inf or nan; keep everything for those rows.
    threshold = torch.where(torch.isinf(n_t), torch.full_like(top, _NEG_INF), threshold)
    return logits.masked_fill_(logits < threshold, _NEG_INF)


def _apply_top_k(logits: torch.Tensor, top_ks: list[int]
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Keep each row's top_k largest logits (and any tied with the k-th). With top-k on every
    row and no row's k-th value tied with the next: the K = max(top_k) largest logits of each
    row and their token ids, the rest of the vocabulary gone; else the full rows (edited in
    place) and None. Third: which rows have that tie (None where some row has no top-k)."""
    vocab = logits.shape[-1]
    ks = [k if 0 < k < vocab else vocab for k in top_ks]
    if all(k == vocab for k in ks):
        return logits, None, None
    k_t = torch.tensor(ks, device=logits.device).unsqueeze(1)
    most = max(ks)
    values, tokens = logits.topk(min(most + 1, vocab), dim=-1)
    kth = values.gather(1, k_t - 1)
    if most == vocab:  # some row without top-k: whole rows
        return logits.masked_fill_(logits < kth, _NEG_INF), None, None
    tied = (values[:, most:] == kth).squeeze(1)
    if not bool(tied.any()):
        values = values[:, :most].contiguous()
        return values.masked_fill_(values < kth, _NEG_INF), tokens[:, :most].contiguous(), tied
    return logits.masked_fill_(logits < kth, _NEG_INF), None, tied


def _apply_min_p(relative: torch.Tensor, min_ps: list[float]) -> torch.Tensor:
    """Keep tokens with p >= min_p · p_max, on ``relative`` = p / p_max (exp(logit - max)),
    in place: one threshold pass per distinct min_p (a compare and a masked fill over the
    logits took ~3 ms for 64 rows of a 49k vocabulary, and exp then ran slower on -inf)."""
    for value in sorted({p for p in min_ps if p > 0}):
        below = _float32_below(value)  # `relative > below` is `relative >= min_p`
        rows = [i for i, p in enumerate(min_ps) if p == value]
        if len(rows) == len(min_ps):
            F.threshold(relative, below, 0.0, inplace=True)
        else:
            relative[rows] = F.threshold(relative[rows], below, 0.0)
    return relative


@functools.cache
def _float32_below(value: float) -> float:
    """The float32 just below ``value`` (once per min_p value, not every step)."""
    return float(torch.nextafter(torch.tensor(value, dtype=torch.float32), torch.tensor(0.0)))


def _apply_top_p(probs: torch.Tensor, top_ps: list[float]) -> torch.Tensor:
    """Keep a row's most likely tokens until their mass reaches top_p, renormalized: a token
    is dropped when the mass of the tokens before it (most likely first) already reaches
    top_p, so at least one stays; a token tied with the last one kept stays too."""
    rows = [i for i, p in enumerate(top_ps) if p < 1.0]
    if not rows:
        return probs
    sub = probs if len(rows) == len(top_ps) else probs[rows]
    p_t = torch.tensor([top_ps[i] for i in rows], dtype=torch.float64)
    if sampler_ops.top_p_cut_(sub, p_t) is None:
        threshold = _top_p_threshold(sub, p_t.to(sub.device))
        sub.masked_fill_(sub < threshold.unsqueeze(1), 0.0)
    cut = sub.div_(sub.sum(dim=-1, keepdim=True))
    if len(rows) == len(top_ps):
        return cut
    probs[rows] = cut
    return probs


def _top_p_threshold(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """`sampler_ops.top_p_threshold` in torch ops (other devices): the cut is looked for among
    the `_TOP_P_FIRST` most likely tokens, then 8x as many, ... (all of them at worst)."""
    vocab, k = probs.shape[-1], min(_TOP_P_FIRST, probs.shape[-1])
    while True:
        top = probs.topk(k, dim=-1).values  # most likely first
        kept = ((top.cumsum(dim=-1) - top) < top_p.unsqueeze(1).to(top.dtype)).sum(
            dim=-1, keepdim=True)
        if k == vocab or bool((kept < k).all()):
            return top.gather(1, kept.clamp(min=1) - 1).squeeze(1)
        k = min(vocab, 8 * k)
