"""The offline ``LLM.generate`` / ``LLM.chat`` and the server give the same answers for the same
request: n, best_of, stop strings, logprobs, structured outputs, tools (issue 36, part 7).
Both run the serving layer's own code (met.serving.generate / chat_request), so these tests
compare the outputs a user sees: texts, token ids, logprobs, parsed tool calls."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "api"))
from chat_templates import QWEN3_STYLE_TEMPLATE  # noqa: E402
from in_process import run_with_app  # noqa: E402

from met import LLM, SamplingParams, StructuredOutputs  # noqa: E402

MAX_MODEL_LEN = 512
PROMPT = "The quick brown fox"
SCHEMA = {"type": "object", "properties": {
    "city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"]}
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": SCHEMA}}
TIME = {"type": "function", "function": {"name": "time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
USER = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return str(tiny_checkpoint("qwen3"))


@pytest.fixture(scope="module")
def offline(ckpt):
    return LLM(ckpt, dtype="float32", max_model_len=MAX_MODEL_LEN)


def served(ckpt: str, path: str, body: dict) -> dict:
    """POST ``body`` to ``path`` on an in-process server over the same checkpoint."""
    async def work(client):
        r = await client.post(path, json={"model": "tiny", **body})
        assert r.status_code == 200, r.text
        return r.json()
    return run_with_app(ckpt, QWEN3_STYLE_TEMPLATE, work, max_model_len=MAX_MODEL_LEN)


def test_n_seeded_samples_match_the_server(offline, ckpt):
    body = {"prompt": PROMPT, "n": 3, "seed": 7, "temperature": 1.0, "max_tokens": 12}
    http = served(ckpt, "/v1/completions", body)
    out, = offline.generate(PROMPT, SamplingParams(n=3, seed=7, temperature=1.0,
                                                   max_tokens=12))
    assert [c.index for c in out.outputs] == [0, 1, 2]
    texts = [c.text for c in out.outputs]
    assert texts == [c["text"] for c in sorted(http["choices"], key=lambda c: c["index"])]
    assert len(set(texts)) > 1  # seed + index: the choices differ
    assert all(len(c.token_ids) == 12 for c in out.outputs)


def test_best_of_keeps_the_highest_cumulative_logprob(offline, ckpt):
    body = {"prompt": PROMPT, "n": 1, "best_of": 3, "seed": 3, "temperature": 1.0,
            "max_tokens": 10, "logprobs": 0}
    http = served(ckpt, "/v1/completions", body)
    out, = offline.generate(PROMPT, SamplingParams(n=1, best_of=3, seed=3, temperature=1.0,
                                                   max_tokens=10, logprobs=0))
    best, = out.outputs
    assert best.text == http["choices"][0]["text"]
    candidates, = offline.generate(PROMPT, SamplingParams(n=3, seed=3, temperature=1.0,
                                                          max_tokens=10, logprobs=0))
    scores = [c.cumulative_logprob for c in candidates.outputs]
    assert best.cumulative_logprob == pytest.approx(max(scores))
    assert best.text == candidates.outputs[scores.index(max(scores))].text


def test_stop_strings_cut_text_and_tokens_as_the_server(offline, ckpt):
    full, = offline.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24))
    text = full.outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop.strip(), text
    params = dict(temperature=0, max_tokens=24, stop=[stop])
    http = served(ckpt, "/v1/completions", {"prompt": PROMPT, **params})
    out, = offline.generate(PROMPT, SamplingParams(**params))
    c = out.outputs[0]
    assert c.text == http["choices"][0]["text"] == text[:text.index(stop)]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert http["choices"][0]["stop_reason"] == stop
    # The tokens stop at the one that completed the stop string.
    assert c.token_ids == full.outputs[0].token_ids[:len(c.token_ids)]
    assert len(c.token_ids) == http["usage"]["completion_tokens"] < 24
    kept, = offline.generate(PROMPT, SamplingParams(**params, include_stop_str_in_output=True))
    assert kept.outputs[0].text == text[:text.index(stop) + len(stop)]


def test_logprobs_match_the_server(offline, ckpt):
    params = dict(temperature=0, max_tokens=8, logprobs=3)
    http = served(ckpt, "/v1/completions", {"prompt": PROMPT, **params})
    out, = offline.generate(PROMPT, SamplingParams(**params))
    c = out.outputs[0]
    lp = http["choices"][0]["logprobs"]
    assert len(c.logprobs) == len(lp["token_logprobs"]) == 8
    for tid, entry, served_lp in zip(c.token_ids, c.logprobs, lp["token_logprobs"],
                                     strict=True):
        assert math.isclose(entry[tid], served_lp, abs_tol=1e-4)
    assert c.cumulative_logprob == pytest.approx(sum(lp["token_logprobs"]), abs=1e-3)


def test_json_schema_structured_output_matches_the_server(offline, ckpt):
    body = {"prompt": PROMPT, "temperature": 0, "max_tokens": 40,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "w", "schema": SCHEMA}}}
    http = served(ckpt, "/v1/completions", body)
    out, = offline.generate(PROMPT, SamplingParams(
        temperature=0, max_tokens=40, structured_outputs=StructuredOutputs(json=SCHEMA)))
    text = out.outputs[0].text
    assert text == http["choices"][0]["text"]
    assert json.loads(text)["city"] in ("Paris", "Oslo")


def test_chat_with_required_tools_parses_the_same_calls(offline, ckpt):
    body = {"messages": USER, "tools": [WEATHER, TIME], "tool_choice": "required",
            "parallel_tool_calls": False, "max_tokens": 100, "temperature": 0,
            "chat_template_kwargs": {"enable_thinking": False}}
    http = served(ckpt, "/v1/chat/completions", body)
    out, = offline.chat(USER, SamplingParams(temperature=0, max_tokens=100),
                        chat_template=QWEN3_STYLE_TEMPLATE, tools=[WEATHER, TIME],
                        tool_choice="required", parallel_tool_calls=False,
                        chat_template_kwargs={"enable_thinking": False})
    c = out.outputs[0]
    choice = http["choices"][0]
    assert c.tool_calls == [{"name": t["function"]["name"],
                             "arguments": t["function"]["arguments"]}
                            for t in choice["message"]["tool_calls"]]
    assert c.tool_calls and c.tool_calls[0]["name"] in ("weather", "time")
    assert "<tool_call>" not in c.text
    assert c.finish_reason == choice["finish_reason"] == "tool_calls"
    assert c.text == (choice["message"]["content"] or "")


def test_chat_reasoning_split_matches_the_server(offline, ckpt):
    body = {"messages": USER, "max_tokens": 30, "temperature": 0}
    http = served(ckpt, "/v1/chat/completions", body)
    out, = offline.chat(USER, SamplingParams(temperature=0, max_tokens=30),
                        chat_template=QWEN3_STYLE_TEMPLATE)
    message = http["choices"][0]["message"]
    assert out.outputs[0].reasoning_content == message.get("reasoning_content")
    assert out.outputs[0].text == (message["content"] or "")


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"n": 0}, "n"), ({"n": 2, "best_of": 1}, "best_of"), ({"stop": [""]}, "stop")])
def test_bad_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        SamplingParams(**kwargs)


def test_bad_tools_name_the_field_as_the_server(offline):
    with pytest.raises(ValueError, match="tools.0.type"):
        offline.chat(USER, chat_template=QWEN3_STYLE_TEMPLATE, tools=[{"type": "x"}])
    with pytest.raises(ValueError, match="tool_choice"):
        offline.chat(USER, chat_template=QWEN3_STYLE_TEMPLATE, tools=[WEATHER],
                     tool_choice={"type": "function", "function": {"name": "nope"}})


def test_a_bad_prompt_leaves_no_request_behind(offline):
    """The prompts before a refused one are taken back, as the server admits all or none."""
    with pytest.raises(ValueError, match="max_tokens"):
        offline.generate([PROMPT, "x " * 400], SamplingParams(max_tokens=200))
    assert not offline.engine.has_unfinished()
    assert offline.kv_stats().num_blocks_in_use == 0
