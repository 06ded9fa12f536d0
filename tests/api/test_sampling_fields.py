"""The sampler's request fields through `met serve` with the openai SDK: each is accepted,
validated (400 naming the field and range) and has an effect a user would notice; logprobs
come back in OpenAI's chat and completions shapes."""

from __future__ import annotations

import math

import pytest

from met import LLM, SamplingParams

MAX_MODEL_LEN = 256
PROMPT = "The keeper"
USER = [{"role": "user", "content": "Where does the keeper write the weather?"}]




@pytest.fixture(scope="module")
def offline(ckpt):
    return LLM(ckpt, dtype="float32", max_model_len=MAX_MODEL_LEN)




def complete(client, **kw):
    extra = {k: kw.pop(k) for k in list(kw) if k in EXTRA}
    return client.completions.create(model="tiny", prompt=kw.pop("prompt", PROMPT),
                                     extra_body=extra, **kw).choices[0]


EXTRA = {"min_p", "top_n_sigma", "repetition_penalty", "repetition_penalty_window", "top_k",
         "bad_words", "allowed_token_ids", "min_tokens", "lz_penalty",
         "dry_multiplier", "dry_base", "dry_allowed_length", "dry_sequence_breakers"}


def token_ids(offline: LLM, prompt: str, **kw) -> list[int]:
    return offline.generate([prompt], SamplingParams(**kw))[0].outputs[0].token_ids


def test_logit_bias_forces_a_token_through_the_sdk(client, offline):
    tok = offline.tokenizer
    forced = tok.encode(" keeper", add_special_tokens=False)[0]
    c = complete(client, max_tokens=6, temperature=1.0, seed=3, logit_bias={str(forced): 100},
                 logprobs=1)
    assert c.logprobs.tokens == [tok.decode([forced])] * 6
    # Logprobs are of the raw model distribution: the bias does not make the token certain.
    assert all(lp < -1e-3 for lp in c.logprobs.token_logprobs)


def test_allowed_token_ids_restrict_sampled_output(client, offline):
    tok = offline.tokenizer
    allowed = sorted(set(tok.encode(" the sea and the light", add_special_tokens=False)))
    c = complete(client, max_tokens=24, temperature=1.5, seed=7, allowed_token_ids=allowed,
                 logprobs=0)
    texts = {tok.decode([t]) for t in allowed}
    assert set(c.logprobs.tokens) <= texts
    assert len(set(c.logprobs.tokens)) > 1


def test_penalties_change_greedy_output_as_offline(client, offline):
    plain = token_ids(offline, PROMPT, max_tokens=64, temperature=0.0)
    assert len(set(plain)) < len(plain)  # greedy repeats itself on this model
    for field, value in [("repetition_penalty", 3.0), ("frequency_penalty", 2.0),
                         ("presence_penalty", 2.0), ("lz_penalty", 1.0),
                         ("dry_multiplier", 3.0)]:
        ref = token_ids(offline, PROMPT, max_tokens=64, temperature=0.0, **{field: value})
        assert ref != plain, field
        got = complete(client, max_tokens=64, temperature=0, logprobs=0, **{field: value})
        assert got.logprobs.tokens == [offline.tokenizer.decode([t]) for t in ref], field


def test_bad_words_block_token_sequences_and_strings(client, offline):
    plain = token_ids(offline, PROMPT, max_tokens=8, temperature=0.0)
    c = complete(client, max_tokens=8, temperature=0, bad_words=[[plain[0]]], logprobs=0)
    assert c.logprobs.tokens[0] != offline.tokenizer.decode([plain[0]])
    # A string bans its tokenization with and without a leading space.
    tok = offline.tokenizer
    plain_out = offline.generate([PROMPT], SamplingParams(max_tokens=24, temperature=0.0))[0] \
        .outputs[0]
    plain_text = plain_out.text
    word = next(w for w in (tok.decode([t]).strip() for t in plain_out.token_ids) if w.isalpha())
    variants = [tuple(tok.encode(v, add_special_tokens=False)) for v in (word, " " + word)]
    ref = offline.generate([PROMPT], SamplingParams(max_tokens=24, temperature=0.0,
                                                    bad_words=variants))[0].outputs[0]
    for v in variants:
        assert not any(tuple(ref.token_ids[i:i + len(v)]) == v for i in range(24))
    assert ref.text != plain_text
    assert complete(client, max_tokens=24, temperature=0, bad_words=[word]).text == ref.text


def test_min_p_top_n_sigma_near_zero_are_greedy(client, offline):
    greedy = complete(client, max_tokens=12, temperature=0).text
    for field, value in [("min_p", 1.0), ("top_n_sigma", 1e-6)]:
        # Only the most likely token survives: any seed gives the greedy text.
        texts = {complete(client, max_tokens=12, temperature=1.5, seed=s, **{field: value}).text
                 for s in range(3)}
        assert texts == {greedy}, field


