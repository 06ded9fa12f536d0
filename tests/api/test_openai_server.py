"""`met serve` on a tiny random model, driven as users drive it: the official openai SDK
(sync and async, stream and not) and raw HTTP. One server for the whole module."""

from __future__ import annotations

import asyncio
import json
import socket

import httpx
import openai
import pytest
from serve_harness import wait_until
from tiny_models import TRAINING_TEXT

from met import LLM, SamplingParams

MAX_MODEL_LEN = 256



@pytest.fixture(scope="module")
def server(start_server, ckpt):
    return start_server([ckpt, "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
                         "--served-model-name", "tiny", "--log-requests"])


@pytest.fixture(scope="module")
def offline(ckpt):
    """The offline LLM on the same weights: the reference for greedy output."""
    return LLM(ckpt, dtype="float32", max_model_len=MAX_MODEL_LEN)




def greedy(offline: LLM, prompt, n: int) -> str:
    return offline.generate([prompt], SamplingParams(max_tokens=n, temperature=0.0))[0] \
        .outputs[0].text


def sse_events(text: str) -> list[str]:
    """The data payloads of an SSE body, in order."""
    return [block[len("data: "):] for block in text.split("\n\n") if block.startswith("data: ")]


USER = [{"role": "user", "content": "Where does the keeper write the weather?"}]


def test_server_reports_loading_then_ready(server):
    # Whatever the poll caught, /health never said anything but loading or ok.
    assert set(server.health_seen) <= {(503, "loading"), (200, "ok")}
    assert server.health_seen[-1] == (200, "ok")


def test_models_list_and_retrieve(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    card = client.models.retrieve("tiny")
    assert card.id == "tiny"
    assert (card.dtype, card.quantization) == ("float32", "none")  # --dtype float32
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4")
    assert e.value.body["code"] == "model_not_found"


def test_chat_matches_offline_greedy_with_usage(client, offline):
    ref = offline.chat(USER, SamplingParams(max_tokens=12, temperature=0.0))[0]
    r = client.chat.completions.create(model="tiny", messages=USER, max_tokens=12,
                                       temperature=0)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion" and r.model == "tiny"
    assert len(r.choices) == 1
    choice = r.choices[0]
    assert choice.index == 0 and choice.message.role == "assistant"
    assert choice.message.content == ref.outputs[0].text
    assert choice.finish_reason == ref.outputs[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


def test_chat_stream_is_openai_shaped_and_equals_non_stream(client):
    kwargs = dict(model="tiny", messages=USER, max_tokens=20, temperature=0.9, seed=11)
    full = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}))
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text_chunks = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(text_chunks) > 1  # really streamed, token by token
    assert "".join(c.choices[0].delta.content for c in text_chunks) \
        == full.choices[0].message.content
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].choices[0].finish_reason == "length"
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 20
    assert last.usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_raw_stream_ends_with_done_and_every_chunk_is_json(http):
    body = {"model": "tiny", "messages": USER, "max_tokens": 5, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        text = r.read().decode()
    events = sse_events(text)
    assert events[-1] == "[DONE]"
    assert all("error" not in json.loads(e) for e in events[:-1])
    assert "usage" not in json.loads(events[-2])  # not asked for


def test_seeded_sampling_is_reproducible_and_seed_dependent(client):
    def run(seed):
        return client.completions.create(model="tiny", prompt="The keeper", max_tokens=16,
                                         temperature=1.0, seed=seed).choices[0].text

    assert run(5) == run(5)
    assert run(5) != run(6)


def test_completions_prompt_forms_match_offline(client, offline):
    texts = ["The old lighthouse", "Ships passing in the dark"]
    ids = [offline.tokenizer(t).input_ids for t in texts]
    expected = [greedy(offline, t, 8) for t in texts]
    cases = [(texts[0], 1), (texts, 2), (ids[0], 1), (ids, 2)]
    for prompt, count in cases:
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
        assert r.object == "text_completion" and r.id.startswith("cmpl-")
        assert [c.index for c in r.choices] == list(range(count))
        assert [c.text for c in r.choices] == expected[:count], prompt
        assert r.usage.prompt_tokens == sum(len(i) for i in ids[:count])
        assert r.usage.completion_tokens == 8 * count


def test_completions_default_max_tokens_is_16(client):
    r = client.completions.create(model="tiny", prompt="The old", temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length"


def test_n_choices_are_independent_and_streams_match(client):
    kwargs = dict(model="tiny", prompt="The keeper", max_tokens=10, temperature=1.0, seed=3, n=3)
    r = client.completions.create(**kwargs)
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = [c.text for c in r.choices]
    assert len(set(texts)) > 1
    assert r.usage.completion_tokens == 30
    streamed = ["", "", ""]
    for chunk in client.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == texts


def test_echo_prepends_the_prompt(client, offline):
    prompt = "The old lighthouse"
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0,
                                  echo=True)
    assert r.choices[0].text == prompt + greedy(offline, prompt, 6)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt=prompt, max_tokens=6, temperature=0, echo=True, stream=True)
        if c.choices)
    assert streamed == r.choices[0].text


