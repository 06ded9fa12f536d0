"""Beam search over HTTP: the same beams as transformers, n best, and clear 400s."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def hf(ckpt):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32,
                                                attn_implementation="eager").eval()


def _hf_beams(hf, prompt, num_beams, max_new, **kw):
    eos = hf.generation_config.eos_token_id
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_new, num_beams=num_beams,
                          num_return_sequences=num_beams, do_sample=False, pad_token_id=eos,
                          **kw)
    return [row[len(prompt):] for row in out.tolist()]


def test_completions_beams_equal_transformers(http, hf):
    prompt = http.post("/tokenize", json={"prompt": "The tiny model says"}).json()["tokens"]
    r = http.post("/v1/completions", json={
        "model": "tiny", "prompt": prompt, "max_tokens": 8, "num_beams": 3, "n": 3,
        "length_penalty": 0.5, "early_stopping": True, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    want = _hf_beams(hf, prompt, 3, 8, length_penalty=0.5, early_stopping=True)
    got = [http.post("/tokenize", json={"prompt": c["text"], "add_special_tokens": False})
           .json()["tokens"] for c in body["choices"]]
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    # Token ids round-trip through text only when the tokenizer is lossless for them;
    # compare the texts transformers' beams decode to instead.
    want_text = [http.post("/detokenize", json={"tokens": w}).json()["prompt"] for w in want]
    assert [c["text"] for c in body["choices"]] == want_text, (got, want)
    assert body["usage"]["completion_tokens"] == sum(len(w) for w in want)
    assert all(c["finish_reason"] == "length" for c in body["choices"])


def test_chat_beam_search_returns_n_best(client):
    resp = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6, n=2,
        extra_body={"num_beams": 4})
    assert len(resp.choices) == 2
    assert resp.choices[0].message.content != resp.choices[1].message.content


@pytest.mark.parametrize("body, param", [
    ({"num_beams": 2, "stream": True}, "stream"),
    ({"num_beams": 2, "n": 3}, "n"),
    ({"num_beams": 0}, "num_beams"),
    ({"num_beams": 99}, "num_beams"),
    ({"num_beams": 2, "logprobs": 2}, "logprobs"),
    ({"num_beams": 2, "structured_outputs": {"choice": ["a"]}}, "structured_outputs"),
    ({"num_beams": 2, "early_stopping": "sometimes"}, "early_stopping"),
])
def test_bad_beam_requests_are_400(http, body, param):
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 4,
                                           **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object"}}}]}, "tools"),
    ({"reasoning_effort": "low"}, "reasoning_effort"),
])
def test_chat_fields_beams_cannot_honour_are_400(http, body, param):
    r = http.post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
        "num_beams": 2, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
