"""Batched sampler: per-row parameters become tensors, one vectorised pass per step.

Pipeline (each stage only touches the rows that use it):
min_tokens mask → repetition / presence / frequency / LZ / DRY penalties → bad_words and
allowed_token_ids masks → logit_bias → grammar mask (outside thinking) → thinking-budget
forced token → [greedy rows: argmax] → top-n-σ → temperature → top-k → min-p → top-p →
sample.

Randomness is one uniform draw u per sampled row: its token is the first whose cumulative
probability passes u (inverse CDF, running sums in float64): a draw from p exactly. Each
seeded request draws its u from its own generator, so its tokens never depend on its batch
mates or its row. Logprobs are of the raw model distribution.

Cost on a CPU matters at every step: a 49k-token vocabulary, 64 rows. An exponential race
(one Exp(1) draw per token) took ~1 ms a row and a full sort for top-k / top-p ~2 ms a row;
here top-k takes the k largest logits (torch.topk) and the steps after it read only those;
top-p's cut comes from one pass and a select (fused_ops.top_p_threshold); the draw sums
blocks of the row before it sums tokens. Sampled rows run in groups of one top_k, so a
row's arithmetic never depends on its batch mates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from met.layers import fused_ops
from met.sampling.grammar import apply_grammar_masks
from met.sampling.params import SamplingParams
from met.scheduler.request import Request

_NEG_INF = float("-inf")
_TOP_P_FIRST = 64  # tokens top-p looks at first (more only if their mass falls short)
_DRAW_BLOCK = 256  # tokens per block of the inverse-CDF draw's first search


@dataclass(frozen=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]  # per row, when the request asked for them
    # Rows whose grammar allowed no token (their token is meaningless: fail the request).
    dead_ends: list[int] = field(default_factory=list)


class Sampler:
    """Turns float32 logits [N, V] for N requests into one token each."""

    def __init__(self, seed: int = 0):
        # Unseeded requests share this engine generator (reproducible for a fixed run).
        self.generator = torch.Generator().manual_seed(seed)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SampleResult:
        logits = logits.float()
        # Logprobs of the raw model distribution, for the rows that ask for them.
        wanted = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
        raw_logprobs = None if not wanted else torch.log_softmax(
            logits if len(wanted) == len(requests) else logits[wanted], dim=-1)
        # The grammar and thinking masks below write in place: they need a copy too.
        logits = process_logits(logits, requests, copy=_has_structure(requests))
        dead_ends = _apply_structure(logits, requests)

        tokens = fused_ops.argmax(logits)
        # Sampled rows go in groups of one top_k each: a row's arithmetic (how many candidates
        # it keeps) then depends on its own parameters only, never on its batch mates'.
        groups: dict[int, list[int]] = {}
        for i, r in enumerate(requests):
            if not r.params.greedy:
                groups.setdefault(r.params.top_k, []).append(i)
        for group in groups.values():
            tokens[group] = self._draw(logits, group, [requests[i] for i in group])

        token_list = tokens.tolist()
        logprobs: list[dict[int, float] | None] = [None] * len(requests)
        if raw_logprobs is not None:
            for i, entry in zip(wanted, _logprob_entries(
                    raw_logprobs, [token_list[i] for i in wanted],
                    [requests[i].params.logprobs for i in wanted]), strict=True):
                logprobs[i] = entry
        return SampleResult(token_list, logprobs, dead_ends)

    def _draw(self, logits: torch.Tensor, rows: list[int], requests: list[Request]
              ) -> torch.Tensor:
        """Tokens for ``rows`` of ``logits`` (all sampled, one top_k), one uniform from each
        request's generator (the engine's for unseeded ones)."""
        every = len(rows) == logits.shape[0]  # no row copy (sampling_candidates copies)
        probs, candidates, tied = sampling_candidates(logits if every else logits[rows],
                                                      [r.params for r in requests])
        if tied is not None and bool(tied.any()) and not bool(tied.all()):
            # Some rows' k-th logit ties the next one: they keep every tied token (whole
            # rows), the others their k candidates; each part alone, as it would run alone.
            picked = torch.empty(len(rows), dtype=torch.long, device=logits.device)
            for part in (tied, ~tied):
                at = part.nonzero().squeeze(1).tolist()
                picked[at] = self._draw(logits, [rows[i] for i in at],
                                        [requests[i] for i in at])
            return picked
        uniforms = torch.cat([
            torch.rand(1, dtype=torch.float64, generator=r.generator or self.generator)
            for r in requests])
        picked = inverse_cdf_draw(probs, uniforms.to(probs.device))
        if candidates is not None:
            picked = candidates.gather(1, picked.unsqueeze(1)).squeeze(1)
        return picked


def process_logits(logits: torch.Tensor, requests: list[Request], *,
                   copy: bool = False) -> torch.Tensor:
    """The logit edits every row gets, greedy or not, made on a float32 copy; ``logits``
    itself when no request asks for any and ``copy`` is off (copying 64 rows of a 49k
    vocabulary took 1.5 ms of a 64-stream step)."""
    if not copy and not any(_edits_logits(r) for r in requests):
        return logits
    logits = logits.clone()
    _mask_until_min_tokens(logits, requests)
    _apply_repetition_penalty(logits, requests)
    _apply_presence_frequency(logits, requests)
    _apply_lz_penalty(logits, requests)
    _apply_dry(logits, requests)
    _apply_bad_words(logits, requests)
    _apply_allowed_token_ids(logits, requests)
    _apply_logit_bias(logits, requests)
    return logits


def _edits_logits(r: Request) -> bool:
    """Whether any stage of `process_logits` touches this request's row."""
    p = r.params
    return bool(r.num_output_tokens < p.min_tokens or p.repetition_penalty != 1.0
                or p.presence_penalty != 0 or p.frequency_penalty != 0 or p.lz_penalty != 0
                or p.dry_multiplier != 0 or p.bad_words or p.allowed_token_ids is not None
                or p.logit_bias)


