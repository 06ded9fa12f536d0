"""The batched sampler against plain per-row references, transformers' logits processors and
hand-computed distributions, for batches that mix different parameters per row."""

from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import chisquare
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from met.sampling.distribution import _top_p_threshold, inverse_cdf_draw, sampling_probs
from met.sampling.logit_edits import dry_breaker_ids, process_logits
from met.sampling.params import SamplingParams
from met.sampling.sampler import Sampler
from met.scheduler.request import Request

V = 50
EOS = frozenset({0})


def make_req(prompt: list[int], output: list[int] = (), rid: str = "r", **kw) -> Request:
    req = Request(rid, list(prompt), SamplingParams(**kw), eos_token_ids=EOS)
    req.all_token_ids.extend(output)
    req.dry_breaker_ids = dry_breaker_ids(req.params.dry_sequence_breakers, None)
    return req


# ---------------------------------------------------------------- plain per-row reference

def reference_row(logits: list[float], req: Request) -> list[float]:
    """The processed logits of one row, written out token by token."""
    p = req.params
    x = list(logits)
    if req.num_output_tokens < p.min_tokens:
        for t in set(p.stop_token_ids) | (set() if p.ignore_eos else set(req.eos_token_ids)):
            x[t] = -math.inf
    window = req.all_token_ids[-p.repetition_penalty_window:]
    for t in set(window):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    out = req.output_token_ids
    for t in set(out):
        x[t] -= p.frequency_penalty * out.count(t) + p.presence_penalty
    if p.lz_penalty:
        seq = req.all_token_ids[-256:]
        for n in (3, 4, 5):
            if len(seq) < n:
                continue
            for t in range(len(x)):
                gram = seq[len(seq) - n + 1:] + [t]
                count = sum(seq[i:i + n] == gram for i in range(len(seq) - n + 1))
                x[t] -= p.lz_penalty * (n - 2) * count
    if p.dry_multiplier:
        seq, breakers, best = req.all_token_ids, req.dry_breaker_ids, {}
        for pos in range(1, len(seq)):
            t = seq[pos]
            if t in breakers:
                continue
            k = 0  # how many tokens before pos equal the sequence's last tokens
            while (k < min(pos, 50) and seq[pos - 1 - k] == seq[-1 - k]
                   and seq[-1 - k] not in breakers):
                k += 1
            best[t] = max(best.get(t, 0), k)
        for t, k in best.items():
            if k >= p.dry_allowed_length:
                x[t] -= p.dry_multiplier * p.dry_base ** (k - p.dry_allowed_length)
    for word in p.bad_words:
        if len(word) == 1 or out[-(len(word) - 1):] == list(word[:-1]):
            x[word[-1]] = -math.inf
    if p.allowed_token_ids is not None:
        x = [v if t in p.allowed_token_ids else -math.inf for t, v in enumerate(x)]
    for t, b in p.logit_bias or ():
        x[t] += b
    return x


def reference_probs(x: list[float], p: SamplingParams) -> list[float]:
    """top-n-σ → temperature → top-k → min-p → top-p → softmax, one row."""
    x = list(x)
    if p.top_n_sigma > 0:
        fin = [v for v in x if v != -math.inf]
        mean = sum(fin) / len(fin)
        std = math.sqrt(sum((v - mean) ** 2 for v in fin) / len(fin))
        x = [v if v >= max(fin) - p.top_n_sigma * std else -math.inf for v in x]
    x = [v / p.temperature for v in x]
    if 0 < p.top_k < len(x):
        kth = sorted(x, reverse=True)[p.top_k - 1]
        x = [v if v >= kth else -math.inf for v in x]
    if p.min_p > 0:
        m = max(x)
        x = [v if math.exp(v - m) >= p.min_p else -math.inf for v in x]
    if p.top_p < 1:
        m = max(x)
        probs = [math.exp(v - m) for v in x]
        z = sum(probs)
        probs = [q / z for q in probs]
        order = sorted(range(len(x)), key=lambda t: -x[t])
        mass = 0.0
        for t in order:
            if mass >= p.top_p:
                x[t] = -math.inf
            mass += probs[t]
    m = max(x)
    e = [math.exp(v - m) if v != -math.inf else 0.0 for v in x]
    z = sum(e)
    return [q / z for q in e]


