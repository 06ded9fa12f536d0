"""The proposers and the throughput gate on their own: what prompt lookup and suffix
decoding draft, and when the gate turns speculation off and back on."""

from __future__ import annotations

import pytest

from met.config import EngineConfig, SpeculativeConfig
from met.spec import gate as gate_mod
from met.spec.gate import ThroughputGate
from met.spec.ngram import NgramProposer
from met.spec.suffix import SuffixProposer


def test_ngram_drafts_what_followed_the_longest_earlier_match():
    p = NgramProposer(2, 16)
    #        0  1  2  3  4  5  6  7  8  9
    tokens = [5, 1, 2, 3, 9, 7, 1, 2, 3, 4, 8, 2, 3]
    # The end "8 2 3" matches 2 tokens at two places (ending at 4 and at 9): the most
    # recent wins, and what followed it is [4, 8, 2].
    assert p.propose("r", tokens, 3) == [4, 8, 2]
    tokens += [4]  # now "2 3 4" matches at 10 (the end of 1 2 3 4), length 3
    assert p.propose("r", tokens, 2) == [8, 2]


def test_ngram_needs_the_minimum_match_and_forgets_finished_requests():
    p = NgramProposer(3, 8)
    assert p.propose("r", [1, 2, 9, 1, 2], 4) == []  # only 2 tokens match
    assert p.propose("s", [1, 2, 3, 9, 1, 2, 3], 4) == [9, 1, 2, 3]
    p.finished("s", [1, 2, 3, 9, 1, 2, 3])
    assert "s" not in p._index


def test_ngram_index_grows_with_the_sequence():
    p = NgramProposer(2, 16)
    tokens = [1, 2, 3]
    assert p.propose("r", tokens, 4) == []
    tokens += [1, 2]
    assert p.propose("r", tokens, 4) == [3, 1, 2]


def test_suffix_finds_a_finished_request_and_prefers_the_longer_match():
    p = SuffixProposer(2, 16, keep=2)
    p.finished("a", [10, 11, 12, 13, 14, 15])
    # A new request that starts like the finished one drafts its continuation.
    assert p.propose("b", [7, 11, 12, 13], 2) == [14, 15]
    # Its own earlier text matches only 2 tokens; the finished request matches 3: that wins.
    assert p.propose("c", [12, 13, 99, 11, 12, 13], 2) == [14, 15]
    # Only the last `keep` finished requests are kept.
    p.finished("x", [1, 2, 3])
    p.finished("y", [4, 5, 6])
    assert p.propose("d", [11, 12, 13], 2) == []


def test_config_parses_vllm_keys_and_names_what_is_wrong():
    c = EngineConfig(model="m", speculative_config='{"method": "suffix", '
                                                   '"num_speculative_tokens": 3}')
    assert c.speculative_config == SpeculativeConfig(method="suffix", num_speculative_tokens=3)
    assert EngineConfig(model="m", speculative_config="").speculative_config is None
    for value, named in (({"method": "medusa"}, "speculative_config.method"),
                         ({"prompt_lookup_min": 5, "prompt_lookup_max": 2},
                          "prompt_lookup_min/max"),
                         ({"num_speculative_tokens": "4"},
                          "speculative_config.num_speculative_tokens"),
                         ({"gate": 1}, "speculative_config.gate"),
                         ({"modle": "x"}, "unknown keys ['modle']"),
                         ({"method": "ngram", "model": "x"}, "speculative_config.model"),
                         ({"method": "draft_model"}, "speculative_config.model"),
                         ({"method": "ngram", "num_draft_layers": 2},
                          "num_draft_layers: only for method self"),
                         ("[1]", "must be a JSON object")):
        with pytest.raises(ValueError, match=named.replace("[", r"\[").replace("]", r"\]")):
            SpeculativeConfig.parse(value)


def _window(gate: ThroughputGate, width: int, tok_per_s: float) -> None:
    for _ in range(gate_mod.WINDOW_STEPS):
        gate.record(width, int(tok_per_s), 1.0)


def test_gate_turns_speculation_off_where_it_is_slower_and_probes_it_again():
    g = ThroughputGate()
    assert g.on(1)  # it starts speculating
    _window(g, 1, 100)  # on: 100 tok/s
    assert not g.on(1)  # then measures off
    _window(g, 1, 150)  # off is faster
    assert not g.on(1)
    for _ in range(gate_mod.EXPLOIT_WINDOWS - 2):
        _window(g, 1, 150)
        assert not g.on(1)
    _window(g, 1, 150)
    assert g.on(1)  # a probe of speculation
    _window(g, 1, 400)  # now it pays (the text began to repeat)
    assert g.on(1)
    # A probe that loses makes the next one wait twice as long.
    g2 = ThroughputGate()
    _window(g2, 1, 100)
    _window(g2, 1, 150)  # off wins
    waits = []
    for _ in range(3):
        n = 0
        while not g2.on(1):
            _window(g2, 1, 150)
            n += 1
        waits.append(n)
        _window(g2, 1, 50)  # the probe loses
    e = gate_mod.EXPLOIT_WINDOWS
    assert waits == [e - 1, 2 * e, 4 * e], waits
    # Buckets are independent: a wide batch measures its own modes.
    assert g.on(32)
    assert ThroughputGate(enabled=False).on(1)
