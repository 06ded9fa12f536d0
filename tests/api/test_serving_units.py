"""Pieces of the server a user relies on without seeing: incremental detokenization, stop
strings, request validation, and the app's behaviour while loading, after a failed load,
and when the engine fails in the middle of a stream (the app driven in-process)."""

from __future__ import annotations

import asyncio
import json
import random
import threading

import httpx
import pytest
from transformers import AutoTokenizer

from met.api.app import build_app
from met.api.context import ServerConfig
from met.config import EngineConfig
from met.engine.async_engine import AsyncEngine, OutputStream
from met.engine.core import EngineCore
from met.serving.detokenizer import IncrementalDetokenizer, StopStringMatcher
from met.serving.errors import InvalidRequest
from met.serving.protocol import ChatCompletionRequest, CompletionRequest, parse_body
from met.serving.validation import ModelLimits, build_params, choice_params


@pytest.fixture(scope="module")
def tokenizer(ckpt):
    return AutoTokenizer.from_pretrained(ckpt)


# ---------------------------------------------------------------- detokenizer


def _stream(tokenizer, ids: list[int], rng: random.Random) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer)
    pieces, i = [], 0
    while i < len(ids):
        k = rng.randrange(1, 4)  # updates carry one token now, several with speculation later
        pieces.append(detok.push(ids[i:i + k]))
        i += k
    return pieces + [detok.flush()]


def test_streamed_pieces_concatenate_to_the_full_decode(tokenizer):
    """Random tokens include partial UTF-8 byte sequences: the hard case."""
    vocab = len(tokenizer)
    for seed in range(200):
        rng = random.Random(seed)
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        assert "".join(_stream(tokenizer, ids, rng)) == \
            tokenizer.decode(ids, skip_special_tokens=True), ids


def test_multibyte_characters_are_never_sent_broken(tokenizer):
    text = "Grüße — 日本語 🙂👍🏽 ok"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert len(ids) > len(text) // 2  # byte-level pieces: characters span several tokens
    pieces = _stream(tokenizer, ids, random.Random(0))
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


# ---------------------------------------------------------------- stop strings


def test_stop_string_split_across_pieces_is_held_back_then_cut():
    m = StopStringMatcher(("STOP",))
    assert m.feed("abc ST") == ("abc ", None)  # "ST" might start STOP: held
    assert m.feed("O") == ("", None)
    assert m.feed("P and more") == ("", "STOP")


def test_held_text_is_released_once_it_cannot_match():
    m = StopStringMatcher(("STOP",))
    assert m.feed("x ST") == ("x ", None)
    assert m.feed("ART") == ("START", None)
    assert m.feed("ends S") == ("ends ", None)
    assert m.flush() == "S"  # the generation ended: nothing can match any more


def test_earliest_stop_wins_and_include_keeps_it():
    m = StopStringMatcher(("world", "lo w"), include_in_output=True)
    assert m.feed("hello world") == ("hello w", "lo w")
    assert StopStringMatcher(("\n\n",)).feed("a\n\nb\n\n") == ("a", "\n\n")


def test_before_min_tokens_stop_strings_do_not_count():
    m = StopStringMatcher(("ab",))
    assert m.feed("xab", check=False) == ("xab", None)
    assert m.feed("yab") == ("y", "ab")


# ---------------------------------------------------------------- validation

LIMITS = ModelLimits(max_model_len=100, vocab_size=50, block_size=16, num_kv_blocks=64)


def test_defaults_fill_the_context_for_chat_and_16_for_completions():
    chat = parse_body(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}]})
    assert build_params(chat, None, 30, LIMITS, None, "messages").max_tokens == 70
    comp = parse_body(CompletionRequest, {"prompt": "x"})
    assert build_params(comp, None, 30, LIMITS, 16, "prompt").max_tokens == 16
    assert build_params(comp, None, 95, LIMITS, 16, "prompt").max_tokens == 5  # clamped
    with pytest.raises(InvalidRequest) as e:
        build_params(comp, None, 100, LIMITS, 16, "prompt")
    assert e.value.param == "prompt" and e.value.code == "context_length_exceeded"


def test_kv_pool_smaller_than_the_context_bounds_requests():
    small = ModelLimits(max_model_len=100, vocab_size=50, block_size=16, num_kv_blocks=4)
    comp = parse_body(CompletionRequest, {"prompt": "x", "max_tokens": 40})
    with pytest.raises(InvalidRequest, match="KV cache"):
        build_params(comp, 40, 30, small, 16, "prompt")


def test_n_choices_get_distinct_reproducible_seeds():
    comp = parse_body(CompletionRequest, {"prompt": "x", "seed": 9, "temperature": 1})
    params = build_params(comp, 4, 3, LIMITS, 16, "prompt")
    assert [choice_params(params, i).seed for i in range(3)] == [9, 10, 11]
    unseeded = build_params(parse_body(CompletionRequest, {"prompt": "x"}), 4, 3, LIMITS, 16,
                            "prompt")
    assert choice_params(unseeded, 2).seed is None


# ---------------------------------------------------------------- output streams