MIXED = [
    dict(temperature=0.0),
    dict(temperature=0.7, top_k=5),
    dict(temperature=1.3, top_p=0.8),
    dict(temperature=1.0, min_p=0.2),
    dict(temperature=0.9, top_n_sigma=1.0),
    dict(temperature=1.0, repetition_penalty=1.5, repetition_penalty_window=4),
    dict(temperature=1.0, presence_penalty=1.5, frequency_penalty=-0.7),
    dict(temperature=1.0, logit_bias={3: 5.0, 7: -100.0}),
    dict(temperature=1.0, bad_words=[(9,), (4, 11)], allowed_token_ids=None),
    dict(temperature=0.8, allowed_token_ids=[1, 2, 3, 11, 12]),
    dict(temperature=1.0, min_tokens=3, stop_token_ids=[5]),
    dict(temperature=1.2, top_k=10, min_p=0.05, top_p=0.9, top_n_sigma=2.0,
         repetition_penalty=0.8, frequency_penalty=1.0, logit_bias={2: 1.5}),
    dict(temperature=1.0, lz_penalty=0.7),
    dict(temperature=1.0, dry_multiplier=0.8, dry_base=1.5, dry_allowed_length=1,
         dry_sequence_breakers=[]),
    dict(temperature=1.0, dry_multiplier=0.8, dry_allowed_length=2, dry_sequence_breakers=[1]),
    dict(temperature=1.0),
]


def test_mixed_batch_matches_plain_per_row_reference():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(len(MIXED), V, generator=gen) * 3
    # Repeats "2 3 4" and "3 4" so the LZ n-grams (3, 4, 5) all find matches.
    reqs = [make_req([1, 2, 3, 4, 2, 9, 11, 2, 3, 4, 6], [2, 3, 4, 4, 6, 1, 2, 3], rid=str(i),
                     **kw)
            for i, kw in enumerate(MIXED)]
    processed = process_logits(logits, reqs)
    for i, r in enumerate(reqs):
        ref = torch.tensor(reference_row(logits[i].tolist(), r))
        torch.testing.assert_close(processed[i], ref, msg=f"row {i}: {MIXED[i]}")
    sampled = [i for i, r in enumerate(reqs) if not r.params.greedy]
    probs = sampling_probs(processed[sampled], [reqs[i].params for i in sampled])
    for j, i in enumerate(sampled):
        ref = torch.tensor(reference_probs(processed[i].tolist(), reqs[i].params))
        torch.testing.assert_close(probs[j], ref, msg=f"row {i}: {MIXED[i]}")
    # The input logits are not modified.
    assert torch.equal(logits, torch.randn(len(MIXED), V,
                                           generator=torch.Generator().manual_seed(0)) * 3)


@pytest.mark.parametrize("kw,warper", [
    (dict(top_k=7), lambda: TopKLogitsWarper(7)),
    (dict(top_p=0.6), lambda: TopPLogitsWarper(0.6)),
    (dict(min_p=0.1), lambda: MinPLogitsWarper(0.1)),
])
def test_filters_match_transformers_warpers(kw, warper):
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(1)) * 2
    params = [SamplingParams(**kw)] * 4
    ours = sampling_probs(logits, params)
    theirs = torch.softmax(warper()(None, logits.clone()), dim=-1)
    torch.testing.assert_close(ours, theirs)


def test_top_p_and_top_k_on_a_large_vocabulary_match_transformers_row_by_row():
    # A flat head needs hundreds of tokens for the nucleus (more than top-p looks at first),
    # a peaked row only a few; rows with top_p = 1 and different top_k share the batch.
    vocab = 4096
    gen = torch.Generator().manual_seed(5)
    flat = torch.randn(vocab, generator=gen) * 0.1
    peaked = torch.randn(vocab, generator=gen) * 4
    logits = torch.stack([flat, peaked, flat, peaked])
    params = [SamplingParams(top_p=0.9), SamplingParams(top_p=0.5),
              SamplingParams(top_k=700), SamplingParams(top_k=3, top_p=0.99)]
    ours = sampling_probs(logits, params)
    warpers = [[TopPLogitsWarper(0.9)], [TopPLogitsWarper(0.5)], [TopKLogitsWarper(700)],
               [TopKLogitsWarper(3), TopPLogitsWarper(0.99)]]
    for i, chain in enumerate(warpers):
        row = logits[i:i + 1].clone()
        for warper in chain:
            row = warper(None, row)
        torch.testing.assert_close(ours[i], torch.softmax(row, dim=-1)[0], msg=f"row {i}")
    assert int((ours[0] > 0).sum()) > 500  # the flat row's nucleus is wide


