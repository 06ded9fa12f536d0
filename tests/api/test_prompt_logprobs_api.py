"""prompt_logprobs on /v1/completions: with echo + logprobs the echoed prompt tokens carry
logprobs (the first None), and the explicit ``prompt_logprobs`` field returns vLLM's
per-token dicts; values equal the offline engine's (checked against transformers in
tests/sampling/test_prompt_logprobs.py)."""

from __future__ import annotations

import pytest

from met import LLM, SamplingParams

MAX_MODEL_LEN = 256
PROMPT = "The keeper writes the weather in the book"





@pytest.fixture(scope="module")
def offline(ckpt):
    llm = LLM(ckpt, dtype="float32", max_model_len=MAX_MODEL_LEN)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=3, temperature=0.0,
                                                prompt_logprobs=2))[0]
    return llm, out


def test_echo_with_logprobs_covers_the_prompt_tokens(http, offline):
    llm, ref = offline
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3,
                                           "temperature": 0, "echo": True, "logprobs": 2})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    ids = ref.prompt_token_ids
    n = len(ids)
    assert len(lp["tokens"]) == n + 3
    assert lp["tokens"][:n] == [llm.tokenizer.decode([t]) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    want = [e[t] for t, e in zip(ids[1:], ref.prompt_logprobs[1:], strict=True)]
    assert lp["token_logprobs"][1:n] == pytest.approx(want, abs=1e-5)
    assert all(len(top) <= 2 for top in lp["top_logprobs"][1:])
    assert lp["text_offset"][0] == 0 and lp["text_offset"][n] == len(PROMPT)
    assert r.json()["choices"][0]["text"].startswith(PROMPT)


def test_prompt_logprobs_field_in_vllm_shape(http, offline):
    llm, ref = offline
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2,
                                           "temperature": 0, "prompt_logprobs": 2})
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    assert c["logprobs"] is None
    pl = c["prompt_logprobs"]
    ids = ref.prompt_token_ids
    assert len(pl) == len(ids) and pl[0] is None
    for t, got, want in zip(ids[1:], pl[1:], ref.prompt_logprobs[1:], strict=True):
        assert got[str(t)]["logprob"] == pytest.approx(want[t], abs=1e-5)
        assert got[str(t)]["decoded_token"] == llm.tokenizer.decode([t])
        ranked = sorted((v["rank"], int(k)) for k, v in got.items() if v["rank"] is not None)
        assert [rank for rank, _ in ranked] == [1, 2]
        best = max(want, key=want.get)
        assert ranked[0][1] == best


@pytest.mark.parametrize("fields,fragment", [
    ({"prompt_logprobs": 21}, "[0, 20]"),
    ({"prompt_logprobs": -1}, "[0, 20]"),
    ({"prompt_logprobs": 1, "stream": True}, "stream"),
])
def test_invalid_prompt_logprobs_get_400(http, fields, fragment):
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, **fields})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "prompt_logprobs" and fragment in err["message"], err
