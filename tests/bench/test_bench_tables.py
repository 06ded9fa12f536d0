"""`met bench tables`: docs tables generated from .benchmarks records (no server needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from met.bench.tables import TABLES, Ladder, Table, gates_table, refresh, runs_table, update
from met.cli import main

REPO = Path(__file__).resolve().parents[2]


def _rung(c, tok_s, ttft, tpot, errors=0):
    return {"concurrency": c, "requests": c, "errors": errors, "output_tok_s": tok_s,
            "ttft_p50_ms": ttft, "tpot_p50_ms": tpot}


def _sweep(path: Path, label: str, rungs, temperature=0.0):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "kind": "met-bench-sweep", "label": label, "created_at": "2026-01-02T03:04:05+00:00",
        "settings": {"concurrency": [r["concurrency"] for r in rungs], "isl": 110, "osl": 128,
                     "reps": 1, "temperature": temperature, "top_p": 1.0, "top_k": 0},
        "rungs": rungs}))


@pytest.fixture
def records(tmp_path):
    run = tmp_path / "peers" / "2026-01-02-zen3-x"
    _sweep(run / "met-auto.json", "met-auto",
           [_rung(1, 150.0, 100.0, 5.0), _rung(4, 300.0, 1234.5, 9.876)])
    _sweep(run / "llama-server.json", "llama-server",
           [_rung(1, 75.0, 400.0, 8.0), _rung(4, 100.0, 2000.0, 30.0)])
    _sweep(run / "vllm.json", "vllm", [_rung(1, 20.0, 90.0, 40.0), _rung(4, 120.0, 900.0, 35.0)])
    (run / "compare.txt").write_text("not a record\n")
    gate = tmp_path / "decode-floor" / "2026-01-02-0123456789.json"
    gate.parent.mkdir(parents=True)
    gate.write_text(json.dumps({
        "kind": "met-bench-record", "gate": "decode-floor",
        "git": {"sha": "0123456789abcdef", "dirty_paths": []},
        "hardware": {"cpu_model": "Test CPU", "cpu_cores": 2},
        "serve": {"settings": {"dtype": "bfloat16"}},
        "checks": [{"name": "errors", "measured": 0, "op": "==", "floor": 0, "ok": True},
                   {"name": "decode_tok_s_median", "measured": 51.39, "op": ">=",
                    "floor": 30.0, "ok": True}],
        "verdict": "PASS"}))
    return tmp_path


LADDER = Ladder(run="2026-01-02-zen3-x", machine="Test machine", commit="abc1234",
                command="bash benchmarks/compare_peers.sh",
                columns=(("met-auto", "met"), ("llama-server", "llama.cpp"), ("vllm", "vLLM")))


def test_ladder_table_from_fake_records(records):
    assert LADDER.render(records) == "\n".join([
        "| output tok/s | met | llama.cpp | vLLM | met default / best peer |",
        "|---|---|---|---|---|",
        "| 1 stream | **150.0** | 75.0 | 20.0 | 2.00× |",
        "| 4 streams | **300.0** | 100.0 | 120.0 | 2.50× |",
        "| TTFT p50, 1 stream | 100.0 ms | 400.0 ms | **90.0 ms** |  |",
        "| TTFT p50, 4 streams | 1,234 ms | 2,000 ms | **900.0 ms** |  |",
        "| TPOT p50, 1 stream | **5.00 ms** | 8.00 ms | 40.00 ms |  |",
        "",
        "Record `.benchmarks/peers/2026-01-02-zen3-x` (2026-01-02, met at `abc1234`): "
        "`bash benchmarks/compare_peers.sh`; ≈110-token prompts, 128 output tokens, 1 request "
        "per client per rung, greedy. Machine: Test machine.",
    ])


def test_runs_and_gates_tables_from_fake_records(records):
    assert runs_table(records).splitlines()[2:] == [
        "| `2026-01-02-zen3-x` | AMD EPYC Zen 3 | met-auto | 1–4 | 150.0 / 300.0 | "
        "75.0 / 120.0 (llama.cpp / vLLM-CPU) | 2.00× / 2.50× |"]
    assert gates_table(records).splitlines()[2:] == [
        "| `decode-floor` | `2026-01-02-0123456789.json` | `0123456` | Test CPU, 2 cores | "
        "`--dtype bfloat16` | PASS | decode_tok_s_median 51.4 ≥ 30.0; 1 equality check holds |"]


def test_a_rung_with_errors_has_no_rate(records):
    run = records / "peers" / "2026-01-02-zen3-x"
    _sweep(run / "llama-server.json", "llama-server",
           [_rung(1, 75.0, 400.0, 8.0), _rung(4, 100.0, 2000.0, 30.0, errors=1)])
    row = LADDER.render(records).splitlines()[3]
    assert row == "| 4 streams | **300.0** | – | 120.0 | 2.50× |"


def test_update_rewrites_between_markers_and_check_only_reports(records, tmp_path):
    tables = {"served": Table("served", LADDER.render), "gates": Table("gates", gates_table)}
    doc = tmp_path / "doc.md"
    doc.write_text("# Title\n\nintro\n\n<!-- bench:served -->\nstale\n<!-- /bench:served -->\n\n"
                   "text\n<!-- bench:gates -->\n<!-- /bench:gates -->\nend\n")
    before = doc.read_text()
    [res] = update([doc], records, check=True, tables=tables)
    assert res.changed and res.tables == ["served", "gates"] and doc.read_text() == before
    [res] = update([doc], records, tables=tables)
    text = doc.read_text()
    assert res.changed and "stale" not in text
    assert text.startswith("# Title\n\nintro\n\n<!-- bench:served -->\n| output tok/s |")
    assert "Machine: Test machine.\n<!-- /bench:served -->\n\ntext\n" in text
    assert text.endswith("PASS | decode_tok_s_median 51.4 ≥ 30.0; 1 equality check holds |\n"
                         "<!-- /bench:gates -->\nend\n")
    [res] = update([doc], records, check=True, tables=tables)
    assert not res.changed  # regenerating is idempotent


def test_unknown_table_or_missing_run_is_an_error(records):
    with pytest.raises(KeyError, match="no-such"):
        refresh("<!-- bench:no-such -->\n<!-- /bench:no-such -->\n", records)
    with pytest.raises(FileNotFoundError, match="2026-12-03-session5"):
        TABLES["served"].render(records)  # the repo's spec names a run the fake dir lacks


def test_cli_check_fails_on_a_stale_file(records, tmp_path, capsys):
    doc = tmp_path / "doc.md"
    doc.write_text("<!-- bench:runs -->\nold\n<!-- /bench:runs -->\n")
    args = ["bench", "tables", str(doc), "--records-dir", str(records)]
    assert main([*args, "--check"]) == 1
    assert "out of date" in capsys.readouterr().out
    assert main(args) == 0
    assert main([*args, "--check"]) == 0
    assert "met-auto" in doc.read_text()


def test_committed_docs_match_the_records():
    """README.md and docs/benchmarks.md as committed are what `met bench tables` generates."""
    assert main(["bench", "tables", "--check", str(REPO / "README.md"),
                 str(REPO / "docs" / "benchmarks.md"),
                 "--records-dir", str(REPO / ".benchmarks")]) == 0
