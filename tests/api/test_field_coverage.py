"""No silently ignored field: each field the OpenAI and Anthropic APIs define works or is
refused with a 400 naming it (best_of, suffix, stream_options.continuous_usage_stats,
cache_salt, chat prompt_logprobs, the fields met has no machinery for), and a field no API
defines is accepted, logged and named in the x-met-ignored-fields header (vLLM's rule)."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import tiny_models
from transformers import AutoTokenizer

from tests.api.in_process import run_with_app

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 4, "temperature": 0.0}
PROMPT = list(range(20, 60))  # 40 tokens: 2 full blocks of 16 before the last one


def _events(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


# ------------------------------------------------------------------ unknown fields


def test_unknown_fields_are_accepted_logged_and_named_in_a_header(ckpt, caplog):
    caplog.set_level(logging.WARNING, logger="met.api")

    async def work(client):
        body = {**CHAT, "foo": 1, "messages": [{"role": "user", "content": "hi", "bar": 2}]}
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.headers["x-met-ignored-fields"] == "foo,messages.0.bar"
        r = await client.post("/v1/chat/completions", json={**body, "stream": True})
        assert r.headers["x-met-ignored-fields"] == "foo,messages.0.bar"
        r = await client.post("/v1/chat/completions", json=CHAT)
        assert "x-met-ignored-fields" not in r.headers
        # Names that could break or split the header arrive percent-encoded.
        r = await client.post("/v1/chat/completions", json={**CHAT, "a\r\nb,c": 1, "\u0000": 2})
        assert r.status_code == 200 and r.headers["x-met-ignored-fields"] == "%00,a%0D%0Ab%2Cc"
        r = await client.post("/v1/completions", json={
            "model": "tiny", "prompt": "hi", "max_tokens": 2,
            "stream_options": None, "frobnicate": True})
        assert r.status_code == 200 and r.headers["x-met-ignored-fields"] == "frobnicate"
        r = await client.post("/v1/messages", json={
            "model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}],
            "system": [{"type": "text", "text": "Be brief.",
                        "cache_control": {"type": "ephemeral"}}],  # defined: cached anyway
            "zap": 1})
        assert r.status_code == 200 and r.headers["x-met-ignored-fields"] == "zap"

    run_with_app(ckpt, None, work)
    warned = [r.message for r in caplog.records if "ignored unknown fields" in r.message]
    assert any("foo, messages.0.bar" in m for m in warned)


# ------------------------------------------------------------------ OpenAI fields met lacks


@pytest.mark.parametrize("field,value", [
    ("audio", {"voice": "alloy", "format": "wav"}), ("modalities", ["text", "audio"]),
    ("prediction", {"type": "content", "content": "x"}), ("store", True),
    ("functions", [{"name": "f", "parameters": {}}]), ("function_call", "auto"),
    ("web_search_options", {}), ("service_tier", "flex"), ("verbosity", "low")])
def test_openai_chat_fields_without_machinery_are_refused_by_name(ckpt, field, value):
    async def work(client):
        r = await client.post("/v1/chat/completions", json={**CHAT, field: value})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == field
        return r

    run_with_app(ckpt, None, work)


def test_openai_fields_that_ask_for_nothing_are_accepted(ckpt):
    async def work(client):
        r = await client.post("/v1/chat/completions", json={
            **CHAT, "modalities": ["text"], "store": False, "service_tier": "auto",
            "metadata": {"k": "v"}, "user": "u1", "prompt_cache_key": "k",
            "safety_identifier": "s"})
        assert r.status_code == 200, r.text
        assert "x-met-ignored-fields" not in r.headers

    run_with_app(ckpt, None, work)


def test_anthropic_and_responses_fields_without_machinery_are_refused(ckpt):
    async def work(client):
        msg = {"model": "tiny", "max_tokens": 4,
               "messages": [{"role": "user", "content": "hi"}]}
        r = await client.post("/v1/messages", json={
            **msg, "mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]})
        assert r.status_code == 400 and "mcp_servers" in r.json()["error"]["message"]
        r = await client.post("/v1/messages", json={**msg, "output_config": {"effort": "low"}})
        assert r.status_code == 400 and "output_config.effort" in r.json()["error"]["message"]
        r = await client.post("/v1/messages", json={**msg, "service_tier": "auto"})
        assert r.status_code == 200, r.text
        resp = {"input": "hi", "max_output_tokens": 4}
        r = await client.post("/v1/responses", json={**resp, "background": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "background"
        r = await client.post("/v1/responses", json={
            **resp, "reasoning": {"summary": "detailed"}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning.summary"

    run_with_app(ckpt, None, work)


# ------------------------------------------------------------------ cache_salt


def test_cache_salt_keeps_prefix_kv_apart(ckpt):
    async def work(client):
        async def cached(**extra) -> int:
            r = await client.post("/v1/completions", json={
                "model": "tiny", "prompt": PROMPT, "max_tokens": 2, **extra})
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        assert await cached(cache_salt="alice") == 0
        assert await cached(cache_salt="alice") == 32
        assert await cached(cache_salt="bob") == 0  # another salt never shares KV
        assert await cached() == 0  # nor does no salt
        assert await cached() == 32
        r = await client.post("/v1/chat/completions", json={**CHAT, "cache_salt": ""})
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
        r = await client.post("/v1/chat/completions", json={**CHAT, "cache_salt": "alice"})
        assert r.status_code == 200

    run_with_app(ckpt, None, work)


# ------------------------------------------------------------------ continuous_usage_stats


def test_continuous_usage_stats_puts_usage_on_every_chunk(ckpt):
    async def work(client):
        for path, body in (("/v1/completions", {"model": "tiny", "prompt": PROMPT}),
                           ("/v1/chat/completions", CHAT)):
            r = await client.post(path, json={
                **body, "max_tokens": 6, "ignore_eos": True, "stream": True,
                "stream_options": {"continuous_usage_stats": True}})
            events = _events(r.text)
            assert events and all(e.get("usage") for e in events), (path, events)
            done = [e["usage"]["completion_tokens"] for e in events]
            assert done == sorted(done) and done[-1] == 6
            assert events[-1]["choices"] == []  # the final usage chunk
            r = await client.post(path, json={**body, "stream_options": {
                "include_usage": True}})
            assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"

    run_with_app(ckpt, None, work)


# ------------------------------------------------------------------ chat prompt_logprobs


def test_chat_prompt_logprobs_match_completions_on_the_rendered_prompt(ckpt):
    async def work(client):
        r = await client.post("/v1/chat/completions", json={**CHAT, "prompt_logprobs": 2})
        assert r.status_code == 200, r.text
        chat = r.json()["prompt_logprobs"]
        ids = (await client.post("/tokenize", json={
            "messages": CHAT["messages"]})).json()["tokens"]
        assert len(chat) == len(ids) == r.json()["usage"]["prompt_tokens"]
        r = await client.post("/v1/completions", json={
            "model": "tiny", "prompt": ids, "max_tokens": 1, "prompt_logprobs": 2})
        assert chat == r.json()["choices"][0]["prompt_logprobs"]
        assert chat[0] is None and all(len(e) >= 2 for e in chat[1:])
        r = await client.post("/v1/chat/completions", json={
            **CHAT, "prompt_logprobs": 2, "stream": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
        r = await client.post("/v1/chat/completions", json={**CHAT, "prompt_logprobs": 99})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"

    run_with_app(ckpt, None, work)


# ------------------------------------------------------------------ best_of


def test_best_of_returns_the_candidates_with_the_highest_logprob_sum(ckpt):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 1.0,
            "seed": 11, "ignore_eos": True}

    async def work(client):
        r = await client.post("/v1/completions", json={**body, "n": 4, "logprobs": 0})
        cands = r.json()["choices"]
        scores = [sum(c["logprobs"]["token_logprobs"]) for c in cands]
        ranked = [cands[i]["text"] for i in sorted(range(4), key=lambda i: -scores[i])]
        assert len(set(ranked)) > 1  # the candidates differ: the choice means something
        r = await client.post("/v1/completions", json={**body, "n": 2, "best_of": 4})
        assert r.status_code == 200, r.text
        out = r.json()
        assert [c["text"] for c in out["choices"]] == ranked[:2]
        assert [c["index"] for c in out["choices"]] == [0, 1]
        assert out["choices"][0]["logprobs"] is None  # not asked for: not returned
        assert out["usage"]["completion_tokens"] == 4 * 8  # every candidate ran
        for bad in ({"n": 3, "best_of": 2}, {"best_of": 3, "stream": True},
                    {"best_of": 500}):
            r = await client.post("/v1/completions", json={**body, **bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == "best_of", bad

    run_with_app(ckpt, None, work)


# ------------------------------------------------------------------ suffix (FIM)


FIM = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")


@pytest.fixture(scope="module")
def fim_ckpt(ckpt, tmp_path_factory, monkeypatch_module):
    """The tiny Llama with a tokenizer that has Qwen's FIM tokens (same vocabulary size)."""
    out = tmp_path_factory.mktemp("tiny-fim")
    shutil.copytree(ckpt, out, dirs_exist_ok=True)
    monkeypatch_module.setattr(tiny_models, "SPECIAL_TOKENS",
                               [*tiny_models.SPECIAL_TOKENS, *FIM])
    tok = tiny_models.build_tokenizer(tiny_models.VOCAB["llama"], add_bos=False)
    tok.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_suffix_fills_in_the_middle_where_the_tokenizer_has_fim_tokens(fim_ckpt):
    tok = AutoTokenizer.from_pretrained(fim_ckpt)
    prefix, suffix = "def add(a, b):\n", "\n    return c\n"
    fim_text = f"{FIM[0]}{prefix}{FIM[1]}{suffix}{FIM[2]}"
    ids = tok(fim_text, add_special_tokens=False)["input_ids"]
    assert [t for t in ids if t in tok.convert_tokens_to_ids(list(FIM))] == \
        tok.convert_tokens_to_ids(list(FIM))
    greedy = {"model": "tiny", "max_tokens": 6, "temperature": 0.0, "ignore_eos": True}

    async def work(client):
        r = await client.post("/v1/completions", json={**greedy, "prompt": prefix,
                                                       "suffix": suffix})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(ids)
        same = await client.post("/v1/completions", json={**greedy, "prompt": ids})
        assert r.json()["choices"][0]["text"] == same.json()["choices"][0]["text"]
        r = await client.post("/v1/completions", json={**greedy, "prompt": prefix,
                                                       "suffix": suffix, "echo": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "suffix"

    run_with_app(fim_ckpt, None, work)


def test_suffix_without_fim_tokens_is_refused_by_name(ckpt):
    async def work(client):
        r = await client.post("/v1/completions", json={
            "model": "tiny", "prompt": "def f(", "suffix": "return 1", "max_tokens": 4})
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["param"] == "suffix" and "fill-in-the-middle" in err["message"]

    run_with_app(ckpt, None, work)