def _stop_across_tokens(offline: LLM, prompt: str, n: int) -> tuple[str, str]:
    """The greedy text and a 3-char stop string that straddles two tokens' text."""
    out = offline.generate([prompt], SamplingParams(max_tokens=n, temperature=0.0))[0].outputs[0]
    full = out.text
    pieces = [offline.tokenizer.decode(out.token_ids[:i], skip_special_tokens=True)
              for i in range(1, len(out.token_ids) + 1)]
    for i in range(2, len(pieces) - 2):
        cut = len(pieces[i])
        stop = full[cut - 2: cut + 1]
        if len(pieces[i]) > len(pieces[i - 1]) + 1 and "\ufffd" not in stop and len(stop) == 3:
            return full, stop
    pytest.fail("no token boundary to split a stop string across")


def test_stop_string_split_across_tokens_is_never_sent(client, offline):
    prompt = "The old lighthouse"
    full, stop = _stop_across_tokens(offline, prompt, 24)
    cut = full.find(stop)
    kwargs = dict(model="tiny", prompt=prompt, max_tokens=24, temperature=0, stop=[stop])
    r = client.completions.create(**kwargs)
    assert r.choices[0].text == full[:cut]
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 24
    chunks = [c.choices[0] for c in client.completions.create(**kwargs, stream=True)
              if c.choices]
    sent = "".join(c.text for c in chunks)
    assert sent == full[:cut]
    assert chunks[-1].finish_reason == "stop"
    kept = client.completions.create(**kwargs, extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == full[:cut] + stop


def test_repeated_prompt_reports_cached_tokens(client):
    prompt = TRAINING_TEXT[500:900]  # ~100 tokens no other test sends: several KV blocks
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 16 * (first.usage.prompt_tokens // 16 - 1) and cached > 0
    assert second.choices[0].text == first.choices[0].text


def test_32_concurrent_streams_complete_independently(server, offline):
    words = TRAINING_TEXT.split()
    prompts = [" ".join(words[i * 3: i * 3 + 2 + i % 5]) for i in range(32)]
    expected = [o.outputs[0].text for o in offline.generate(
        prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))]

    async def one(client: openai.AsyncOpenAI, prompt: str) -> tuple[str, str, set[str]]:
        stream = await client.completions.create(
            model="tiny", prompt=prompt, max_tokens=12, temperature=0, stream=True,
            extra_body={"ignore_eos": True})
        text, finish, ids = "", "", set()
        async for chunk in stream:
            ids.add(chunk.id)
            for c in chunk.choices:
                text += c.text
                finish = c.finish_reason or finish
        return text, finish, ids

    async def run_all():
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0,
                                      timeout=120) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    results = asyncio.run(run_all())
    assert [t for t, _, _ in results] == expected
    assert all(f == "length" for _, f, _ in results)
    assert all(len(ids) == 1 for _, _, ids in results)
    assert len({next(iter(ids)) for _, _, ids in results}) == 32  # each its own id
    assert wait_until(lambda: server.metric("met_kv_blocks_used") == 0)