def test_chat_logprobs_shape_and_values_match_offline(client, offline):
    r = client.chat.completions.create(model="tiny", messages=USER, max_tokens=8,
                                       temperature=0, logprobs=True, top_logprobs=3)
    ref = offline.chat(USER, SamplingParams(max_tokens=8, temperature=0.0, logprobs=3))[0]
    content = r.choices[0].logprobs.content
    out = ref.outputs[0]
    assert len(content) == len(out.token_ids) == 8
    for item, t, entry in zip(content, out.token_ids, out.logprobs, strict=True):
        assert item.token == offline.tokenizer.decode([t])
        assert item.bytes == list(item.token.encode())
        assert item.logprob == pytest.approx(entry[t], abs=1e-4)
        tops = item.top_logprobs
        assert len(tops) == 3
        assert [x.logprob for x in tops] == sorted((x.logprob for x in tops), reverse=True)
        assert tops[0].token == item.token  # greedy: the chosen token is the most likely
        assert sum(math.exp(x.logprob) for x in tops) <= 1 + 1e-5
    # Streamed: the chunks' logprobs concatenate to the same list.
    chunks = list(client.chat.completions.create(
        model="tiny", messages=USER, max_tokens=8, temperature=0, logprobs=True,
        top_logprobs=3, stream=True))
    streamed = [x for c in chunks if c.choices and c.choices[0].logprobs
                for x in c.choices[0].logprobs.content]
    assert [(x.token, round(x.logprob, 5)) for x in streamed] == \
        [(x.token, round(x.logprob, 5)) for x in content]
    # Not asked for: null.
    plain = client.chat.completions.create(model="tiny", messages=USER, max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_completions_logprobs_shape(client, offline):
    c = complete(client, max_tokens=10, temperature=0, logprobs=2)
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 10
    assert len(lp.text_offset) == 10 and lp.text_offset[0] == 0
    assert lp.text_offset == sorted(lp.text_offset)
    ref = token_ids(offline, PROMPT, max_tokens=10, temperature=0.0)
    assert lp.tokens == [offline.tokenizer.decode([t]) for t in ref]  # special tokens too
    for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        # Keyed by text (OpenAI's shape): byte tokens that all decode to U+FFFD collide.
        assert len(top) in (1, 2) and tok in top
        assert all(value >= v - 1e-5 for v in top.values())  # greedy: the most likely
    echo = complete(client, max_tokens=3, temperature=0, logprobs=1, echo=True)
    # The echoed prompt's tokens come first (the first has no logprob), then the output's.
    assert echo.logprobs.token_logprobs[0] is None and echo.logprobs.text_offset[0] == 0
    assert echo.logprobs.text_offset[-3] == len(PROMPT)
    # Streamed: chunks' logprobs concatenate to the non-stream ones, offsets included.
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10,
                                            temperature=0, logprobs=2, stream=True))
    parts = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for p in parts for t in p.tokens] == lp.tokens
    assert [o for p in parts for o in p.text_offset] == lp.text_offset
    assert [v for p in parts for v in p.token_logprobs] == pytest.approx(lp.token_logprobs)


BAD = [
    ("/v1/completions", {"min_p": 1.5}, "min_p", "[0, 1]"),
    ("/v1/completions", {"top_n_sigma": -1}, "top_n_sigma", ">= 0"),
    ("/v1/completions", {"repetition_penalty": 0}, "repetition_penalty", "(0, 10]"),
    ("/v1/completions", {"repetition_penalty_window": 0}, "repetition_penalty_window", ">= 1"),
    ("/v1/completions", {"presence_penalty": 2.5}, "presence_penalty", "[-2, 2]"),
    ("/v1/chat/completions", {"frequency_penalty": -3}, "frequency_penalty", "[-2, 2]"),
    ("/v1/completions", {"lz_penalty": -0.5}, "lz_penalty", ">= 0"),
    ("/v1/completions", {"dry_multiplier": -1}, "dry_multiplier", ">= 0"),
    ("/v1/chat/completions", {"dry_base": 1}, "dry_base", "(1, 10]"),
    ("/v1/completions", {"dry_allowed_length": 0}, "dry_allowed_length", ">= 1"),
    ("/v1/completions", {"logit_bias": {"abc": 1}}, "logit_bias", "token ids"),
    ("/v1/chat/completions", {"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
    ("/v1/completions", {"logit_bias": {"999999": 1}}, "logit_bias", "vocabulary"),
    ("/v1/completions", {"allowed_token_ids": []}, "allowed_token_ids", "at least one"),
    ("/v1/chat/completions", {"allowed_token_ids": [999999]}, "allowed_token_ids",
     "vocabulary"),
    ("/v1/completions", {"bad_words": [[999999]]}, "bad_words", "vocabulary"),
    ("/v1/completions", {"bad_words": [""]}, "bad_words", "non-empty"),
    ("/v1/completions", {"bad_words": ["  "]}, "bad_words", "non-empty"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs",
     "[0, 20]"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs", "requires logprobs"),
    ("/v1/completions", {"logprobs": 21}, "logprobs", "[0, 20]"),
]


@pytest.mark.parametrize("path,fields,param,fragment", BAD)
def test_invalid_sampling_fields_get_400_naming_the_field(http, path, fields, param,
                                                          fragment):
    base = {"messages": USER} if "chat" in path else {"prompt": PROMPT}
    r = http.post(path, json={**base, "max_tokens": 2, **fields})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and fragment in err["message"], err
