"""POST /v1/rerank and /v1/score on a tiny Qwen3 whose tokenizer spells "yes" and "no" as one
token each: each score equals P(yes) = softmax(logits[-1, [no, yes]])[1] that transformers
computes on the same Qwen3-Reranker prompt; rerank sorts, cuts at top_n and drops documents
on request; score pairs 1-to-N and N-to-N; --score-mode cosine equals the cosine of
transformers' normalized last hidden states; bad bodies are 400s naming the field; scores
do not change beside a generating request; no KV block is left behind."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch
from in_process import run_with_app, settled
from tiny_models import build_tiny_checkpoint, load_hf_model, load_tokenizer

QUERY = "Who keeps the lamp?"
DOCS = ["The keeper climbed the narrow stairs to light the lamp", "Once a year",
        "the inspector came to check the ships"]
ENGINE = {"max_model_len": 512}


def _prompt(query: str, doc: str,
            instruction: str = "Given a web search query, retrieve relevant passages that "
                               "answer the query") -> str:
    """Qwen3-Reranker's model-card format, written out here independently of met."""
    return ("<|im_start|>system\nJudge whether the Document meets the requirements based on "
            "the Query and the Instruct provided. Note that the answer can only be \"yes\" or "
            "\"no\".<|im_end|>\n<|im_start|>user\n"
            f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {doc}"
            "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    """A tiny random Qwen3 whose tokenizer has single-token "yes" and "no"."""
    return str(build_tiny_checkpoint("qwen3", tmp_path_factory.mktemp("tiny-reranker"),
                                     tokenizer_text="\nyes\nno" * 60))


@pytest.fixture(scope="module")
def hf(reranker):
    tok = load_tokenizer(reranker)
    model = load_hf_model(reranker)
    no, yes = tok.convert_tokens_to_ids("no"), tok.convert_tokens_to_ids("yes")
    assert tok.encode("yes", add_special_tokens=False) == [yes]
    assert tok.encode("no", add_special_tokens=False) == [no]

    def forward(ids: list[int]):
        with torch.no_grad():
            return model(input_ids=torch.tensor([ids]), output_hidden_states=True,
                         use_cache=False)

    def yes_prob(query: str, doc: str, **kw) -> tuple[float, int]:
        ids = tok(_prompt(query, doc, **kw), add_special_tokens=False).input_ids
        logits = forward(ids).logits[0, -1].float()
        return torch.softmax(logits[[no, yes]], dim=0)[1].item(), len(ids)

    def embedding(text: str) -> torch.Tensor:
        ids = tok(text).input_ids
        return torch.nn.functional.normalize(forward(ids).hidden_states[-1][0, -1].float(),
                                             dim=0)

    return yes_prob, embedding


def _close(got: float, want: float) -> None:
    assert abs(got - want) <= 1e-5, (got, want)


def test_rerank_matches_transformers(reranker, hf):
    yes_prob, _ = hf
    want = [yes_prob(QUERY, d) for d in DOCS]
    docs = [DOCS[0], {"text": DOCS[1]}, DOCS[2]]

    async def work(client: httpx.AsyncClient):
        full = await client.post("/v1/rerank", json={"model": "tiny", "query": QUERY,
                                                     "documents": docs})
        top = await client.post("/rerank", json={"query": QUERY, "documents": docs,
                                                 "top_n": 2, "return_documents": False})
        v2 = await client.post("/v2/rerank", json={"query": QUERY, "documents": docs,
                                                   "top_n": 10})
        return full, top, v2, await settled(client)

    full, top, v2, left = run_with_app(reranker, None, work, **ENGINE)
    assert left == (0, 0)
    for r in (full, top, v2):
        assert r.status_code == 200, r.text
    body = full.json()
    assert body["model"] == "tiny" and body["id"].startswith("rerank-")
    results = body["results"]
    assert sorted(r["index"] for r in results) == [0, 1, 2]
    scores = [r["relevance_score"] for r in results]
    assert scores == sorted(scores, reverse=True)
    assert len(set(round(s, 6) for s in scores)) == 3  # the order below is decided
    for r in results:
        _close(r["relevance_score"], want[r["index"]][0])
        assert r["document"] == {"text": DOCS[r["index"]]}
    assert body["usage"] == {"total_tokens": sum(n for _, n in want)}
    best = sorted(range(3), key=lambda j: -want[j][0])
    assert [r["index"] for r in top.json()["results"]] == best[:2]
    assert all("document" not in r for r in top.json()["results"])
    assert [r["index"] for r in v2.json()["results"]] == best


def test_score_one_to_n_and_n_to_n(reranker, hf):
    yes_prob, _ = hf
    firsts = ["Who keeps the lamp?", "When does the inspector come?"]

    async def work(client: httpx.AsyncClient):
        one = await client.post("/v1/score", json={"text_1": QUERY, "text_2": DOCS})
        single = await client.post("/v1/score", json={"text_1": QUERY, "text_2": DOCS[0]})
        pairs = await client.post("/v1/score", json={"text_1": firsts,
                                                     "text_2": DOCS[:2]})
        instructed = await client.post("/v1/score", json={
            "text_1": QUERY, "text_2": DOCS[2], "instruction": "Find the lighthouse"})
        return one, single, pairs, instructed, await settled(client)

    one, single, pairs, instructed, left = run_with_app(reranker, None, work, **ENGINE)
    assert left == (0, 0)
    body = one.json()
    assert one.status_code == 200, one.text
    assert body["object"] == "list"
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    assert all(d["object"] == "score" for d in body["data"])
    for d, doc in zip(body["data"], DOCS, strict=True):
        _close(d["score"], yes_prob(QUERY, doc)[0])
    n = sum(yes_prob(QUERY, doc)[1] for doc in DOCS)
    assert body["usage"]["total_tokens"] == n
    _close(single.json()["data"][0]["score"], yes_prob(QUERY, DOCS[0])[0])
    assert len(pairs.json()["data"]) == 2
    for d, q, doc in zip(pairs.json()["data"], firsts, DOCS[:2], strict=True):
        _close(d["score"], yes_prob(q, doc)[0])
    _close(instructed.json()["data"][0]["score"],
           yes_prob(QUERY, DOCS[2], instruction="Find the lighthouse")[0])


def test_cosine_mode_matches_transformers(reranker, hf, tiny_checkpoint):
    """--score-mode cosine, and auto on a tokenizer without single-token yes/no."""
    _, embedding = hf
    q = embedding(QUERY)
    want = [float(q @ embedding(d)) for d in DOCS]

    async def work(client: httpx.AsyncClient):
        score = await client.post("/v1/score", json={"text_1": QUERY, "text_2": DOCS})
        nn = await client.post("/v1/score", json={"text_1": DOCS[:2], "text_2": DOCS[1:]})
        rerank = await client.post("/v1/rerank", json={"query": QUERY, "documents": DOCS})
        instructed = await client.post("/v1/score", json={"text_1": "a", "text_2": "b",
                                                          "instruction": "x"})
        return score, nn, rerank, instructed, await settled(client)

    score, nn, rerank, instructed, left = run_with_app(
        reranker, None, work, server_fields={"score_mode": "cosine"}, **ENGINE)
    assert left == (0, 0)
    assert instructed.status_code == 400  # no prompt to put it in: refused, not ignored
    assert instructed.json()["error"]["param"] == "instruction"
    for d, w in zip(score.json()["data"], want, strict=True):
        _close(d["score"], w)
    for d, a, b in zip(nn.json()["data"], DOCS[:2], DOCS[1:], strict=True):
        _close(d["score"], float(embedding(a) @ embedding(b)))
    assert [r["index"] for r in rerank.json()["results"]] == sorted(range(3),
                                                                   key=lambda j: -want[j])

    plain = str(tiny_checkpoint("qwen3"))  # its BPE splits "yes" and "no"
    tok, model = load_tokenizer(plain), load_hf_model(plain)

    def emb(text: str) -> torch.Tensor:
        with torch.no_grad():
            out = model(input_ids=torch.tensor([tok(text).input_ids]),
                        output_hidden_states=True, use_cache=False)
        return torch.nn.functional.normalize(out.hidden_states[-1][0, -1].float(), dim=0)

    async def auto(client: httpx.AsyncClient):
        return await client.post("/v1/score", json={"text_1": QUERY, "text_2": DOCS[0]})

    r = run_with_app(plain, None, auto)
    assert r.status_code == 200, r.text
    _close(r.json()["data"][0]["score"], float(emb(QUERY) @ emb(DOCS[0])))


BAD = [
    ("/v1/rerank", {"query": QUERY, "documents": []}, "documents"),
    ("/v1/rerank", {"query": QUERY}, "documents"),
    ("/v1/rerank", {"documents": DOCS}, "query"),
    ("/v1/rerank", {"query": "", "documents": DOCS}, "query"),
    ("/v1/rerank", {"query": QUERY, "documents": ["a", ""]}, "documents.1"),
    ("/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": 0}, "top_n"),
    ("/v1/rerank", {"query": QUERY, "documents": [DOCS[0], "lamp " * 400]}, "documents.1"),
    ("/v1/score", {"text_1": [QUERY, QUERY], "text_2": DOCS}, "text_2"),
    ("/v1/score", {"text_1": [], "text_2": DOCS}, "text_1"),
    ("/v1/score", {"text_1": QUERY, "text_2": []}, "text_2"),
    ("/v1/score", {"text_1": QUERY}, "text_2"),
    ("/v1/score", {"text_1": QUERY, "text_2": "lamp " * 400}, "text_2"),
]


def test_bad_bodies_are_400_naming_the_field(reranker):
    async def work(client: httpx.AsyncClient):
        out = [await client.post(path, json=body) for path, body, _ in BAD]
        unknown = await client.post("/v1/rerank", json={"model": "other", "query": QUERY,
                                                        "documents": DOCS})
        return out, unknown, await settled(client)

    out, unknown, left = run_with_app(reranker, None, work, **ENGINE)
    for (path, body, param), r in zip(BAD, out, strict=True):
        assert r.status_code == 400, (path, body, r.text)
        err = r.json()["error"]
        assert err["param"] == param, (path, body, err)
        assert err["message"].startswith(param), (path, body, err)
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"
    assert left == (0, 0)


def test_beside_a_generating_request(reranker, hf):
    """Pairs scored while a completion streams tokens in the same steps: same scores."""
    yes_prob, _ = hf

    async def work(client: httpx.AsyncClient):
        gen = client.post("/v1/completions", json={"prompt": DOCS[1], "max_tokens": 24,
                                                    "temperature": 0, "ignore_eos": True})
        rr = client.post("/v1/rerank", json={"query": QUERY, "documents": DOCS})
        sc = client.post("/v1/score", json={"text_1": QUERY, "text_2": DOCS[::-1]})
        results = await asyncio.gather(gen, rr, sc)
        return results, await settled(client)

    (gen, rr, sc), left = run_with_app(reranker, None, work, **ENGINE)
    assert gen.status_code == 200 and gen.json()["usage"]["completion_tokens"] == 24
    for r in rr.json()["results"]:
        _close(r["relevance_score"], yes_prob(QUERY, DOCS[r["index"]])[0])
    for d, doc in zip(sc.json()["data"], DOCS[::-1], strict=True):
        _close(d["score"], yes_prob(QUERY, doc)[0])
    assert left == (0, 0)


def test_behind_the_api_key(reranker):
    async def work(client: httpx.AsyncClient):
        out = []
        for path, body in (("/v1/rerank", {"query": "a", "documents": ["b"]}),
                           ("/v1/score", {"text_1": "a", "text_2": "b"})):
            out.append(await client.post(path, json=body))
            out.append(await client.post(path, json=body,
                                         headers={"Authorization": "Bearer sesame"}))
        return out

    out = run_with_app(reranker, None, work, server_fields={"api_keys": ("sesame",)}, **ENGINE)
    assert [r.status_code for r in out] == [401, 200, 401, 200], [r.text for r in out]


def test_offline_llm_score(reranker, hf):
    from met import LLM

    yes_prob, embedding = hf
    llm = LLM(reranker, dtype="float32", max_model_len=512)
    for got, doc in zip(llm.score(QUERY, DOCS), DOCS, strict=True):
        _close(got, yes_prob(QUERY, doc)[0])
    for got, doc in zip(llm.score(QUERY, DOCS, mode="cosine"), DOCS, strict=True):
        _close(got, float(embedding(QUERY) @ embedding(doc)))
    with pytest.raises(ValueError, match="documents"):
        llm.score(QUERY, [])
    assert llm.kv_stats().num_blocks_in_use == 0


def test_score_requests_reuse_the_cached_prompt_prefix(reranker, hf):
    """Pairs share the reranker prompt's head: a score reads only the last position, so a
    prefix-cache hit (which never covers the last token) leaves the score unchanged."""
    from met import LLM, PoolingParams, SamplingParams
    from met.sampling.scoring import rerank_token_ids

    yes_prob, _ = hf
    llm = LLM(reranker, dtype="float32", max_model_len=512)
    no, yes = llm.tokenizer.convert_tokens_to_ids("no"), llm.tokenizer.convert_tokens_to_ids(
        "yes")
    params = SamplingParams(pooling=PoolingParams(kind="score", token_ids=(no, yes)))
    prompts = [{"prompt_token_ids": rerank_token_ids(llm.tokenizer, QUERY, d)} for d in DOCS]
    cold = llm.generate(prompts, params)
    warm = llm.generate(prompts, params)
    assert all(o.num_cached_tokens > 0 for o in warm)
    for c, w, doc in zip(cold, warm, DOCS, strict=True):
        assert c.outputs[0].token_ids == [] and len(c.embedding) == 2
        _close(c.embedding[1], yes_prob(QUERY, doc)[0])
        _close(w.embedding[1], yes_prob(QUERY, doc)[0])
    assert llm.kv_stats().num_blocks_in_use == 0


def test_score_pooling_params_are_checked():
    from met import PoolingParams

    with pytest.raises(ValueError, match="token_ids"):
        PoolingParams(kind="score")
    with pytest.raises(ValueError, match="token_ids"):
        PoolingParams(kind="score", token_ids=(-1, 3))
    with pytest.raises(ValueError, match="token_ids"):
        PoolingParams(token_ids=(1, 2))
    with pytest.raises(ValueError, match="pooling"):
        PoolingParams("mean", kind="score", token_ids=(1, 2))
    with pytest.raises(ValueError, match="kind"):
        PoolingParams(kind="classify")


def test_score_mode_rule():
    from met.api.context import ServerConfig
    from met.sampling.scoring import resolve_score_mode

    class Tok:
        def __init__(self, spelled):
            self.spelled = spelled

        def encode(self, word, add_special_tokens=False):
            return self.spelled[word]

    one = Tok({"no": [7], "yes": [9]})
    split = Tok({"no": [1, 2], "yes": [9]})
    assert resolve_score_mode("auto", one) == ("yesno", (7, 9))
    assert resolve_score_mode("auto", split) == ("cosine", None)
    assert resolve_score_mode("cosine", one) == ("cosine", None)
    with pytest.raises(ValueError, match="--score-mode"):
        resolve_score_mode("yesno", split)
    with pytest.raises(ValueError, match="--score-mode"):
        ServerConfig(served_model_names=("m",), score_mode="dot")


def test_cli_flag_reaches_the_server_config(reranker, monkeypatch):
    import argparse

    import met.api.server
    from met.cli import serve as cli_serve

    seen = []
    monkeypatch.setattr(met.api.server, "serve",
                        lambda engine, config, attach=None: seen.append(config) or 0)
    p = argparse.ArgumentParser()
    cli_serve.add_parser(p.add_subparsers())
    for extra, want in (([], "auto"), (["--score-mode", "cosine"], "cosine")):
        args = p.parse_args(["serve", reranker, "--device", "cpu", "--no-tui", *extra])
        args.func(args)
        assert seen[-1].score_mode == want
    with pytest.raises(SystemExit):
        p.parse_args(["serve", reranker, "--score-mode", "dot"])
