"""Several models in one server (`met serve --models-dir`): each model answers as it does
served alone, models load when a request names them, the least recently used idle one is
unloaded past --max-loaded-models, an idle one after --idle-unload-seconds, a model with a
request in flight never, and nothing (threads, weights) is left behind.

The app runs in the test process (httpx's ASGI transport) on tiny checkpoints: two HF
directories of different archs and a GGUF file, in one directory."""

from __future__ import annotations

import asyncio
import gc
import json
import sys
import threading
import time
import weakref
from pathlib import Path

import httpx
import pytest
from in_process import metric, run_with_app
from serve_harness import wait_until

from met.api.app import build_app
from met.api.context import ServerConfig
from met.api.model_pool import ModelPool, PoolConfig
from met.cli import main as cli_main
from met.config import EngineConfig
from met.engine.core import EngineCore
from met.loader.models_dir import collect_models, models_in_dir

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lora"))
from test_lora_gguf import write_gguf_base  # noqa: E402  (the tiny llama as a GGUF file)

ENGINE = {"dtype": "float32", "max_model_len": 256}
PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def models_dir(tiny_checkpoint, tmp_path_factory) -> Path:
    """llama-a/ and qwen-b/ (HF checkpoints of two archs) and tiny-q8.gguf."""
    root = tmp_path_factory.mktemp("models")
    (root / "llama-a").symlink_to(tiny_checkpoint("llama"), target_is_directory=True)
    (root / "qwen-b").symlink_to(tiny_checkpoint("qwen3"), target_is_directory=True)
    path, _ = write_gguf_base(Path(tiny_checkpoint("llama")),
                              tmp_path_factory.mktemp("gguf") / "out", "Q8_0")
    (root / "tiny-q8.gguf").symlink_to(path)
    (root / "notes.txt").write_text("not a model")
    (root / ".hidden").mkdir()
    return root


def _factory(path: str) -> EngineCore:
    return EngineCore(EngineConfig(model=path, **ENGINE))


def run_pool(models: dict[str, str], work, pool: PoolConfig | None = None,
             factory=_factory, **server_fields):
    """Serve ``models`` through the router app in this process; what ``work(client, pool)``
    returns. The app's lifespan has ended (every engine stopped) when this returns."""
    config = ServerConfig(served_model_names=("router",), **server_fields)
    model_pool = ModelPool(models, config, pool or PoolConfig(), factory)
    app = build_app(config, None, pool=model_pool)

    async def main():
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://met",
                                         timeout=120) as client:
                return await work(client, model_pool)

    return asyncio.run(main())


def _completion(model: str | None, max_tokens: int = 8) -> dict:
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "logprobs": 1}
    return body if model is None else {"model": model, **body}


async def _states(client: httpx.AsyncClient) -> dict[str, str]:
    return {m["id"]: m["state"] for m in (await client.get("/v1/models")).json()["data"]}


def _engine_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "met-engine" and t.is_alive()]


# --- which models a directory holds -------------------------------------------------------