def test_native_top_p_cut_matches_the_definition_and_the_torch_path():
    # Flat, peaked and tied rows; the cut is min{v : mass of tokens above v < top_p}. The
    # native search first counts only values >= (1 - top_p) / 2V (a language model's long tail
    # of tiny probabilities is skipped): the long-tailed row takes that path.
    from met.kernels import sampler_ops
    gen = torch.Generator().manual_seed(7)
    long_tail = torch.randn(5000, generator=gen) * 2
    long_tail[torch.randperm(5000, generator=gen)[:20]] += 15.0
    rows = [torch.randn(5000, generator=gen) * 0.05, torch.randn(5000, generator=gen) * 5,
            torch.randint(0, 4, (5000,), generator=gen).float(), torch.zeros(5000), long_tail]
    rows[3][17] = 1.0  # one token holds all the mass
    probs = torch.softmax(torch.stack(rows), dim=-1)
    probs[3] = torch.where(probs[3] > 0.5, 1.0, 0.0)
    n = len(rows)
    assert int((probs[4] < 0.001 / (2 * 5000)).sum()) > 4000  # most of the tail is skipped
    for top_p in (0.05, 0.5, 0.9, 0.999):
        p_t = torch.full((n,), top_p, dtype=torch.float64)
        native = sampler_ops.top_p_threshold(probs, p_t)
        assert native is not None
        for i in range(n):
            values = probs[i].double()
            want = min(v for v in set(values.tolist()) if float(values[values > v].sum()) < top_p)
            assert float(native[i]) == pytest.approx(want, rel=0, abs=0), (i, top_p)
        torch.testing.assert_close(_top_p_threshold(probs, p_t), native, rtol=0, atol=0)
        cut = probs.clone()
        assert torch.equal(sampler_ops.top_p_cut_(cut, p_t), native)  # in place, same cut
        assert torch.equal(cut, probs.masked_fill(probs < native.unsqueeze(1), 0.0))


def test_native_top_p_cut_of_a_row_whose_tail_holds_the_cut():
    # 0.87 on one token and 4999 tokens of 9.98e-6 (below the skipped tail's bound 1e-5 at
    # top_p 0.9): the nucleus runs into the tail, so the search over every value decides.
    from met.kernels import sampler_ops
    probs = torch.full((1, 5000), 0.0499 / 4999)
    probs[0, 123] = 0.87
    for top_p, want in ((0.5, float(probs[0, 123])), (0.9, float(probs[0, 0]))):
        p_t = torch.tensor([top_p], dtype=torch.float64)
        assert float(sampler_ops.top_p_threshold(probs, p_t)[0]) == want
        assert float(_top_p_threshold(probs, p_t)[0]) == want


def test_native_top_p_keeps_every_token_of_a_nan_row_and_needs_a_contiguous_row():
    from met.kernels import sampler_ops
    probs = torch.softmax(torch.randn(3, 300, generator=torch.Generator().manual_seed(1)), -1)
    probs[1, 7] = float("nan")
    p_t = torch.full((3,), 0.5, dtype=torch.float64)
    cut = probs.clone()
    thresholds = sampler_ops.top_p_cut_(cut, p_t)
    assert float(thresholds[1]) == 0.0 and torch.equal(cut[1].nan_to_num(), probs[1].nan_to_num())
    assert int((cut[0] > 0).sum()) < 300 and int((cut[2] > 0).sum()) < 300
    zeros = torch.tensor([[0.5, -0.0, 0.3, 0.0, 0.2] + [0.0] * 59])  # -0.0 and 0.0: no mass
    for top_p, want in ((0.4, 0.5), (0.6, 0.3), (0.9, 0.2)):
        got = sampler_ops.top_p_threshold(zeros, torch.tensor([top_p], dtype=torch.float64))
        assert float(got[0]) == pytest.approx(want, rel=1e-7), top_p
    strided = probs.t().contiguous().t()  # same values, not contiguous: not edited in place
    assert sampler_ops.top_p_cut_(strided, p_t) is None
    assert torch.equal(strided.nan_to_num(), probs.nan_to_num())


