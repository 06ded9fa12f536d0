"""`met bench sweep` statistics against a fake server whose delays are known."""

from __future__ import annotations

import asyncio
import json

import pytest
from fake_openai import OVERHEAD, FakeBehaviour, FakeServer

from met.bench.loadgen import Target
from met.bench.stats import percentile
from met.bench.sweep import SweepSettings, run_sweep
from met.cli import main

# Requests arrive with these time-to-first-token delays (each once per 8 requests).
TTFTS = [0.05, 0.10, 0.15, 0.20, 0.25, 0.30, 0.35, 0.60]
TPOT = 0.03
# Scheduling on a loaded machine only ever adds time: measured values may exceed the
# known delays by this much, never fall below them.
SLACK_S = 0.15


@pytest.fixture
def fake():
    server = FakeServer(FakeBehaviour(ttfts=TTFTS, tpot=TPOT)).start()
    yield server
    server.stop()


def _sweep(fake, model="fake", endpoint="completions", **settings):
    base = dict(concurrency=(8,), isl=20, osl=6, reps=1, warmup=0)
    base.update(settings)
    target = Target(fake.url, model, endpoint)
    return asyncio.run(run_sweep(target, SweepSettings(**base)))


def test_percentile_matches_numpy_linear_interpolation():
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert percentile(xs, 50) == 3.0
    assert percentile(xs, 90) == pytest.approx(4.6)
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 5.0
    assert percentile([], 50) is None
    with pytest.raises(ValueError, match="q must be in 0..100"):
        percentile(xs, 101)


def _ttfts_within_slack(rung) -> bool:
    """Every TTFT percentile at or above the server's delay (always, a measuring bug
    otherwise) and no more than SLACK_S above it (unless the machine stalled)."""
    for q, measured in ((50, rung.ttft_p50_ms), (90, rung.ttft_p90_ms), (99, rung.ttft_p99_ms)):
        expected = percentile(TTFTS, q) * 1000
        assert expected <= measured, (q, measured, expected)
        if measured > expected + SLACK_S * 1000:
            return False
    return True


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_rung_percentiles_reflect_the_servers_delays(fake, endpoint):
    # One unmeasured request first pays the client's and server's first-use costs; it takes
    # one delay of the cycle, so the rung's eight still see each delay once. A stall of the
    # whole (2-core, shared) machine can still push a rung past the slack: up to three tries,
    # each of which must keep every percentile at or above the true delay.
    for _ in range(3):
        rung = _sweep(fake, endpoint=endpoint, warmup=1).rungs[0]
        assert rung.requests == 8 and rung.errors == 0
        if _ttfts_within_slack(rung):
            break
    else:
        pytest.fail(f"TTFT percentiles stayed more than {SLACK_S}s above the server's delays "
                    f"in three tries: {rung.ttft_p50_ms, rung.ttft_p90_ms, rung.ttft_p99_ms}")
    assert rung.ttft_p90_ms > rung.ttft_p50_ms + 100  # the slow tail is visible
    assert TPOT * 1000 <= rung.tpot_p50_ms <= (TPOT + 0.03) * 1000
    # e2e = ttft + 5 gaps of TPOT; the median request's ttft is between 0.20 and 0.25.
    assert (0.20 + 5 * TPOT) * 1000 <= rung.e2e_p50_ms <= (0.25 + 5 * TPOT + SLACK_S) * 1000
    assert rung.output_tokens == 8 * 6 and rung.min_output_tokens == 6
    assert rung.usage_reported
    # Eight parallel streams of six tokens, the slowest done after ~0.6 + 5·0.03 s.
    assert rung.output_tok_s <= 48 / (0.60 + 5 * TPOT)
    assert rung.mean_prompt_tokens == pytest.approx(20, abs=2)


def test_requests_carry_ignore_eos_usage_option_and_distinct_prompts(fake):
    _sweep(fake)
    streamed = [b for b in fake.behaviour.bodies if b.get("stream")]
    assert len(streamed) == 8
    assert all(b["ignore_eos"] is True and b["max_tokens"] == 6 for b in streamed)
    assert all(b["stream_options"] == {"include_usage": True} for b in streamed)
    assert len({b["prompt"] for b in streamed}) == 8
    # Prompts were sized with the server's own counts: words + overhead ≈ isl.
    assert all(abs(len(b["prompt"].split()) + OVERHEAD - 20) <= 1 for b in streamed)


def test_sweeps_decode_greedily_unless_told_to_sample(fake):
    _sweep(fake)
    greedy = [b for b in fake.behaviour.bodies if b.get("stream")]
    assert all(b["temperature"] == 0.0 and "top_p" not in b and "top_k" not in b
               for b in greedy)
    fake.behaviour.bodies.clear()
    _sweep(fake, temperature=0.8, top_p=0.95, top_k=40)
    sampled = [b for b in fake.behaviour.bodies if b.get("stream")]
    assert len(sampled) == 8
    assert all((b["temperature"], b["top_p"], b["top_k"]) == (0.8, 0.95, 40) for b in sampled)


def test_without_usage_tokens_are_counted_from_chunks(fake):
    rung = _sweep(fake, model="fake-no-usage").rungs[0]
    assert rung.errors == 0
    assert not rung.usage_reported
    assert rung.output_tokens == 8 * 6 and rung.min_output_tokens == 6


def test_an_error_event_mid_stream_counts_as_an_error(fake):
    rung = _sweep(fake, model="fake-fail", concurrency=(2,)).rungs[0]
    assert rung.errors == 2 and rung.output_tokens == 0
    assert "engine fell over" in rung.first_error


def test_cli_sweep_writes_json_and_plot_and_reports_http_errors(fake, tmp_path, capsys):
    out, png = tmp_path / "s.json", tmp_path / "s.png"
    rc = main(["bench", "sweep", "--url", fake.url, "--concurrency", "1,8", "--isl", "12",
               "--osl", "4", "--warmup", "1", "--out", str(out), "--plot", str(png)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["model"] == "fake"  # taken from /v1/models
    assert [r["concurrency"] for r in data["rungs"]] == [1, 8]
    assert data["settings"]["osl"] == 4
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = capsys.readouterr().out
    assert "TTFT p50" in table and "out tok/s" in table

    rc = main(["bench", "sweep", "--url", fake.url, "--model", "fake-400",
               "--concurrency", "1", "--osl", "4", "--warmup", "0"])
    assert rc == 1
    assert "temperature: must be in 0..2" in capsys.readouterr().err


def test_bad_flags_name_the_flag(capsys):
    assert main(["bench", "sweep", "--concurrency", "0,2"]) == 2
    assert "--concurrency" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "sweep", "--concurrency", "a,b"])
    assert "not a comma list of integers" in capsys.readouterr().err
    assert main(["bench", "sweep", "--temperature", "0.8", "--top-p", "0"]) == 2
    assert "--top-p" in capsys.readouterr().err
