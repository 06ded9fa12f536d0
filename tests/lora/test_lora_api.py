"""Adapters over HTTP: `model` or `adapter` picks one on the OpenAI and Anthropic routes,
/v1/models lists them under their base, and they load and unload while serving."""

from __future__ import annotations

import sys
from pathlib import Path

from tiny_models import greedy_trace, load_hf_model_with, load_tokenizer, oracle_prompts

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "api"))
from in_process import run_with_app  # noqa: E402
from test_lora_exact import MAX_NEW, make_adapter, peft_model  # noqa: E402


def _body(model: str, prompt: list[int], **extra) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": MAX_NEW, "temperature": 0,
            "ignore_eos": True, **extra}


def test_adapters_over_http(tiny_checkpoint, tmp_path):
    model_dir = tiny_checkpoint("llama")
    a = make_adapter(model_dir, tmp_path / "a", seed=1)
    b = make_adapter(model_dir, tmp_path / "b", seed=2)
    prompt = oracle_prompts("llama")[0]
    want_a = greedy_trace(peft_model(model_dir, a), prompt, MAX_NEW).tokens
    want_b = greedy_trace(peft_model(model_dir, b), prompt, MAX_NEW).tokens
    base = greedy_trace(load_hf_model_with(model_dir), prompt, MAX_NEW).tokens
    tokenizer = load_tokenizer(model_dir)

    def text(ids):
        return tokenizer.decode(ids, skip_special_tokens=True)

    want_a, want_b, base = text(want_a), text(want_b), text(base)

    async def work(client):
        out = {}
        models = (await client.get("/v1/models")).json()["data"]
        out["models"] = {m["id"]: m["parent"] for m in models}

        async def tokens(body):
            r = await client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        out["by_model"] = await tokens(_body("a", prompt))
        out["by_field"] = await tokens(_body("tiny", prompt, adapter="a"))
        out["base"] = await tokens(_body("tiny", prompt))
        r = await client.post("/v1/completions", json=_body("tiny", prompt, adapter="zz"))
        out["unknown"] = (r.status_code, r.json()["error"])
        r = await client.post("/v1/messages", json={
            "model": "a", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
        out["anthropic"] = r.status_code
        r = await client.post("/v1/load_lora_adapter",
                              json={"lora_name": "b", "lora_path": str(b)})
        out["load"] = r.status_code
        out["loaded_b"] = await tokens(_body("b", prompt))
        r = await client.post("/v1/load_lora_adapter",
                              json={"lora_name": "c", "lora_path": str(tmp_path / "none")})
        out["bad_load"] = (r.status_code, r.json()["error"]["message"])
        out["metrics"] = (await client.get("/metrics")).text
        out["unload"] = (await client.post("/v1/unload_lora_adapter",
                                           json={"lora_name": "b"})).status_code
        r = await client.post("/v1/completions", json=_body("b", prompt))
        out["after_unload"] = r.status_code
        return out

    out = run_with_app(str(model_dir), None, work, server_fields={"allow_runtime_lora": True},
                       quantization="none", lora_modules={"a": str(a)})
    assert out["models"] == {"tiny": None, "a": "tiny"}
    assert out["by_model"] == want_a and out["by_field"] == want_a
    assert out["base"] == base and base != want_a
    assert out["unknown"][0] == 404 and out["unknown"][1]["param"] == "adapter"
    assert out["anthropic"] == 200
    assert out["load"] == 200 and out["loaded_b"] == want_b
    assert out["bad_load"][0] == 400 and "not a directory" in out["bad_load"][1]
    assert out["unload"] == 200 and out["after_unload"] == 404
    # /metrics per adapter: a served 3 requests (2 completions, 1 message), b one.
    metrics = _samples(out["metrics"])
    assert metrics[("met_lora_requests_total", "a")] == 3
    assert metrics[("met_lora_requests_total", "b")] == 1
    assert metrics[("met_lora_generation_tokens_total", "a")] == 2 * MAX_NEW + 4
    assert metrics[("met_lora_adapter_info", "a")] == 1
    assert metrics[("met_lora_adapter_requests", "a")] == 0


def _samples(text: str) -> dict[tuple[str, str | None], float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, s.labels.get("adapter")): s.value
            for f in text_string_to_metric_families(text) for s in f.samples
            if s.name.startswith("met_lora")}


def test_runtime_loading_is_off_unless_allowed(tiny_checkpoint, tmp_path):
    model_dir = tiny_checkpoint("llama")
    a = make_adapter(model_dir, tmp_path / "a", seed=1)

    async def work(client):
        r = await client.post("/v1/load_lora_adapter", json={"lora_name": "a",
                                                             "lora_path": str(a)})
        return r.status_code, r.json()["error"]["message"]

    status, message = run_with_app(str(model_dir), None, work, enable_lora=True)
    assert status == 403 and "--allow-runtime-lora" in message


def test_runtime_adapters_come_back_after_a_level_2_sleep(tiny_checkpoint, tmp_path):
    """/sleep?level=2 drops the weights and every adapter with them; /wake_up reads the base
    and --lora-modules again, and the adapters loaded at runtime too (one whose files were
    deleted meanwhile is left out: 404, the others serve)."""
    import shutil

    model_dir = tiny_checkpoint("llama")
    a, b, c = (make_adapter(model_dir, tmp_path / n, seed=s)
               for n, s in (("a", 1), ("b", 2), ("c", 3)))
    prompt = oracle_prompts("llama")[0]
    tokenizer = load_tokenizer(model_dir)
    want_b = tokenizer.decode(greedy_trace(peft_model(model_dir, b), prompt, MAX_NEW).tokens,
                              skip_special_tokens=True)

    async def work(client):
        for name, path in (("b", b), ("c", c)):
            r = await client.post("/v1/load_lora_adapter",
                                  json={"lora_name": name, "lora_path": str(path)})
            assert r.status_code == 200, r.text
        assert (await client.post("/sleep", params={"level": 2})).status_code == 200
        shutil.rmtree(c)
        assert (await client.post("/wake_up")).status_code == 200
        models = {m["id"] for m in (await client.get("/v1/models")).json()["data"]}
        r = await client.post("/v1/completions", json=_body("b", prompt))
        gone = await client.post("/v1/completions", json=_body("c", prompt))
        return models, r.status_code, r.json(), gone.status_code

    models, status, body, gone = run_with_app(
        str(model_dir), None, work, server_fields={"allow_runtime_lora": True},
        quantization="none", lora_modules={"a": str(a)})
    assert models == {"tiny", "a", "b"}
    assert status == 200 and body["choices"][0]["text"] == want_b
    assert gone == 404
