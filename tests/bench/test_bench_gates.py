"""Real gates on the tiny Llama: each starts its own `met serve`, measures, stops it and
writes a record (floors from a temporary TOML, records in a temporary directory)."""

from __future__ import annotations

import json

import httpx
import pytest

from met.bench.runner import GateRun, run_gate
from met.bench.server import ManagedServer
from met.cli import main

SERVE = '[serve]\ndtype = "float32"\nmax-model-len = 256\n'


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return str(tiny_checkpoint("llama"))


def _floors(tmp_path, body: str):
    path = tmp_path / "floors.toml"
    path.write_text(SERVE + body)
    return path


def _no_server_left(data):
    return any(c["name"] == "kv_blocks_used_after_run" and c["ok"] for c in data["checks"])


def test_kat_equality_passes_signs_and_verifies(model, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MET_IDENTITY_DIR", str(tmp_path / "id"))
    floors = _floors(tmp_path, "[kat-equality]\nprompts = 6\nmax_tokens = 12\n")
    rc = main(["bench", "run", "kat-equality", "--model", model, "--floors", str(floors),
               "--records-dir", str(tmp_path / "records"), "--sign"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "kat-equality: PASS" in out
    record = next((tmp_path / "records" / "kat-equality").glob("*.json"))
    data = json.loads(record.read_text())
    assert data["verdict"] == "PASS" and data["model"] == model
    texts = data["metrics"]["texts"]
    assert len(texts) == 6 and all(texts.values())  # six non-empty outputs compared
    assert data["metrics"]["mismatches"] == []
    assert data["serve"]["settings"] == {"dtype": "float32", "max-model-len": 256}
    assert _no_server_left(data)
    assert main(["bench", "verify", str(record)]) == 0


def test_concurrency_sweep_two_rungs_pass_and_fail_on_floors(model, tmp_path):
    sweep = ("[concurrency-sweep]\nconcurrency = [1, 3]\nisl = 24\nosl = 8\nwarmup = 1\n"
             'min_output_tok_s = { "1" = 0.5, "3" = %s }\n')
    path, data = run_gate(GateRun("concurrency-sweep", model=model,
                                  floors=_floors(tmp_path, sweep % "1.0"),
                                  records_dir=tmp_path / "records"))
    assert data["verdict"] == "PASS", data["reason"]
    rungs = data["metrics"]["sweep"]["rungs"]
    assert [r["concurrency"] for r in rungs] == [1, 3]
    assert all(r["errors"] == 0 and r["min_output_tokens"] == 8 for r in rungs)
    assert _no_server_left(data)
    assert path.parent.name == "concurrency-sweep"

    _, failed = run_gate(GateRun("concurrency-sweep", model=model,
                                 floors=_floors(tmp_path, sweep % "1000000.0"),
                                 records_dir=tmp_path / "records"))
    assert failed["verdict"] == "FAIL"
    assert "c3.output_tok_s" in failed["reason"] and "(floor >= 1e+06)" in failed["reason"]
    assert "c1.output_tok_s" not in failed["reason"]  # the rung that met its floor


def test_a_perf_gate_without_floors_says_which_file_it_wanted(model, tmp_path, capsys):
    rc = main(["bench", "run", "decode-floor", "--model", model,
               "--records-dir", str(tmp_path)])
    assert rc == 2
    err = capsys.readouterr().err
    assert "no floors file for model" in err and "--floors FILE" in err
    assert not any(tmp_path.iterdir())  # nothing started, nothing recorded


def test_structured_validity_on_the_tiny_model(model, tmp_path):
    floors = _floors(tmp_path, "[structured-validity]\nrequests = 6\nmax_tokens = 96\n"
                               "concurrency = 3\n")
    _, data = run_gate(GateRun("structured-validity", model=model, floors=floors,
                               records_dir=tmp_path))
    assert "preflight_error" not in data["metrics"], data["metrics"]
    assert data["verdict"] == "PASS", data["reason"] + json.dumps(data["metrics"])[:2000]
    assert data["metrics"]["valid"] == 6


def test_the_gate_server_is_stopped_even_when_the_gate_fails(model):
    server = ManagedServer(model, {"dtype": "float32", "max-model-len": 256})
    with pytest.raises(RuntimeError, match="boom"), server:
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        raise RuntimeError("boom")
    assert server.proc is not None and server.proc.poll() is not None


def test_a_server_that_cannot_start_is_reported_with_its_log(model):
    server = ManagedServer(model, {"max-model-len": "lots"})
    with pytest.raises(RuntimeError, match=r"met serve exited \(2\)[\s\S]*max-model-len"):
        with server:
            pass
    assert server.proc is not None and server.proc.poll() is not None