def test_top_k_keeps_every_token_tied_with_the_kth():
    # k = 2: the k-th largest logit (1.0) is shared by three tokens; all three stay, as
    # transformers' TopKLogitsWarper keeps them. The second row has no ties: exactly k stay.
    logits = torch.tensor([[3.0, 1.0, 1.0, 1.0, 0.0], [3.0, 2.0, 1.0, 0.5, 0.0]])
    probs = sampling_probs(logits, [SamplingParams(top_k=2)] * 2)
    assert (probs[0] > 0).tolist() == [True, True, True, True, False]
    assert (probs[1] > 0).tolist() == [True, True, False, False, False]
    theirs = torch.softmax(TopKLogitsWarper(2)(None, logits.clone()), dim=-1)
    torch.testing.assert_close(probs, theirs)


def test_a_row_whose_kth_logit_ties_leaves_its_batch_mates_draws_alone():
    # Row "tie": five tokens share the top logit, so top_k 2 keeps all five (the whole-row
    # path); row "plain" keeps its 2 candidates. Each seeded row draws what it draws alone.
    gen = torch.Generator().manual_seed(8)
    plain = torch.randn(300, generator=gen)
    tie = torch.randn(300, generator=gen)
    tie[:5] = 10.0

    def draws(rows: dict[str, torch.Tensor]) -> dict[str, list[int]]:
        reqs = [make_req([1], rid=name, top_k=2, seed=sum(map(ord, name))) for name in rows]
        sampler, out = Sampler(), {name: [] for name in rows}
        for _ in range(40):
            tokens = sampler(torch.stack(list(rows.values())), reqs).token_ids
            for name, t in zip(rows, tokens, strict=True):
                out[name].append(t)
        return out

    together = draws({"plain": plain, "tie": tie})
    assert together["plain"] == draws({"plain": plain})["plain"]
    assert together["tie"] == draws({"tie": tie})["tie"]
    assert set(together["tie"]) == {0, 1, 2, 3, 4}
    assert set(together["plain"]) <= set(plain.topk(2).indices.tolist())


def test_inverse_cdf_draw_picks_only_tokens_with_mass():
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0],
                          [0.0, 0.25, 0.0, 0.75, 0.0],
                          [0.0, 0.25, 0.0, 0.75, 0.0],
                          [0.0, 0.0, 0.0, 0.0, 1.0]])
    below_one = 1.0 - 2.0 ** -53
    uniforms = torch.tensor([0.0, 0.2499, 0.25, below_one], dtype=torch.float64)
    assert inverse_cdf_draw(probs, uniforms).tolist() == [1, 1, 3, 4]
    # The largest u never reaches the trailing zero-mass token, whatever the row's total.
    for total in (1.0, 3.0, 0.7, 1e-30):
        assert inverse_cdf_draw(probs[:1] * total, uniforms[3:]).tolist() == [3], total
    # Unnormalized rows: the draw scales by the row's own total.
    assert inverse_cdf_draw(probs[:1] * 8, torch.tensor([0.3], dtype=torch.float64)
                            ).tolist() == [3]


def test_inverse_cdf_draw_over_many_blocks_matches_the_plain_cumulative_search():
    # 1000 tokens (blocks of 256 and a padded tail), long runs of zero mass, 3 rows.
    gen = torch.Generator().manual_seed(6)
    probs = torch.rand(3, 1000, generator=gen) ** 4
    probs[:, 100:700] = 0.0
    probs[1, :] = 0.0
    probs[1, 999] = 2.0
    for _ in range(200):
        uniforms = torch.rand(3, generator=gen, dtype=torch.float64)
        cdf = probs.double().cumsum(dim=-1)
        plain = torch.searchsorted(cdf, (uniforms[:, None] * cdf[:, -1:]), right=True)
        picked = inverse_cdf_draw(probs, uniforms)
        assert picked.tolist() == plain.squeeze(1).tolist()
        assert bool((probs.gather(1, picked[:, None]) > 0).all())


def test_repetition_penalty_matches_transformers():
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(2)) * 2
    seqs = [[3, 5, 7, 3, 10], [1, 1, 40, 22]]
    reqs = [make_req(s[:2], s[2:], rid=str(i), repetition_penalty=1.7)
            for i, s in enumerate(seqs)]
    ours = process_logits(logits, reqs)
    proc = RepetitionPenaltyLogitsProcessor(1.7)
    for i, s in enumerate(seqs):
        theirs = proc(torch.tensor([s]), logits[i:i + 1].clone())[0]
        torch.testing.assert_close(ours[i], theirs)


