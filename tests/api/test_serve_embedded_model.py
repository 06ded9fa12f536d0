"""`met serve` with no MODEL: the embedded SmolLM2-135M-Instruct, driven with the openai SDK.
Real text makes stop strings, UTF-8 and chat templates meaningful."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow

NAME = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server(start_server):
    # float32, the exact reference: the answers checked below are float32's.
    return start_server(["--dtype", "float32", "--max-model-len", "2048", "--max-num-seqs", "8"])


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=300)


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_default_model_name_and_a_sensible_chat_answer(client):
    assert [m.id for m in client.models.list().data] == [NAME]
    r = client.chat.completions.create(model=NAME, messages=ask("What is the capital of France?"),
                                       max_tokens=48, temperature=0)
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"  # the model's <|im_end|> ended it
    assert "<|im_end|>" not in r.choices[0].message.content


def test_stream_equals_non_stream_and_never_sends_broken_utf8(client):
    kwargs = dict(model=NAME, messages=ask("Write the French words for coffee, summer and "
                                           "Christmas, with their accents."),
                  max_tokens=40, temperature=0)
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    pieces = [c.choices[0].delta.content for c in client.chat.completions.create(
        **kwargs, stream=True) if c.choices and c.choices[0].delta.content]
    assert "".join(pieces) == full
    assert not any("\ufffd" in p for p in pieces)
    assert any(ord(ch) > 127 for ch in full)  # the test really covered multi-byte text


def test_echo_of_a_non_ascii_prompt_round_trips(client):
    prompt = "Grüße aus Köln! 🙂 The weather today is"
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0,
                                  echo=True)
    assert r.choices[0].text.startswith(prompt)


def test_stop_string_cuts_the_answer_in_stream_and_not(client):
    kwargs = dict(model=NAME, messages=ask("Count from one to ten in words."), max_tokens=48,
                  temperature=0)
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    words = full.split()
    assert len(words) > 4
    stop = " " + words[3]
    cut = full.index(stop)
    r = client.chat.completions.create(**kwargs, stop=[stop])
    assert r.choices[0].message.content == full[:cut]
    assert r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].delta.content or "" for c in
                       client.chat.completions.create(**kwargs, stop=[stop], stream=True)
                       if c.choices)
    assert streamed == full[:cut]


def test_shared_system_prompt_is_served_from_the_prefix_cache(client):
    # SmolLM2's template adds the same system prompt to every conversation.
    client.chat.completions.create(model=NAME, messages=ask("Name a colour."), max_tokens=4)
    r = client.chat.completions.create(model=NAME, messages=ask("Name a fruit."), max_tokens=4)
    assert r.usage.prompt_tokens_details.cached_tokens >= 16


def test_concurrent_async_streams_match_their_sequential_answers(server, client):
    questions = ["What is 2 + 2?", "Name a planet.", "What colour is the sky?",
                 "Say hello in Spanish."]
    expected = [client.chat.completions.create(model=NAME, messages=ask(q), max_tokens=24,
                                               temperature=0).choices[0].message.content
                for q in questions]

    async def one(aclient, q):
        text = ""
        async for chunk in await aclient.chat.completions.create(
                model=NAME, messages=ask(q), max_tokens=24, temperature=0, stream=True):
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
        return text

    async def run():
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key="x",
                                      max_retries=0, timeout=300) as aclient:
            return await asyncio.gather(*(one(aclient, q) for q in questions))

    assert asyncio.run(run()) == expected


def test_tokenize_round_trip(server):
    text = "The capital of France is Paris."
    toks = httpx.post(server.url + "/tokenize",
                      json={"prompt": text, "add_special_tokens": False}).json()
    assert toks["count"] == len(toks["tokens"]) > 0
    back = httpx.post(server.url + "/detokenize", json={"tokens": toks["tokens"]}).json()
    assert back["prompt"] == text