def _has_structure(requests: list[Request]) -> bool:
    return any(r.grammar is not None or r.thinking is not None for r in requests)


def _apply_structure(logits: torch.Tensor, requests: list[Request]) -> list[int]:
    """Grammar masks (outside thinking), then tokens a thinking budget forces. Returns the
    rows left with no allowed token."""
    if not _has_structure(requests):
        return []  # the common case: nothing to mask
    # A budgeted reasoning model may open its thinking as its first token even when a
    # grammar holds the answer: keep the start marker's logit through the grammar mask.
    opening = [(i, r.thinking.spec.start_token_ids[0]) for i, r in enumerate(requests)
               if r.thinking is not None and r.grammar_applies() and not r.thinking.ended
               and r.num_output_tokens == 0 and r.thinking.spec.start_token_ids]
    saved = [float(logits[i, t]) for i, t in opening]
    masked = apply_grammar_masks(logits, [r.grammar if r.grammar_applies() else None
                                          for r in requests])
    for (i, t), value in zip(opening, saved, strict=True):
        logits[i, t] = value
    for i, r in enumerate(requests):
        forced = r.thinking.forced_token() if r.thinking is not None else None
        if forced is not None:
            value = float(logits[i, forced])
            logits[i] = _NEG_INF
            logits[i, forced] = value if value != _NEG_INF else 0.0
    if not masked:
        return []
    alive = torch.isfinite(logits[torch.tensor(masked, device=logits.device)]).any(dim=-1)
    return [i for i, ok in zip(masked, alive.tolist(), strict=True) if not ok]


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
        # Into a fresh tensor: `logits / temps_t` (a [N, 1] divisor) ran ~4x slower (2 ms
        # for 64 rows of a 49k vocabulary).
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