# ---------------------------------------------------------------- hand-computed behaviour

def test_hand_computed_distribution_of_one_row():
    # logits 2, 1, 0, -1, -5: temperature 0.5 doubles them; top_k 4 drops -5; min_p 0.1 keeps
    # p >= 0.1 · p_max, i.e. 2·logit >= 4 + ln 0.1 = 1.697 → only tokens 0 and 1 survive.
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -5.0]])
    probs = sampling_probs(logits, [SamplingParams(temperature=0.5, top_k=4, min_p=0.1)])
    e = math.exp(-2.0)
    torch.testing.assert_close(probs[0], torch.tensor([1 / (1 + e), e / (1 + e), 0, 0, 0]))
    # top_n_sigma 1: mean -0.6, std sqrt(6.64) = 2.577 → keep logits >= -0.577: tokens 0,1,2.
    probs = sampling_probs(logits, [SamplingParams(top_n_sigma=1.0)])
    z = math.exp(2) + math.exp(1) + 1
    torch.testing.assert_close(probs[0], torch.tensor([math.exp(2) / z, math.exp(1) / z,
                                                       1 / z, 0, 0]))


def test_presence_and_frequency_penalties_hand_computed():
    logits = torch.zeros(1, 6)
    req = make_req([5, 5, 5], [1, 2, 2, 2], presence_penalty=0.5, frequency_penalty=0.25)
    out = process_logits(logits, [req])[0]
    # Output counts: token 1 once, token 2 three times; the prompt's token 5 is not penalised.
    torch.testing.assert_close(out, torch.tensor([0, -0.75, -1.25, 0, 0, 0]))


def test_lz_penalty_hand_computed_and_breaks_a_loop():
    # Tokens 1 2 3 1 2 3 1 2: candidate 3 extends "1 2 3" (3-gram seen twice: -1·2),
    # "3 1 2 3" (4-gram seen once: -2·1) and "2 3 1 2 3" (5-gram seen once: -3·1) → -7·p.
    req = make_req([1, 2, 3, 1, 2, 3], [1, 2], lz_penalty=0.5)
    out = process_logits(torch.zeros(1, 6), [req])[0]
    torch.testing.assert_close(out, torch.tensor([0, 0, 0, -3.5, 0, 0]))
    logits = torch.tensor([[0.0, 0.0, 0.0, 2.0, 0.0, 1.0]])
    assert Sampler()(logits, [make_req([1, 2, 3, 1, 2, 3], [1, 2], temperature=0)]) \
        .token_ids == [3]
    assert Sampler()(logits, [req]).token_ids == [5]


def test_dry_hand_computed_and_breakers_stop_matches():
    # ... 1 2 3 4 1 2 3: candidate 4 would extend the repeat "1 2 3" (m = 3):
    # penalty 1 · 2^(3 - 2) = 2; no other token ever followed a 3.
    seq = [9, 1, 2, 3, 4, 1, 2, 3]
    req = make_req(seq[:4], seq[4:], dry_multiplier=1.0, dry_base=2.0, dry_sequence_breakers=[])
    out = process_logits(torch.zeros(1, 10), [req])[0]
    expected = torch.zeros(10)
    expected[4] = -2.0
    torch.testing.assert_close(out, expected)
    logits = torch.zeros(1, 10)
    logits[0, 4], logits[0, 7] = 2.0, 1.0
    assert Sampler()(logits, [make_req(seq, temperature=0)]).token_ids == [4]
    # The penalty turns the greedy choice from 4 (2 - 2 = 0) to 7.
    penalized = make_req(seq[:4], seq[4:], temperature=0, dry_multiplier=1.0, dry_base=2.0,
                         dry_sequence_breakers=[])
    assert Sampler()(logits, [penalized]).token_ids == [7]
    # Token 2 as a breaker: the match "… 3" cannot extend past it, m = 1 < 2: no penalty.
    broken = make_req(seq[:4], seq[4:], dry_multiplier=1.0, dry_base=2.0,
                      dry_sequence_breakers=[2])
    assert torch.equal(process_logits(torch.zeros(1, 10), [broken])[0], torch.zeros(10))


def test_dry_string_breakers_resolve_through_the_tokenizer():
    class Tok:
        def encode(self, text, add_special_tokens=False):
            return [ord(c) for c in text]

    assert dry_breaker_ids(("\n", ":", 7), Tok()) == {10, 58, 7}
    assert dry_breaker_ids(("\n",), None) == frozenset()


