"""repetition_detection as a request field: a looping output stops with finish_reason
"length" and stop_reason "repetition" on the choice (as vLLM reports stop_reason), in
/v1/completions and /v1/chat/completions, streamed or not; bad values get a 400."""

from __future__ import annotations

import json

import pytest

from met import LLM, SamplingParams

MAX_MODEL_LEN = 256
PROMPT = "The keeper"
USER = [{"role": "user", "content": "Where does the keeper write the weather?"}]
RD = {"min_pattern_size": 1, "max_pattern_size": 4, "min_count": 3}
LOOP = {"allowed_token_ids": [40, 41], "temperature": 0, "ignore_eos": True, "max_tokens": 40}





@pytest.fixture(scope="module")
def offline(ckpt):
    return LLM(ckpt, dtype="float32", max_model_len=MAX_MODEL_LEN)


def _offline(offline, prompt, chat=False, **kw):
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                            allowed_token_ids=[40, 41], **kw)
    out = offline.chat(USER, params) if chat else offline.generate([prompt], params)
    return out[0].outputs[0]


def test_completions_loop_stops_with_stop_reason_repetition(http, offline):
    ref = _offline(offline, PROMPT, repetition_detection=RD)
    assert ref.stop_reason == "repetition" and len(ref.token_ids) < 40  # the premise
    r = http.post("/v1/completions", json={"prompt": PROMPT, "repetition_detection": RD,
                                           "logprobs": 0, **LOOP})
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    assert c["finish_reason"] == "length" and c["stop_reason"] == "repetition"
    assert len(c["logprobs"]["tokens"]) == len(ref.token_ids)
    assert r.json()["usage"]["completion_tokens"] == len(ref.token_ids)
    plain = http.post("/v1/completions", json={"prompt": PROMPT, **LOOP}).json()
    assert plain["choices"][0]["stop_reason"] is None
    assert plain["usage"]["completion_tokens"] == 40


def test_chat_loop_stops_streamed_and_not(http, offline):
    ref = _offline(offline, None, chat=True, repetition_detection=RD)
    assert ref.stop_reason == "repetition"  # the premise
    body = {"messages": USER, "repetition_detection": RD, **LOOP}
    r = http.post("/v1/chat/completions", json=body)
    c = r.json()["choices"][0]
    assert c["finish_reason"] == "length" and c["stop_reason"] == "repetition"
    assert c["message"]["content"] == ref.text
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    last = [ch["choices"][0] for ch in chunks if ch["choices"][0]["finish_reason"]]
    assert [(x["finish_reason"], x["stop_reason"]) for x in last] == [("length", "repetition")]
    assert "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks) == ref.text


@pytest.mark.parametrize("rd,param", [
    ({"min_count": 1}, "repetition_detection.min_count"),
    ({"min_pattern_size": 0}, "repetition_detection.min_pattern_size"),
    ({"min_pattern_size": 5, "max_pattern_size": 2}, "repetition_detection.max_pattern_size"),
    ({"min_count": "x"}, "repetition_detection.min_count"),
])
def test_invalid_repetition_detection_gets_400_naming_the_field(http, rd, param):
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2,
                                           "repetition_detection": rd})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
