"""POST /v1/embeddings on the tiny model: OpenAI's shape (float and base64), the OpenAI SDK
reads it, dimensions truncate and renormalize, usage counts tokens, bad input is a 400
naming the field, the route is behind the API key, and no KV block is left behind."""

from __future__ import annotations

import base64
import struct

import httpx
import openai
import pytest
import torch
from in_process import run_with_app, settled
from tiny_models import load_hf_model, load_tokenizer

TEXTS = ["The keeper climbed the narrow stairs to light the lamp", "Once a year",
         "the inspector came to check"]


def _hf(model_dir, ids: list[int], pooling: str = "last", dimensions: int | None = None,
        normalize: bool = True) -> torch.Tensor:
    model = load_hf_model(str(model_dir))
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), output_hidden_states=True, use_cache=False)
    hidden = out.hidden_states[-1][0].float()
    v = hidden[-1] if pooling == "last" else hidden.mean(dim=0)
    v = v[:dimensions] if dimensions is not None else v
    return torch.nn.functional.normalize(v, dim=0) if normalize else v


def _close(got, want: torch.Tensor) -> None:
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float32), want, rtol=0,
                               atol=1e-5)


def _decode(b64: str) -> list[float]:
    raw = base64.b64decode(b64)
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))


@pytest.fixture(scope="module")
def qwen3(tiny_checkpoint):
    return str(tiny_checkpoint("qwen3"))


def test_float_and_base64_shapes_match_transformers(qwen3):
    ids_of = [list(load_tokenizer(qwen3)(t).input_ids) for t in TEXTS]

    async def work(client: httpx.AsyncClient):
        floats = await client.post("/v1/embeddings", json={"model": "tiny", "input": TEXTS})
        b64 = await client.post("/v1/embeddings", json={"input": TEXTS,
                                                        "encoding_format": "base64"})
        one = await client.post("/v1/embeddings", json={"input": TEXTS[1]})
        tokens = await client.post("/v1/embeddings", json={"input": ids_of[0]})
        token_lists = await client.post("/v1/embeddings", json={"input": ids_of})
        return floats, b64, one, tokens, token_lists, await settled(client)

    floats, b64, one, tokens, token_lists, left = run_with_app(qwen3, None, work)
    assert left == (0, 0)
    for r in (floats, b64, one, tokens, token_lists):
        assert r.status_code == 200, r.text
    body = floats.json()
    assert body["object"] == "list" and body["model"] == "tiny"
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    assert all(d["object"] == "embedding" for d in body["data"])
    n = sum(len(i) for i in ids_of)
    assert body["usage"] == {"prompt_tokens": n, "total_tokens": n}
    for d, ids in zip(body["data"], ids_of, strict=True):
        assert len(d["embedding"]) == 64
        _close(d["embedding"], _hf(qwen3, ids))
    for d, f in zip(b64.json()["data"], body["data"], strict=True):
        assert isinstance(d["embedding"], str)
        _close(_decode(d["embedding"]), torch.tensor(f["embedding"]))
    _close(one.json()["data"][0]["embedding"], torch.tensor(body["data"][1]["embedding"]))
    assert one.json()["usage"]["prompt_tokens"] == len(ids_of[1])
    _close(tokens.json()["data"][0]["embedding"], torch.tensor(body["data"][0]["embedding"]))
    for d, f in zip(token_lists.json()["data"], body["data"], strict=True):
        _close(d["embedding"], torch.tensor(f["embedding"]))


def test_dimensions_pooling_and_normalize(qwen3):
    ids = list(load_tokenizer(qwen3)(TEXTS[0]).input_ids)

    async def work(client: httpx.AsyncClient):
        short = await client.post("/v1/embeddings", json={"input": ids, "dimensions": 24})
        mean = await client.post("/v1/embeddings", json={"input": ids, "pooling": "mean"})
        raw = await client.post("/v1/embeddings", json={"input": ids, "normalize": False})
        return short, mean, raw

    short, mean, raw = run_with_app(qwen3, None, work)
    for r in (short, mean, raw):
        assert r.status_code == 200, r.text
    v = short.json()["data"][0]["embedding"]
    assert len(v) == 24
    _close(v, _hf(qwen3, ids, dimensions=24))  # cut, then renormalized
    assert abs(torch.tensor(v).norm().item() - 1) < 1e-5
    _close(mean.json()["data"][0]["embedding"], _hf(qwen3, ids, "mean"))
    _close(raw.json()["data"][0]["embedding"], _hf(qwen3, ids, normalize=False))