def _index(rows: list[int], cols: list[int], device: torch.device
           ) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.tensor(rows, device=device), torch.tensor(cols, device=device))


def _rows(requests: list[Request], active) -> list[int]:
    return [i for i, r in enumerate(requests) if active(r.params)]


def _padded(seqs: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """Token lists → [R, max_len] with padding id ``vocab`` (an extra, discarded column)."""
    width = max((len(s) for s in seqs), default=0)
    out = torch.full((len(seqs), max(width, 1)), vocab, dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            out[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    return out.to(device)


def _occurrences(seqs: list[list[int]], vocab: int, device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every entry of the token lists as (list index, token id, how often that id occurs in
    its list), duplicates included: the penalties touch only the tokens a row has seen (a
    dense [R, V] count table cost several passes over 64 rows of a 49k vocabulary, ~30 ms
    of a 64-stream step)."""
    ids = _padded(seqs, vocab, device)  # padded with `vocab`, which no list holds
    ordered = ids.sort(dim=1).values
    counts = (torch.searchsorted(ordered, ids, right=True)
              - torch.searchsorted(ordered, ids)).to(torch.float32)
    which = torch.arange(len(seqs), device=device).unsqueeze(1).expand_as(ids)
    real = ids < vocab
    return which[real], ids[real], counts[real]


def _mask_until_min_tokens(logits: torch.Tensor, requests: list[Request]) -> None:
    for i, r in enumerate(requests):
        if r.num_output_tokens < r.params.min_tokens:
            stop_ids = set(r.params.stop_token_ids)
            if not r.params.ignore_eos:
                stop_ids |= r.eos_token_ids
            if stop_ids:
                logits[i, list(stop_ids)] = _NEG_INF


def _apply_repetition_penalty(logits: torch.Tensor, requests: list[Request]) -> None:
    """HF / vLLM rule over the last ``repetition_penalty_window`` tokens (prompt included):
    a seen token's logit is divided by the penalty when positive, multiplied when not."""
    rows = _rows(requests, lambda p: p.repetition_penalty != 1.0)
    if not rows:
        return
    seqs = [requests[i].all_token_ids[-requests[i].params.repetition_penalty_window:]
            for i in rows]
    which, ids, _ = _occurrences(seqs, logits.shape[1], logits.device)
    at = torch.tensor(rows, device=logits.device)[which]
    pen = torch.tensor([requests[i].params.repetition_penalty for i in rows],
                       device=logits.device)[which]
    seen = logits[at, ids]  # a token seen twice is written twice, with the same value
    logits[at, ids] = torch.where(seen > 0, seen / pen, seen * pen)


def _apply_presence_frequency(logits: torch.Tensor, requests: list[Request]) -> None:
    """OpenAI's rule over the generated tokens: logit -= frequency·count + presence·[count>0]."""
    rows = _rows(requests, lambda p: p.presence_penalty != 0 or p.frequency_penalty != 0)
    if not rows:
        return
    which, ids, counts = _occurrences([requests[i].output_token_ids for i in rows],
                                      logits.shape[1], logits.device)
    at = torch.tensor(rows, device=logits.device)[which]
    pres = torch.tensor([requests[i].params.presence_penalty for i in rows],
                        device=logits.device)[which]
    freq = torch.tensor([requests[i].params.frequency_penalty for i in rows],
                        device=logits.device)[which]
    logits[at, ids] = logits[at, ids] - (freq * counts + pres)


LZ_WINDOW = 256
LZ_NGRAMS = (3, 4, 5)


def lz_counts(tokens: list[int]) -> dict[int, int]:
    """{candidate: Σ over n of (n − 2) · occurrences of (last n−1 tokens + candidate) in the
    last LZ_WINDOW tokens}."""
    w = tokens[-LZ_WINDOW:]
    out: dict[int, int] = {}
    for n in LZ_NGRAMS:
        if len(w) < n:
            break
        ctx = w[len(w) - n + 1:]
        for i in range(len(w) - n + 1):
            if w[i:i + n - 1] == ctx:
                t = w[i + n - 1]
                out[t] = out.get(t, 0) + n - 2
    return out


def _apply_lz_penalty(logits: torch.Tensor, requests: list[Request]) -> None:
    rows: list[int] = []
    cols: list[int] = []
    amounts: list[float] = []
    for i, r in enumerate(requests):
        if r.params.lz_penalty == 0:
            continue
        for t, c in lz_counts(r.all_token_ids).items():
            rows.append(i)
            cols.append(t)
            amounts.append(-r.params.lz_penalty * c)
    if rows:
        logits.index_put_(_index(rows, cols, logits.device),
                          torch.tensor(amounts, device=logits.device), accumulate=True)


DRY_MAX_MATCH = 50  # longer matches count as 50 (keeps base^m finite; as text-gen-webui)


def dry_breaker_ids(breakers: tuple[str | int, ...], tokenizer) -> frozenset[int]:
    """Token ids of DRY sequence breakers: an int is a token id; a string is the last token
    of ``"a" + string`` (its own token when it follows text, as text-generation-webui does)."""
    out = set()
    for b in breakers:
        if isinstance(b, int):
            out.add(b)
        elif tokenizer is not None and b:
            ids = tokenizer.encode("a" + b, add_special_tokens=False)
            if ids:
                out.add(ids[-1])
    return frozenset(out)


def dry_match_lengths(tokens: list[int], breakers: frozenset[int]) -> dict[int, int]:
    """{candidate: length of the longest suffix of ``tokens`` that already occurred right
    before an earlier occurrence of candidate}, never matching across a breaker."""
    n = len(tokens)
    if n < 2 or tokens[-1] in breakers:
        return {}
    last = tokens[-1]
    out: dict[int, int] = {}
    for i in range(n - 1):
        if tokens[i] != last:
            continue
        nxt = tokens[i + 1]
        if nxt in breakers:
            continue
        length = 1
        while length < DRY_MAX_MATCH:
            j = i - length
            prev = tokens[n - 1 - length]
            if j < 0 or tokens[j] != prev or prev in breakers:
                break
            length += 1
        if length > out.get(nxt, 0):
            out[nxt] = length
    return out


def _apply_dry(logits: torch.Tensor, requests: list[Request]) -> None:
    rows: list[int] = []
    cols: list[int] = []
    amounts: list[float] = []
    for i, r in enumerate(requests):
        p = r.params
        if p.dry_multiplier == 0:
            continue
        for t, m in dry_match_lengths(r.all_token_ids, r.dry_breaker_ids).items():
            if m >= p.dry_allowed_length:
                rows.append(i)
                cols.append(t)
                amounts.append(-p.dry_multiplier * p.dry_base ** (m - p.dry_allowed_length))
    if rows:
        logits.index_put_(_index(rows, cols, logits.device),
                          torch.tensor(amounts, device=logits.device), accumulate=True)


def _apply_bad_words(logits: torch.Tensor, requests: list[Request]) -> None:
    """Ban the token that would complete a bad word: its last token, whenever the output
    ends with the word's other tokens (always, for a one-token word)."""
    rows: list[int] = []
    cols: list[int] = []
    for i, r in enumerate(requests):
        if not r.params.bad_words:
            continue
        out = r.output_token_ids
        for word in r.params.bad_words:
            prefix = word[:-1]
            if len(prefix) <= len(out) and (not prefix or tuple(out[-len(prefix):]) == prefix):
                rows.append(i)
                cols.append(word[-1])
    if rows:
        logits[_index(rows, cols, logits.device)] = _NEG_INF


def _apply_allowed_token_ids(logits: torch.Tensor, requests: list[Request]) -> None:
    rows = _rows(requests, lambda p: p.allowed_token_ids is not None)
    if not rows:
        return
    keep = torch.zeros(len(rows), logits.shape[1], dtype=torch.bool, device=logits.device)
    for j, i in enumerate(rows):
        keep[j, list(requests[i].params.allowed_token_ids)] = True
    idx = torch.tensor(rows, device=logits.device)
    logits[idx] = logits[idx].masked_fill(~keep, _NEG_INF)


def _apply_logit_bias(logits: torch.Tensor, requests: list[Request]) -> None:
    rows: list[int] = []
    cols: list[int] = []
    biases: list[float] = []
    for i, r in enumerate(requests):
        for t, b in r.params.logit_bias or ():
            rows.append(i)
            cols.append(t)
            biases.append(b)
    if rows:
        logits.index_put_(_index(rows, cols, logits.device),
                          torch.tensor(biases, device=logits.device), accumulate=True)


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
        # The float32 just below min_p: `relative > below` is `relative >= min_p`.
        below = float(torch.nextafter(torch.tensor(value, dtype=torch.float32),
                                      torch.tensor(0.0)))
        rows = [i for i, p in enumerate(min_ps) if p == value]
        if len(rows) == len(min_ps):
            F.threshold(relative, below, 0.0, inplace=True)
        else:
            relative[rows] = F.threshold(relative[rows], below, 0.0)
    return relative


def _apply_top_p(probs: torch.Tensor, top_ps: list[float]) -> torch.Tensor:
    """Keep a row's most likely tokens until their mass reaches top_p, renormalized: a token
    is dropped when the mass of the tokens before it (most likely first) already reaches
    top_p, so at least one stays; a token tied with the last one kept stays too."""
    rows = [i for i, p in enumerate(top_ps) if p < 1.0]
    if not rows:
        return probs
    sub = probs if len(rows) == len(top_ps) else probs[rows]
    p_t = torch.tensor([top_ps[i] for i in rows], dtype=torch.float64)
    threshold = fused_ops.top_p_threshold(sub, p_t)
    if threshold is None:
        threshold = _top_p_threshold(sub, p_t.to(sub.device))
    cut = sub.masked_fill_(sub < threshold.unsqueeze(1), 0.0)
    cut.div_(cut.sum(dim=-1, keepdim=True))
    if len(rows) == len(top_ps):
        return cut
    probs[rows] = cut
    return probs


def _top_p_threshold(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """`fused_ops.top_p_threshold` in torch ops (other devices): the cut is looked for among
    the `_TOP_P_FIRST` most likely tokens, then 8x as many, ... (all of them at worst)."""
    vocab, k = probs.shape[-1], min(_TOP_P_FIRST, probs.shape[-1])
    while True:
        top = probs.topk(k, dim=-1).values  # most likely first
        kept = ((top.cumsum(dim=-1) - top) < top_p.unsqueeze(1).to(top.dtype)).sum(
            dim=-1, keepdim=True)
        if k == vocab or bool((kept < k).all()):
            return top.gather(1, kept.clamp(min=1) - 1).squeeze(1)
        k = min(vocab, 8 * k)


def _logprob_entries(logprobs: torch.Tensor, tokens: list[int], tops: list[int]
                     ) -> list[dict[int, float]]:
    """Per row: the sampled token's logprob, then the row's `top` most likely tokens' (one
    batched top-k for all rows: per row it cost ~0.1 ms at a 49k vocabulary)."""
    chosen = logprobs.gather(1, torch.tensor(tokens, device=logprobs.device).unsqueeze(1))
    entries = [{t: v} for t, v in zip(tokens, chosen.squeeze(1).tolist(), strict=True)]
    most = min(max(tops), logprobs.shape[1])
    if most:
        values, ids = logprobs.topk(most, dim=-1)
        for entry, top, vs, ts in zip(entries, tops, values.tolist(), ids.tolist(), strict=True):
            for v, t in zip(vs[:top], ts[:top], strict=True):
                entry.setdefault(t, v)
    return entries
