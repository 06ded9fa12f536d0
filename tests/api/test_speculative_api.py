"""Speculative decoding through the server: the same text with it on or off per request
(`"speculative": false`), a 400 naming a bad value, /metrics counting drafts, and
--speculative-config refused with a message naming the key when it is wrong."""

from __future__ import annotations

import subprocess
import sys

from in_process import metric, run_with_app, settled
from tiny_models import oracle_prompt

SPEC = {"method": "ngram", "gate": False}


def test_speculation_per_request_metrics_and_bad_field(ckpt):
    prompt = oracle_prompt("llama", 40)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 48, "temperature": 0,
            "ignore_eos": True}

    async def work(client):
        off = (await client.post("/v1/completions", json=body | {"speculative": False})).json()
        drafted_off = await metric(client, "met_spec_decode_num_draft_tokens")
        on = (await client.post("/v1/completions", json=body)).json()
        bad = await client.post("/v1/completions", json=body | {"speculative": "maybe"})
        msg = await client.post("/v1/messages", json={
            "model": "tiny", "max_tokens": 8, "speculative": False,
            "messages": [{"role": "user", "content": "hi"}]})
        resp = await client.post("/v1/responses", json={
            "model": "tiny", "input": "hi", "max_output_tokens": 8, "speculative": False})
        bad_resp = await client.post("/v1/responses", json={
            "model": "tiny", "input": "hi", "speculative": [1]})
        assert resp.status_code == 200, resp.text
        assert bad_resp.status_code == 400 and "speculative" in bad_resp.text
        return (off, on, drafted_off, await metric(client, "met_spec_decode_num_draft_tokens"),
                await metric(client, "met_spec_decode_num_accepted_tokens"),
                await metric(client, "met_spec_decode_mean_accepted_length"), bad, msg,
                await settled(client))

    off, on, drafted_off, drafted, accepted, length, bad, msg, left = run_with_app(
        ckpt, None, work, speculative_config=SPEC)
    assert on["choices"][0]["text"] == off["choices"][0]["text"]
    assert on["usage"]["completion_tokens"] == 48
    assert drafted_off == 0  # the request that opted out drafted nothing
    assert drafted > 0 and 0 < accepted <= drafted and length > 1
    assert bad.status_code == 400 and "speculative" in bad.text
    assert msg.status_code == 200, msg.text
    assert left == (0, 0)


def test_bad_speculative_config_is_refused_naming_the_key(ckpt):
    for value, named in (('{"method": "eagle9"}', "speculative_config.method"),
                         ('{"num_speculative_tokens": 99}',
                          "speculative_config.num_speculative_tokens"),
                         ('{"methd": "ngram"}', "methd"),
                         ("{not json", "not valid JSON")):
        run = subprocess.run(
            [sys.executable, "-m", "met.cli", "generate", ckpt, "--prompt", "hi",
             "--speculative-config", value],
            capture_output=True, text=True, timeout=120, check=False)
        assert run.returncode == 2 and "--speculative-config" in run.stderr, run.stderr
        assert named in run.stderr, run.stderr