# Long enough to be mid-flight when the client leaves, however fast the machine: 64 choices
# (one batch) of up to 240 tokens each.
LONG = {"model": "tiny", "prompt": "The keeper", "max_tokens": 240, "n": 64,
        "ignore_eos": True}


def test_client_disconnect_mid_stream_frees_kv_blocks(server, http):
    aborted_before = server.metric("met_requests_total", finish_reason="abort")
    with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(line for line in lines if line.startswith("data: "))
        assert server.metric("met_kv_blocks_used") > 0  # it is holding blocks right now
    # The connection is closed: the server aborts the request and frees its blocks.
    assert wait_until(lambda: server.metric("met_kv_blocks_used") == 0)
    assert wait_until(lambda: server.metric("met_requests_total", finish_reason="abort")
                      > aborted_before)
    assert server.metric("met_requests_running") == 0


def test_client_disconnect_while_waiting_for_non_stream_frees_kv_blocks(server):
    aborted_before = server.metric("met_requests_total", finish_reason="abort")
    body = json.dumps(LONG).encode()
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: met\r\n"
                     b"Content-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        assert wait_until(lambda: server.metric("met_kv_blocks_used") > 0, interval=0.01)
    # Closed while the server was still generating: it notices and aborts.
    assert wait_until(lambda: server.metric("met_requests_total", finish_reason="abort")
                      > aborted_before), "\n".join(
        line[:300] for line in server.log().splitlines() if "/metrics" not in line)[-6000:]
    assert wait_until(lambda: server.metric("met_kv_blocks_used") == 0)
    assert server.metric("met_requests_running") == 0


BAD_INPUTS = [
    # (path, body, status, param, fragment of the message)
    ("/v1/chat/completions", {"messages": USER, "temperature": 2.5}, 400, "temperature",
     "[0, 2]"),
    ("/v1/chat/completions", {"messages": USER, "temperature": -1}, 400, "temperature", "[0, 2]"),
    ("/v1/chat/completions", {"messages": USER, "top_p": 0}, 400, "top_p", "(0, 1]"),
    ("/v1/chat/completions", {"messages": USER, "top_p": 1.5}, 400, "top_p", "(0, 1]"),
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 0}, 400, "max_tokens", ">= 1"),
    ("/v1/chat/completions", {"messages": USER, "max_completion_tokens": -3}, 400,
     "max_completion_tokens", ">= 1"),
    ("/v1/chat/completions", {"messages": USER, "n": 0}, 400, "n", "[1, 128]"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", "at least one"),
    ("/v1/chat/completions", {}, 400, "messages", "required"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, 400, "messages.0.role",
     "required"),
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 5000}, 400, "max_tokens",
     "maximum context length is 256"),
    ("/v1/chat/completions", {"messages": USER, "stop": [""]}, 400, "stop", "non-empty"),
    ("/v1/chat/completions", {"messages": USER, "top_k": -2}, 400, "top_k", "-1"),
    ("/v1/chat/completions", {"messages": USER, "min_tokens": 9, "max_tokens": 3}, 400,
     "min_tokens", "<= max_tokens"),
    ("/v1/chat/completions", {"messages": USER, "model": "gpt-4"}, 404, "model", "gpt-4"),
    ("/v1/completions", {"prompt": "x" * 4000, "max_tokens": 10}, 400, "max_tokens",
     "maximum context length"),
    ("/v1/completions", {"prompt": [1, 2, 99999]}, 400, "prompt", "outside the vocabulary"),
    ("/v1/completions", {"prompt": []}, 400, "prompt", "non-empty"),
    ("/v1/completions", {"prompt": {"text": "x"}}, 400, "prompt", "list of token ids"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [100000]}, 400, "stop_token_ids",
     "vocabulary"),
    ("/v1/completions", {"prompt": "x", "n": "two"}, 400, "n", "integer"),
    ("/v1/completions", [1, 2], 400, None, "JSON object"),
]