def test_cancelling_a_reader_is_never_lost_when_an_item_arrives_at_once():
    """A disconnect cancels the reader; if that raced an arriving token and the cancel were
    swallowed (asyncio.wait_for on Python 3.11 does), the request would run to the end."""

    async def main():
        stream = OutputStream()
        reader = asyncio.create_task(stream.get(timeout=10))
        await asyncio.sleep(0)
        stream.put("token")
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        assert await stream.get(timeout=1) == "token"  # nothing was lost either
        with pytest.raises(TimeoutError):
            await stream.get(timeout=0.01)

    asyncio.run(main())


# ---------------------------------------------------------------- the app in-process


def _run_app(factory, body, config: ServerConfig | None = None, on_fatal=None):
    """Start the app (its lifespan starts the engine), then run ``body(client, engine)``."""
    config = config or ServerConfig(served_model_names=("tiny",))
    engine = AsyncEngine(factory)
    app = build_app(config, engine, on_fatal)

    async def main():
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://met") as client:
                return await body(client, engine)

    return asyncio.run(main())


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


async def _until_healthy(client) -> None:
    for _ in range(500):
        if (await client.get("/health")).status_code == 200:
            return
        await asyncio.sleep(0.02)
    raise AssertionError("never healthy")


def test_health_says_loading_until_the_model_is_ready(ckpt):
    release = threading.Event()

    def slow_factory():
        release.wait(30)
        return EngineCore(EngineConfig(model=ckpt, dtype="float32", max_model_len=64))

    async def body(client, engine):
        r = await client.get("/health")
        assert (r.status_code, r.json()["status"]) == (503, "loading")
        r = await client.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading"
        assert r.headers["retry-after"]
        release.set()
        await _until_healthy(client)
        r = await client.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 200, r.text

    _run_app(slow_factory, body)


def test_failed_load_reports_faulted_with_the_reason():
    fatal = threading.Event()

    def broken_factory():
        raise FileNotFoundError("no such checkpoint: /nowhere")

    async def body(client, engine):
        await engine.wait_ready()
        await asyncio.sleep(0.05)
        r = await client.get("/health")
        assert r.status_code == 503
        assert r.json()["status"] == "faulted" and "/nowhere" in r.json()["reason"]
        r = await client.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 503 and "/nowhere" in r.json()["error"]["message"]

    _run_app(broken_factory, body, on_fatal=fatal.set)
    assert fatal.is_set()  # the CLI stops the server on this


def test_engine_failure_mid_stream_sends_an_error_event_then_done(ckpt):
    def factory():
        return EngineCore(EngineConfig(model=ckpt, dtype="float32", max_model_len=64))

    async def body(client, engine):
        await _until_healthy(client)
        core = engine.core
        real_step = core.step
        calls = {"n": 0, "fail_at": 4}

        def flaky_step():
            calls["n"] += 1
            if calls["n"] == calls["fail_at"]:
                raise RuntimeError("simulated device failure")
            return real_step()

        core.step = flaky_step
        r = await client.post("/v1/chat/completions",
                              json={**CHAT, "stream": True, "ignore_eos": True})
        assert r.status_code == 200
        events = [b[6:] for b in r.text.split("\n\n") if b.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert "simulated device failure" in error["message"]
        assert error["type"] == "server_error"
        contents = [json.loads(e)["choices"][0]["delta"].get("content") for e in events[1:-2]]
        assert any(contents)  # it had streamed tokens before failing

        # A step that raised leaves the core untrustworthy: the engine is faulted, says why,
        # and refuses new work at once (tests/reliability covers the rest of a fault).
        r = await client.get("/health")
        assert r.status_code == 503 and "simulated device failure" in r.json()["reason"]
        r = await client.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_faulted"

    _run_app(factory, body)


def test_chat_template_flag_overrides_the_models(ckpt):
    def factory():
        return EngineCore(EngineConfig(model=ckpt, dtype="float32", max_model_len=64))

    config = ServerConfig(served_model_names=("tiny",),
                          chat_template="{{ messages[0]['content'] }}")

    async def body(client, engine):
        await _until_healthy(client)
        chat = await client.post("/tokenize", json={
            "messages": [{"role": "user", "content": "hello world"}]})
        plain = await client.post("/tokenize", json={"prompt": "hello world",
                                                     "add_special_tokens": False})
        assert chat.json()["tokens"] == plain.json()["tokens"]

    _run_app(factory, body, config)


def test_server_engine_freezes_what_loading_left_out_of_the_cycle_collector(ckpt):
    """A full collection over the loaded model's objects stalled every stream for ~150 ms
    (the embedded model); the server's engine keeps them out of the collector."""
    import gc

    from met.api.server import _server_core

    before = gc.get_freeze_count()
    try:
        core = _server_core(EngineConfig(model=ckpt, dtype="float32", max_model_len=64))
        assert gc.get_freeze_count() > before
        tracked = {id(o) for o in gc.get_objects()}
        assert id(core.runner.model) not in tracked, "the loaded model should be frozen"
    finally:
        gc.unfreeze()