def test_a_directory_lists_checkpoints_and_gguf_files_by_name(models_dir, tmp_path):
    found = models_in_dir(str(models_dir))
    assert list(found) == ["llama-a", "qwen-b", "tiny-q8"]  # notes.txt and .hidden skipped
    assert found["tiny-q8"] == str(models_dir / "tiny-q8.gguf")
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "x.gguf").write_bytes(b"")
    (tmp_path / "m" / "x").mkdir()
    (tmp_path / "m" / "x" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="two models would be served as 'x'"):
        models_in_dir(str(tmp_path / "m"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="--models-dir: no model in"):
        collect_models(str(tmp_path / "empty"), [], None)
    with pytest.raises(FileNotFoundError, match="not a directory"):
        models_in_dir(str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="not in the Hugging Face cache"):
        collect_models(None, ["no-such-org/no-such-model"], str(tmp_path))


def test_duplicate_names_between_dir_and_models_are_refused(models_dir):
    with pytest.raises(ValueError, match="--models: two models would be served as 'llama-a'"):
        collect_models(str(models_dir), [str(models_dir / "llama-a")], None)


def test_router_flags_are_checked_before_anything_loads(models_dir, capsys):
    """Each wrong combination is refused at startup with the flag it is about."""
    cases = [
        (["--max-loaded-models", "2"], "--max-loaded-models: only with --models-dir"),
        (["--idle-unload-seconds", "5"], "--idle-unload-seconds: only with --models-dir"),
        (["--models-dir", str(models_dir), str(models_dir / "llama-a")],
         "pass MODEL with --models instead"),
        (["--models-dir", str(models_dir), "--served-model-name", "x"],
         "--served-model-name: with --models-dir"),
        (["--models-dir", str(models_dir), "--max-loaded-models", "0"],
         "--max-loaded-models: must be >= 1"),
        (["--models-dir", str(models_dir), "--model-load-timeout", "0"],
         "--model-load-timeout: must be > 0"),
        (["--models-dir", str(models_dir), "--idle-unload-seconds", "-1"],
         "--idle-unload-seconds: must be > 0"),
        (["--models-dir", str(models_dir / "nope")], "is not a directory"),
    ]
    for args, message in cases:
        assert cli_main(["serve", *args]) == 2, args
        assert message in capsys.readouterr().err, args


def test_serve_help_lists_the_router_flags(capsys):
    with pytest.raises(SystemExit):
        cli_main(["serve", "--help"])
    out = capsys.readouterr().out
    for flag in ("--models-dir", "--models", "--max-loaded-models", "--idle-unload-seconds",
                 "--model-load-timeout"):
        assert flag in out


# --- serving ------------------------------------------------------------------------------


def _alone(path: str) -> dict:
    """The model at ``path`` served alone (the one-model server as before)."""
    async def work(client):
        r = await client.post("/v1/completions", json=_completion("tiny"))
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]

    return run_with_app(path, None, work, **ENGINE)


def test_each_model_answers_as_it_does_served_alone(models_dir):
    """Greedy text and logprobs through the router equal those of the model served alone,
    for two HF archs and a GGUF file; the response names the model asked for."""
    models = models_in_dir(str(models_dir))

    async def work(client, pool):
        assert await _states(client) == dict.fromkeys(models, "unloaded")
        assert (await client.get("/health")).json() == {
            "status": "ok", "models": dict.fromkeys(models, "unloaded")}
        got = {}
        for name in models:
            r = await client.post("/v1/completions", json=_completion(name))
            assert r.status_code == 200, r.text
            assert r.json()["model"] == name
            got[name] = r.json()["choices"][0]
        assert await _states(client) == dict.fromkeys(models, "loaded")
        card = (await client.get("/v1/models/qwen-b")).json()
        assert card["state"] == "loaded" and card["max_model_len"] == 256
        assert await metric(client, "met_models_loaded") == 3
        return got

    got = run_pool(models, work)
    texts = set()
    for name, path in models.items():
        alone = _alone(path)
        assert got[name]["text"] == alone["text"], name
        assert got[name]["logprobs"]["tokens"] == alone["logprobs"]["tokens"], name
        assert got[name]["logprobs"]["token_logprobs"] == pytest.approx(
            alone["logprobs"]["token_logprobs"], abs=1e-5), name
        texts.add(got[name]["text"])
    assert len(texts) >= 2  # different models did answer (not one engine for all)


