"""n > 1 choices share their prompt's KV blocks (the prefix cache serves the siblings), and
every block comes back when the request ends."""

from __future__ import annotations

import re


def _blocks_used(http) -> float:
    text = http.get("/metrics").text
    return float(re.search(r"^met_kv_blocks_used\S* (\S+)$", text, re.M).group(1))


def test_n_choices_share_the_prompt_blocks(http):
    prompt = list(range(10, 90))  # 80 tokens = 5 full blocks of 16
    r = http.post("/v1/completions", json={
        "model": "tiny", "prompt": prompt, "max_tokens": 4, "n": 4, "temperature": 1.0,
        "seed": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(body["choices"]) == 4
    # The first choice computes the prompt; its siblings find its 4 full blocks before the
    # last prompt token (a hit never covers the last token) in the cache.
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
    assert body["usage"]["prompt_tokens"] == 80
    assert _blocks_used(http) == 0
