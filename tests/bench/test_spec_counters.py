"""`met bench sweep` reads a met server's speculative decoding counters from /metrics and
reports what each rung drafted and accepted; other servers' pages give nothing."""

from __future__ import annotations

import asyncio

import httpx

from met.bench.loadgen import Target
from met.bench.sweep import spec_counters, spec_delta

PAGE = """# HELP met_spec_decode_num_draft_tokens Speculative draft tokens verified since start
# TYPE met_spec_decode_num_draft_tokens gauge
met_spec_decode_num_draft_tokens{method="ngram",model_name="m"} 120.0
# HELP met_spec_decode_num_accepted_tokens Of them, the ones the target accepted
# TYPE met_spec_decode_num_accepted_tokens gauge
met_spec_decode_num_accepted_tokens{method="ngram",model_name="m"} 90.0
# HELP met_spec_decode_num_verifies Request steps that verified drafts
# TYPE met_spec_decode_num_verifies gauge
met_spec_decode_num_verifies{method="ngram",model_name="m"} 30.0
# HELP met_requests_running Requests running in the engine
# TYPE met_requests_running gauge
met_requests_running{model_name="m"} 0.0
"""


def _read(body: str, status: int = 200):
    transport = httpx.MockTransport(lambda request: httpx.Response(status, text=body))

    async def go():
        async with httpx.AsyncClient(transport=transport) as client:
            return await spec_counters(client, Target("http://met", "m"))

    return asyncio.run(go())


def test_counters_per_method_and_the_rungs_delta():
    after = _read(PAGE)
    assert after == {"ngram": {"drafted": 120.0, "accepted": 90.0, "verifies": 30.0}}
    before = {"ngram": {"drafted": 20.0, "accepted": 10.0, "verifies": 10.0}}
    d = spec_delta(before, after)["ngram"]
    assert (d["drafted"], d["accepted"], d["verifies"]) == (100.0, 80.0, 20.0)
    assert d["acceptance_rate"] == 0.8 and d["mean_accepted_length"] == 5.0


def test_servers_without_the_counters_give_none():
    assert _read("met_requests_running 1\n") is None
    assert _read("not found", status=404) is None
    assert _read("{ this is not prometheus text") is None
    assert spec_delta(None, None) is None