_ROUTES = [  # every route that takes `model`, with a body it accepts
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": 2}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 2}),
    ("/v1/embeddings", {"input": "hi"}),
    ("/v1/score", {"text_1": "a", "text_2": "b"}),
    ("/v1/rerank", {"query": "a", "documents": ["b", "c"]}),
    ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    ("/v1/messages/count_tokens", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/tokenize", {"prompt": "hi"}),
    ("/detokenize", {"tokens": [5, 6]}),
]


def test_every_route_goes_to_the_model_it_names(models_dir):
    """With one model loaded at a time, each route naming the other model loads it (and
    unloads the first): the request was served by the engine it named. States are listed
    as the least recently used one goes."""
    models = {k: v for k, v in models_in_dir(str(models_dir)).items() if k != "tiny-q8"}
    template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"

    async def work(client, pool):
        expected_unloads = 0
        for i, (route, body) in enumerate(_ROUTES):
            name = ("llama-a", "qwen-b")[i % 2]
            r = await client.post(route, json={"model": name, **body})
            assert r.status_code == 200, (route, r.text)
            states = await _states(client)
            assert states[name] == "loaded", route
            assert states[next(n for n in models if n != name)] == "unloaded", route
            expected_unloads += i > 0
        assert await metric(client, "met_model_unloads_total") == expected_unloads
        assert await metric(client, "met_models_loaded") == 1
        # A request naming no model cannot be routed: 400 naming the field.
        r = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "model"
        assert "'llama-a', 'qwen-b'" in r.json()["error"]["message"]

    run_pool(models, work, PoolConfig(max_loaded_models=1), chat_template=template)


def test_unknown_model_is_a_404_naming_the_field_and_what_exists(models_dir):
    models = models_in_dir(str(models_dir))

    async def work(client, pool):
        r = await client.post("/v1/completions", json=_completion("gpt-9"))
        assert r.status_code == 404
        err = r.json()["error"]
        assert err["param"] == "model" and err["code"] == "model_not_found"
        assert "'gpt-9'" in err["message"] and "'llama-a', 'qwen-b', 'tiny-q8'" in err["message"]
        r = await client.post("/v1/messages", json={
            "model": "gpt-9", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 404  # Anthropic's shape under /v1/messages
        assert r.json()["type"] == "error" and "'gpt-9'" in r.json()["error"]["message"]
        assert (await client.get("/v1/models/gpt-9")).status_code == 404
        r = await client.post("/models/load", json={"model": "gpt-9"})
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"
        assert await _states(client) == dict.fromkeys(models, "unloaded")  # nothing loaded

    run_pool(models, work)


def test_idle_model_is_unloaded_and_reloads_on_the_next_request(models_dir):
    models = {"llama-a": str(models_dir / "llama-a")}

    async def work(client, pool):
        first = (await client.post("/v1/completions", json=_completion("llama-a"))).json()
        assert (await _states(client))["llama-a"] == "loaded"
        for _ in range(200):
            if (await _states(client))["llama-a"] == "unloaded":
                break
            await asyncio.sleep(0.05)
        assert (await _states(client))["llama-a"] == "unloaded"
        assert not _engine_threads()  # its engine thread has ended
        assert await metric(client, "met_model_unloads_total") == 1
        again = (await client.post("/v1/completions", json=_completion("llama-a"))).json()
        assert again["choices"][0]["text"] == first["choices"][0]["text"]

    run_pool(models, work, PoolConfig(idle_unload_seconds=0.3))


class _Gate:
    """A core factory whose loads of ``slow`` wait until ``release()``."""

    def __init__(self, slow: str):
        self.slow = slow
        self.event = threading.Event()

    def __call__(self, path: str) -> EngineCore:
        if path == self.slow:
            assert self.event.wait(60)
        return _factory(path)

    def release(self) -> None:
        self.event.set()


def test_load_timeout_answers_503_and_the_load_goes_on(models_dir):
    models = {"llama-a": str(models_dir / "llama-a"), "qwen-b": str(models_dir / "qwen-b")}
    gate = _Gate(models["qwen-b"])

    async def work(client, pool):
        t0 = time.monotonic()
        r = await client.post("/v1/completions", json=_completion("qwen-b"))
        assert r.status_code == 503 and r.headers["retry-after"] == "5"
        err = r.json()["error"]
        assert err["code"] == "model_load_timeout" and err["param"] == "model"
        assert "--model-load-timeout" in err["message"] and "'qwen-b'" in err["message"]
        assert time.monotonic() - t0 < 30
        assert (await _states(client))["qwen-b"] == "loading"
        h = await client.get("/health")  # the server stays healthy while a model loads
        assert h.status_code == 200 and h.json()["models"]["qwen-b"] == "loading"
        # Another model is served meanwhile? Loads run one at a time: it waits its turn.
        gate.release()
        for _ in range(400):
            if (await _states(client))["qwen-b"] == "loaded":
                break
            await asyncio.sleep(0.05)
        r = await client.post("/v1/completions", json=_completion("qwen-b"))
        assert r.status_code == 200

    run_pool(models, work, PoolConfig(load_timeout=0.5), factory=gate)


def test_a_model_with_a_request_in_flight_is_never_unloaded(models_dir, start_server):
    """`met serve --models-dir` with one model loaded at a time: while a stream on llama-a
    runs, a request for qwen-b waits (503 after --model-load-timeout, saying the loaded
    models are busy) and POST /models/unload of llama-a is a 409; the stream ends whole;
    then the load asked for goes on, unloading llama-a. (A real server: httpx's ASGI
    transport would only return the stream once it has ended.)"""
    server = start_server(["--models-dir", str(models_dir), "--dtype", "float32",
                           "--max-model-len", "512", "--max-loaded-models", "1",
                           "--model-load-timeout", "0.1"])

    def states(http) -> dict[str, str]:
        return {m["id"]: m["state"] for m in http.get("/v1/models").json()["data"]}

    # the stream (480 tokens) outlasts qwen-b's 0.1 s wait and the unload by far
    long = {**_completion("llama-a", 480), "ignore_eos": True}
    with httpx.Client(base_url=server.url, timeout=120) as http:
        assert http.get("/health").json()["status"] == "ok"  # ok with nothing loaded
        http.post("/models/load", json={"model": "llama-a"})  # 200, or 503 if over 0.1 s
        assert wait_until(lambda: states(http)["llama-a"] == "loaded", 120)
        with http.stream("POST", "/v1/completions", json={**long, "stream": True}) as stream:
            lines = stream.iter_lines()
            first = next(lines)
            assert first.startswith("data: ")
            r = http.post("/v1/completions", json=_completion("qwen-b"))
            assert r.status_code == 503, r.text
            assert "--max-loaded-models" in r.json()["error"]["message"]
            r = http.post("/models/unload", json={"model": "llama-a"})
            assert r.status_code == 409 and "in flight" in r.json()["error"]["message"]
            assert states(http)["llama-a"] == "loaded"
            text = [json.loads(first[6:])["choices"][0]["text"]]
            for line in lines:
                if line.startswith("data: {"):
                    text += [c["text"] for c in json.loads(line[6:])["choices"]]
        assert wait_until(lambda: states(http) == {"llama-a": "unloaded", "qwen-b": "loaded",
                                                   "tiny-q8": "unloaded"}), states(http)
        assert server.metric("met_model_unloads_total", model_name="llama-a",
                             reason="lru") == 1
        http.post("/models/load", json={"model": "llama-a"})  # a load takes over 0.1 s
        assert wait_until(lambda: states(http)["llama-a"] == "loaded", 120)
        whole = http.post("/v1/completions", json=long).json()["choices"][0]["text"]
        assert "".join(text) == whole  # nothing cut, and llama-a reloaded answers the same


def test_load_and_unload_endpoints_free_the_engine(models_dir):
    """POST /models/load and /models/unload; after unload the engine thread has ended and
    the core (its weights and KV pool) is garbage; after shutdown no engine thread is left."""
    models = {"llama-a": str(models_dir / "llama-a"), "qwen-b": str(models_dir / "qwen-b")}
    before = len(_engine_threads())

    async def work(client, pool):
        r = await client.post("/models/load", json={"model": "llama-a"})
        assert r.json() == {"success": True, "model": "llama-a", "state": "loaded",
                            "already_loaded": False}
        r = await client.post("/models/load", json={"model": "llama-a"})
        assert r.json()["already_loaded"] is True
        assert len(_engine_threads()) == before + 1
        core = weakref.ref(pool.entries["llama-a"].ctx.engine.core)
        r = await client.post("/models/unload", json={"model": "llama-a"})
        assert r.json() == {"success": True, "model": "llama-a", "state": "unloaded",
                            "already_unloaded": False}
        gc.collect()
        assert core() is None, "the unloaded model's core is still referenced"
        assert len(_engine_threads()) == before
        r = await client.post("/models/unload", json={"model": "llama-a"})
        assert r.json()["already_unloaded"] is True
        r = await client.post("/models/load", json={"model": 3})
        assert r.status_code == 400 and r.json()["error"]["param"] == "model"
        await client.post("/models/load", json={"model": "qwen-b"})
        await client.post("/v1/completions", json=_completion("llama-a"))
        assert len(_engine_threads()) == before + 2

    run_pool(models, work)
    assert len(_engine_threads()) == before  # shutdown stopped both


def test_load_endpoints_are_behind_the_api_key(models_dir):
    models = {"llama-a": str(models_dir / "llama-a")}

    async def work(client, pool):
        for path in ("/models/load", "/models/unload", "/v1/completions"):
            r = await client.post(path, json={"model": "llama-a", "prompt": "x"})
            assert r.status_code == 401, path
        assert (await client.get("/v1/models")).status_code == 401
        assert pool.entries["llama-a"].state == "unloaded"  # no keyless load happened
        r = await client.post("/models/load", json={"model": "llama-a"},
                              headers={"Authorization": "Bearer k"})
        assert r.status_code == 200

    run_pool(models, work, api_keys=("k",))


def test_a_model_that_fails_to_load_is_listed_as_failed(models_dir, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "no-such-arch"}')
    models = {"broken": str(broken), "llama-a": str(models_dir / "llama-a")}

    async def work(client, pool):
        r = await client.post("/v1/completions", json=_completion("broken"))
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_load_failed"
        assert "'broken' failed to load" in r.json()["error"]["message"]
        card = (await client.get("/v1/models/broken")).json()
        assert card["state"] == "failed" and card["error"]
        assert not _engine_threads()
        r = await client.post("/v1/completions", json=_completion("llama-a"))
        assert r.status_code == 200  # the others still serve
        assert await metric(client, "met_model_loads_total") == 2  # one failed, one loaded

    run_pool(models, work)


def test_sleep_routes_take_the_model_as_a_query_parameter(models_dir):
    """/sleep and /wake_up act on ``?model=``'s engine; stored responses are the server's
    (retrieved without naming a model)."""
    models = {"llama-a": str(models_dir / "llama-a"), "qwen-b": str(models_dir / "qwen-b")}

    async def work(client, pool):
        await client.post("/models/load", json={"model": "llama-a"})
        r = await client.post("/sleep?model=llama-a")
        assert r.status_code == 200 and r.json()["status"] == "sleeping"
        r = await client.post("/v1/completions", json=_completion("llama-a"))
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_sleeping"
        assert (await client.post("/v1/completions", json=_completion("qwen-b"))).status_code \
            == 200
        assert (await client.post("/wake_up?model=llama-a")).status_code == 200
        r = await client.post("/v1/completions", json=_completion("llama-a"))
        assert r.status_code == 200
        assert (await client.post("/sleep")).json()["error"]["param"] == "model"
        r = await client.post("/v1/responses", json={"model": "qwen-b", "input": "hi",
                                                     "max_output_tokens": 2})
        assert r.status_code == 200, r.text
        got = await client.get(f"/v1/responses/{r.json()['id']}")
        assert got.status_code == 200 and got.json()["model"] == "qwen-b"

    run_pool(models, work, chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