def test_repetition_penalty_changes_the_greedy_choice_and_window_limits_it():
    logits = torch.tensor([[0.0, 3.0, 2.5, 0.0]])
    sampler = Sampler()
    assert sampler(logits, [make_req([1], temperature=0)]).token_ids == [1]
    assert sampler(logits, [make_req([1], temperature=0,
                                     repetition_penalty=1.5)]).token_ids == [2]
    # Token 1 was seen, but outside a window of 2: no penalty.
    far = make_req([1, 3, 3], temperature=0, repetition_penalty=1.5,
                   repetition_penalty_window=2)
    assert sampler(logits, [far]).token_ids == [1]


def test_sampling_leaves_the_callers_logits_as_they_were():
    """Rows without logit edits are read in place (no copy); with edits, or a grammar mask,
    the edits land on a copy: the caller's tensor is the same afterwards either way."""
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(5))
    before = logits.clone()
    sampler = Sampler()
    plain = [make_req([1], rid=str(i), temperature=0) for i in range(3)]
    assert sampler(logits, plain).token_ids == before.argmax(dim=-1).tolist()
    top = int(before[0].argmax())
    banned = make_req([1], temperature=0, logit_bias={top: -100})
    assert process_logits(logits, plain) is logits
    assert sampler(logits[:1], [banned]).token_ids[0] != top
    assert torch.equal(logits, before)


def test_logit_bias_forces_and_bans_tokens():
    logits = torch.randn(8, V, generator=torch.Generator().manual_seed(3))
    sampler = Sampler()
    reqs = [make_req([1], rid=str(i), temperature=1.0, seed=i, logit_bias={17: 100})
            for i in range(8)]
    assert sampler(logits, reqs).token_ids == [17] * 8
    top = int(logits[0].argmax())
    banned = make_req([1], temperature=0, logit_bias={top: -100})
    assert sampler(logits[:1], [banned]).token_ids[0] != top


def test_allowed_token_ids_restrict_sampled_output():
    sampler = Sampler()
    allowed = {4, 9, 33}
    logits = torch.randn(1, V)
    seen = set()
    for s in range(200):
        req = make_req([1], temperature=2.0, seed=s, allowed_token_ids=sorted(allowed))
        seen.add(sampler(logits, [req]).token_ids[0])
    assert seen == allowed


def test_bad_words_ban_single_tokens_and_completions_only():
    logits = torch.zeros(1, V)
    logits[0, 7] = 10.0
    sampler = Sampler()
    assert sampler(logits, [make_req([1], temperature=0, bad_words=[(7,)])]).token_ids[0] != 7
    # (3, 7): 7 is only banned right after 3.
    word = [(3, 7)]
    assert sampler(logits, [make_req([1], [5], temperature=0, bad_words=word)]).token_ids == [7]
    assert sampler(logits, [make_req([1], [3], temperature=0, bad_words=word)]).token_ids != [7]


# ---------------------------------------------------------------- sampling and seeds

def test_seeded_draws_follow_the_processed_distribution_in_a_mixed_batch():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    params = dict(temperature=0.8, top_k=5, top_p=0.95)
    expected = reference_probs(logits[0].tolist(), SamplingParams(**params))
    sampler = Sampler(seed=123)
    counts = [0] * 6
    greedy_tokens = set()
    n = 0
    for call in range(8):
        # Each call: greedy rows interleaved with seeded and unseeded sampled rows.
        reqs = []
        for i in range(250):
            reqs.append(make_req([1], rid=f"g{i}", temperature=0) if i % 5 == 0 else
                        make_req([1], rid=f"a{i}", seed=1000 * call + i, **params))
            reqs.append(make_req([1], rid=f"b{i}", **params))
        out = sampler(logits.repeat(len(reqs), 1), reqs).token_ids
        for r, t in zip(reqs, out, strict=True):
            if r.params.greedy:
                greedy_tokens.add(t)
            else:
                counts[t] += 1
                n += 1
    assert greedy_tokens == {0}
    nz = [t for t in range(6) if expected[t] > 0]
    assert all(counts[t] == 0 for t in range(6) if expected[t] == 0)
    stat = chisquare([counts[t] for t in nz], [expected[t] * n for t in nz])
    assert stat.pvalue > 1e-3, (counts, expected)