@pytest.mark.parametrize("path,body,status,param,fragment", BAD_INPUTS)
def test_bad_input_gets_an_openai_error_naming_the_field(http, path, body, status, param,
                                                         fragment):
    r = http.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param
    assert fragment in err["message"]
    assert err["type"] == "invalid_request_error"


def test_malformed_json_unknown_route_and_server_still_healthy(http, client):
    r = http.post("/v1/chat/completions", content=b'{"messages": [',
                  headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = http.get("/v1/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=USER, temperature=3)
    assert e.value.body["param"] == "temperature"
    assert http.get("/health").json() == {"status": "ok"}
    ok = client.chat.completions.create(model="tiny", messages=USER, max_tokens=3)
    assert ok.choices[0].finish_reason in ("length", "stop")


def test_oversized_body_gets_413(http):
    r = http.post("/v1/completions", content=b"x" * (33 << 20),
                  headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"
    assert http.get("/health").status_code == 200


def test_tokenize_detokenize_round_trip(http, client):
    text = "The old lighthouse stood at the edge"
    r = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert r["count"] == len(r["tokens"]) > 0 and r["max_model_len"] == MAX_MODEL_LEN
    assert http.post("/detokenize", json={"tokens": r["tokens"]}).json()["prompt"] == text
    chat = http.post("/tokenize", json={"messages": USER}).json()
    usage = client.chat.completions.create(model="tiny", messages=USER, max_tokens=1).usage
    assert chat["count"] == usage.prompt_tokens
    bad = http.post("/detokenize", json={"tokens": [10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_every_response_has_a_request_id(http):
    r = http.get("/health", headers={"x-request-id": "my-trace-1"})
    assert r.headers["x-request-id"] == "my-trace-1"
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
    rid = r.headers["x-request-id"]
    assert rid and r.json()["id"] == f"cmpl-{rid}"
    assert http.get("/nope").headers["x-request-id"]
    assert http.post("/v1/completions", json={"prompt": []}).headers["x-request-id"]


def test_clients_may_reuse_a_request_id_concurrently(server):
    async def both():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            return await asyncio.gather(*(
                c.post("/v1/completions", json={"prompt": "The", "max_tokens": 4},
                       headers={"x-request-id": "same-id"}) for _ in range(2)))

    for r in asyncio.run(both()):
        assert r.status_code == 200 and r.headers["x-request-id"] == "same-id"


def test_version_openapi_and_metrics(http, server):
    assert http.get("/version").json()["version"]
    spec = http.get("/openapi.json").json()
    body = spec["paths"]["/v1/chat/completions"]["post"]["requestBody"]
    ref = body["content"]["application/json"]["schema"]["$ref"].split("/")[-1]
    assert "messages" in spec["components"]["schemas"][ref]["properties"]
    metrics = server.metrics()
    names = {key.partition("{")[0] for key in metrics}
    for name in ("met_requests_total", "met_requests_running", "met_requests_waiting",
                 "met_prompt_tokens_total", "met_generation_tokens_total",
                 "met_time_to_first_token_seconds_count",
                 "met_time_per_output_token_seconds_count", "met_kv_blocks_total",
                 "met_kv_blocks_used", "met_prefix_cache_queries_total",
                 "met_prefix_cache_hits_total"):
        assert name in names, name
    assert server.metric("met_generation_tokens_total") > 0
    assert server.metric("met_prefix_cache_hits_total") > 0  # the repeated-prompt test
    assert server.metric("met_kv_blocks_total") > 0


def test_log_requests_logs_each_request(server):
    assert "done in" in server.log() and "completion_tokens=" in server.log()