def test_server_pooling_flags(qwen3):
    """--pooling mean and --no-normalize-embeddings (EngineConfig) set the defaults."""
    ids = list(load_tokenizer(qwen3)(TEXTS[2]).input_ids)

    async def work(client: httpx.AsyncClient):
        return await client.post("/v1/embeddings", json={"input": ids})

    r = run_with_app(qwen3, None, work, pooling="mean", normalize_embeddings=False)
    assert r.status_code == 200, r.text
    _close(r.json()["data"][0]["embedding"], _hf(qwen3, ids, "mean", normalize=False))


def test_openai_sdk_reads_both_encodings(qwen3):
    """The official SDK asks for base64 unless told otherwise, and decodes it itself."""
    ids = list(load_tokenizer(qwen3)(TEXTS[0]).input_ids)

    async def work(client: httpx.AsyncClient):
        sdk = openai.AsyncOpenAI(base_url="http://met/v1", api_key="k", max_retries=0,
                                 http_client=client)
        default = await sdk.embeddings.create(model="tiny", input=TEXTS[0])
        floats = await sdk.embeddings.create(model="tiny", input=[TEXTS[0]],
                                             encoding_format="float", dimensions=8)
        return default, floats

    default, floats = run_with_app(qwen3, None, work)
    _close(default.data[0].embedding, _hf(qwen3, ids))
    assert default.usage.prompt_tokens == len(ids)
    _close(floats.data[0].embedding, _hf(qwen3, ids, dimensions=8))


BAD = [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": ["ok", ""]}, "input.1"),
    ({"input": [[]]}, "input"),
    ({"input": [[1, 2], []]}, "input.1"),
    ({"input": [1, "a"]}, "input"),
    ({}, "input"),
    ({"input": "x", "dimensions": 0}, "dimensions"),
    ({"input": "x", "dimensions": 65}, "dimensions"),
    ({"input": "x", "encoding_format": "hex"}, "encoding_format"),
    ({"input": "x", "pooling": "cls"}, "pooling"),
    ({"input": [5] * 300}, "input"),
    ({"input": [[5], [5] * 300]}, "input.1"),
    ({"input": [10**9]}, "input"),
    ({"input": ["a"] * 2049}, "input"),
]


def test_bad_input_is_400_naming_the_field(qwen3):
    async def work(client: httpx.AsyncClient):
        out = [await client.post("/v1/embeddings", json=body) for body, _ in BAD]
        unknown = await client.post("/v1/embeddings", json={"input": "x", "model": "other"})
        return out, unknown, await settled(client)

    out, unknown, left = run_with_app(qwen3, None, work)
    for (body, param), r in zip(BAD, out, strict=True):
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert err["param"] == param, (body, err)
        assert err["message"].startswith(param), (body, err)
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"
    assert left == (0, 0)


def test_behind_the_api_key(qwen3):
    async def work(client: httpx.AsyncClient):
        none = await client.post("/v1/embeddings", json={"input": "x"})
        good = await client.post("/v1/embeddings", json={"input": "x"},
                                 headers={"Authorization": "Bearer sesame"})
        return none, good

    none, good = run_with_app(qwen3, None, work, server_fields={"api_keys": ("sesame",)})
    assert none.status_code == 401
    assert good.status_code == 200, good.text


def test_embeddings_beside_streaming_generation(qwen3):
    """Embedding requests while a completion streams: both answer, the embedding equals the
    one computed alone."""
    import asyncio

    ids = list(load_tokenizer(qwen3)(TEXTS[0]).input_ids)

    async def work(client: httpx.AsyncClient):
        gen = client.post("/v1/completions", json={"prompt": TEXTS[1], "max_tokens": 24,
                                                    "temperature": 0, "ignore_eos": True})
        embs = [client.post("/v1/embeddings", json={"input": ids, "pooling": p})
                for p in ("last", "mean")]
        results = await asyncio.gather(gen, *embs)
        return results, await settled(client)

    (gen, last, mean), left = run_with_app(qwen3, None, work)
    assert gen.status_code == 200 and gen.json()["usage"]["completion_tokens"] == 24
    _close(last.json()["data"][0]["embedding"], _hf(qwen3, ids))
    _close(mean.json()["data"][0]["embedding"], _hf(qwen3, ids, "mean"))
    assert left == (0, 0)


def test_cli_flags_reach_the_engine_config():
    import argparse

    from met.cli.args import add_engine_args, engine_config

    p = argparse.ArgumentParser()
    add_engine_args(p)
    on = engine_config(p.parse_args(["m", "--device", "cpu", "--pooling", "mean",
                                     "--no-normalize-embeddings"]))
    assert (on.pooling, on.normalize_embeddings) == ("mean", False)
    default = engine_config(p.parse_args(["m", "--device", "cpu"]))
    assert (default.pooling, default.normalize_embeddings) == ("last", True)
    with pytest.raises(SystemExit):
        p.parse_args(["m", "--pooling", "cls"])