def _run_steps(sampler: Sampler, logits_fn, reqs: list[Request], steps: int) -> dict[str, list]:
    out: dict[str, list] = {r.request_id: [] for r in reqs}
    for step in range(steps):
        logits = torch.stack([logits_fn(r.request_id, step) for r in reqs])
        for r, t in zip(reqs, sampler(logits, reqs).token_ids, strict=True):
            r.all_token_ids.append(t)
            out[r.request_id].append(t)
    return out


def test_seeded_request_is_identical_alone_and_in_a_batch_of_16():
    def logits_fn(rid, step):
        seed = (1 + sum(map(ord, rid))) * 100 + step if rid != "me" else step
        return torch.randn(V, generator=torch.Generator().manual_seed(seed))

    me = dict(temperature=1.0, top_p=0.9, repetition_penalty=1.2, presence_penalty=0.5,
              seed=42)
    alone = _run_steps(Sampler(seed=1), logits_fn, [make_req([1, 2], rid="me", **me)], 12)
    mates = [make_req([3], rid=f"m{i}", **MIXED[i % len(MIXED)]) for i in range(15)]
    batch = mates[:9] + [make_req([1, 2], rid="me", **me)] + mates[9:]
    together = _run_steps(Sampler(seed=99), logits_fn, batch, 12)
    assert alone["me"] == together["me"]
    other_seed = _run_steps(Sampler(seed=1), logits_fn,
                            [make_req([1, 2], rid="me", **{**me, "seed": 43})], 12)
    assert other_seed["me"] != alone["me"]


# ---------------------------------------------------------------- validation

@pytest.mark.parametrize("kw,fragment", [
    (dict(min_p=1.5), "min_p: must be in [0, 1]"),
    (dict(top_n_sigma=-1), "top_n_sigma: must be >= 0"),
    (dict(repetition_penalty=0), "repetition_penalty: must be > 0"),
    (dict(repetition_penalty_window=0), "repetition_penalty_window: must be >= 1"),
    (dict(presence_penalty=2.5), "presence_penalty: must be in [-2, 2]"),
    (dict(frequency_penalty=-3), "frequency_penalty: must be in [-2, 2]"),
    (dict(lz_penalty=-1), "lz_penalty: must be >= 0"),
    (dict(dry_multiplier=-1), "dry_multiplier: must be >= 0"),
    (dict(dry_base=1.0), "dry_base: must be > 1"),
    (dict(dry_allowed_length=0), "dry_allowed_length: must be >= 1"),
    (dict(logit_bias={1: 101}), "logit_bias: biases must be in [-100, 100]"),
    (dict(logit_bias={-1: 1}), "logit_bias: token ids must be >= 0"),
    (dict(bad_words=[()]), "bad_words: each entry must be a non-empty"),
    (dict(allowed_token_ids=[]), "allowed_token_ids: must name at least one"),
    (dict(top_k=-2), "top_k"),
    (dict(top_p=0), "top_p: must be in (0, 1]"),
])
def test_invalid_params_name_the_field_and_range(kw, fragment):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kw)
    assert fragment in str(e.value)


def test_params_are_hashable_and_normalised():
    p = SamplingParams(logit_bias={"5": 1, 2: -1.5}, bad_words=[[1, 2]],
                       allowed_token_ids=[3, 4])
    assert p.logit_bias == ((2, -1.5), (5, 1.0))
    assert p.bad_words == ((1, 2),) and p.allowed_token_ids == (3, 4)
    assert p.max_token_id() == 5
    hash(p)


def test_logprobs_are_of_the_raw_model_distribution():
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(4)) * 2
    reqs = [make_req([1, 2], [3], rid="a", temperature=0, logprobs=3, logit_bias={17: 100},
                     repetition_penalty=2.0),
            make_req([1], rid="b", temperature=0.5, top_k=2, logprobs=0, seed=1)]
    res = Sampler()(logits, reqs)
    raw = torch.log_softmax(logits, dim=-1)
    assert res.token_ids[0] == 17
    top3 = raw[0].topk(3).indices.tolist()
    assert set(res.logprobs[0]) == {17, *top3}
    for t, lp in res.logprobs[0].items():
        assert lp == pytest.approx(float(raw[0, t]), abs=1e-6)
    (t, lp), = res.logprobs[1].items()
    assert t == res.token_ids[1] and lp == pytest.approx(float(raw[1, t]), abs=1e-6)
