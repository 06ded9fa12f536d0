"""Records, signatures, compare, floors and the progress bar (no server needed)."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest

from met.bench.floors import Floors, machine_class, model_slug
from met.bench.gates.perf import configure_sweep
from met.bench.progress import Progress
from met.bench.records import Check, Record, verdict, write_record
from met.bench.report import compare_rows, load_sweep, write_json
from met.bench.signing import load_or_create_key, sign_file, verify_file
from met.bench.stats import RungStats
from met.bench.sweep import SweepResult, SweepSettings
from met.cli import main


@pytest.fixture
def identity(tmp_path, monkeypatch):
    d = tmp_path / "identity"
    monkeypatch.setenv("MET_IDENTITY_DIR", str(d))
    return d


def _record(checks):
    return Record(gate="decode-floor", model="tiny", command=["met", "bench", "run", "x"],
                  serve={"settings": {"dtype": "float32"}}, metrics={"decode_tok_s": 31.5},
                  checks=checks, floors_file="floors.toml")


def test_record_has_every_field_and_names_floors_in_the_reason(tmp_path):
    checks = [Check.of("decode_tok_s_median", 31.5, ">=", 40.0),
              Check.of("errors", 0, "==", 0)]
    path, data = write_record(_record(checks), tmp_path)
    assert re.fullmatch(r"\d{4}-\d\d-\d\d-[0-9a-f]{10}\.json", path.name), path.name
    assert path.parent == tmp_path / "decode-floor"
    on_disk = json.loads(path.read_text())
    assert on_disk == data
    for key in ("gate", "model", "created_at", "git", "command", "serve", "hardware",
                "floors_file", "metrics", "checks", "verdict", "reason"):
        assert key in on_disk, key
    assert len(on_disk["git"]["sha"]) == 40 and isinstance(on_disk["git"]["dirty_paths"], list)
    hw = on_disk["hardware"]
    assert hw["cpu_cores"] >= 1 and hw["memory_bytes"] > 0 and hw["torch"]
    assert "cpu_model" in hw and "gpus" in hw
    assert on_disk["verdict"] == "FAIL"
    assert "decode_tok_s_median = 31.5 (floor >= 40)" in on_disk["reason"]
    assert "errors" not in on_disk["reason"]  # only the failing check is the reason
    # A second run the same day at the same commit does not overwrite the first.
    path2, _ = write_record(_record(checks), tmp_path)
    assert path2 != path and path.exists()


def test_verdict_passes_only_when_every_check_holds():
    assert verdict([Check.of("a", 3, ">=", 2), Check.of("b", 1.0, "<=", 2)])[0] == "PASS"
    assert verdict([Check.of("a", 3, ">=", 2), Check.of("b", None, "<=", 2)])[0] == "FAIL"
    assert verdict([]) == ("FAIL", "no checks ran")


def test_signature_round_trip_and_tampering(tmp_path, identity, capsys):
    path, _ = write_record(_record([Check.of("errors", 0, "==", 0)]), tmp_path)
    sig = sign_file(path)
    assert sig.name == path.name + ".sig"
    assert (identity / "ed25519.pem").stat().st_mode & 0o777 == 0o600
    assert verify_file(path).ok
    assert main(["bench", "verify", str(path)]) == 0
    assert "OK" in capsys.readouterr().out

    text = path.read_text()
    path.write_text(text.replace('"verdict": "PASS"', '"verdict": "PASS" '))
    result = verify_file(path)
    assert not result.ok and "changed after it was signed" in result.reason
    assert main(["bench", "verify", str(path)]) == 1
    assert "FAILED" in capsys.readouterr().out


def test_a_signature_by_another_key_is_rejected(tmp_path, identity, monkeypatch):
    path, _ = write_record(_record([Check.of("errors", 0, "==", 0)]), tmp_path)
    sign_file(path, load_or_create_key(tmp_path / "someone-else"))
    unchecked = verify_file(path)  # no local identity yet: only the bytes can be checked
    assert unchecked.ok and "no local identity" in unchecked.reason
    load_or_create_key()  # now this machine has its own, different key
    result = verify_file(path)
    assert not result.ok and "another key" in result.reason
    other = verify_file(path, tmp_path / "someone-else" / "ed25519.pub.pem")
    assert other.ok


def test_unsigned_record_fails_verification(tmp_path, identity):
    path, _ = write_record(_record([Check.of("errors", 0, "==", 0)]), tmp_path)
    result = verify_file(path)
    assert not result.ok and "no signature" in result.reason


def _rung(c, tok_s, ttft, tpot):
    return RungStats(concurrency=c, requests=c, errors=0, duration_s=1.0, output_tokens=10,
                     output_tok_s=tok_s, request_per_s=1.0, ttft_p50_ms=ttft, ttft_p90_ms=ttft,
                     ttft_p99_ms=ttft, tpot_p50_ms=tpot, tpot_p90_ms=tpot, e2e_p50_ms=100.0,
                     min_output_tokens=10, mean_prompt_tokens=100.0, usage_reported=True)


def _sweep_file(tmp_path: Path, label: str, rungs) -> Path:
    result = SweepResult(label=label, url="http://x", model="m", endpoint="completions",
                         settings=SweepSettings(concurrency=tuple(r.concurrency for r in rungs)),
                         rungs=list(rungs))
    path = tmp_path / f"{label}.json"
    write_json(path, result.to_dict())
    return path


def test_compare_gives_rung_by_rung_ratios(tmp_path, capsys):
    a = _sweep_file(tmp_path, "met", [_rung(1, 30.0, 50.0, 30.0), _rung(4, 100.0, 80.0, 40.0)])
    b = _sweep_file(tmp_path, "peer", [_rung(1, 60.0, 25.0, 15.0), _rung(4, 50.0, 160.0, 80.0),
                                       _rung(16, 90.0, 300.0, 90.0)])
    rows = compare_rows([load_sweep(a), load_sweep(b)])
    assert [(r.concurrency, r.tok_s_ratio, r.ttft_ratio, r.tpot_ratio) for r in rows] == [
        (1, 2.0, 0.5, 0.5), (4, 0.5, 2.0, 2.0)]  # rung 16 has no baseline
    png = tmp_path / "cmp.png"
    assert main(["bench", "compare", str(a), str(b), "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^\s*1\s+peer\s+30\.0\s+60\.0\s+2\.00x\s+0\.50x\s+0\.50x$", out, re.M), out
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_compare_rejects_a_file_that_is_not_a_sweep(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"kind": "something-else"}')
    good = _sweep_file(tmp_path, "met", [_rung(1, 30.0, 50.0, 30.0)])
    assert main(["bench", "compare", str(good), str(bad)]) == 2
    assert "bad.json: not a `met bench sweep --out` file" in capsys.readouterr().err


def test_floors_are_validated_before_anything_runs(tmp_path):
    f = tmp_path / "f.toml"
    f.write_text('[serve]\ndtype = "float32"\n[concurrency-sweep]\nconcurrency = [1, 4]\n'
                 'min_output_tok_s = { "1" = 5.0 }\n[concurrency-sweep.serve]\n'
                 'max-num-seqs = 8\n')
    floors = Floors.load(f)
    assert floors.serve("concurrency-sweep") == {"dtype": "float32", "max-num-seqs": 8}
    with pytest.raises(ValueError, match=r"min_output_tok_s has no floor for concurrency \[4\]"):
        configure_sweep(floors.section("concurrency-sweep"), f)
    f.write_text("[serve\n")
    with pytest.raises(ValueError, match="not valid TOML"):
        Floors.load(f)


def test_floors_file_names():
    assert model_slug(None) == "smollm2-135m"
    assert model_slug("/x/SmolLM2-135M-Instruct.Q4_1.gguf") == "smollm2-135m-instruct"
    assert re.fullmatch(r"cpu-\d+core", machine_class("cpu"))


def test_checked_in_floors_parse_for_every_gate():
    from met.bench.gates import GATES

    files = sorted(Path(__file__).resolve().parents[2].glob("benchmarks/floors/*.toml"))
    assert files
    for f in files:
        floors = Floors.load(f)
        for gate in GATES.values():
            gate.configure(floors.section(gate.name), f)  # raises naming a bad key


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_without_a_tty_writes_plain_lines():
    out = io.StringIO()
    with Progress(8, "rung", out) as bar:
        for i in range(8):
            bar.update(ok=i != 3)
    text = out.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert [ln.split(":")[1].split()[0] for ln in lines] == ["25%", "50%", "75%", "done"]
    assert "8/8, 1 failed" in lines[-1]


def test_progress_bar_on_a_tty_redraws_one_line():
    out = _Tty()
    with Progress(4, "rung", out) as bar:
        for _ in range(4):
            bar.update()
    text = out.getvalue()
    # Drawn at the start, after each item and at close; one newline, at the very end.
    assert text.count("\r") == 6 and text.endswith("\n") and text.count("\n") == 1
    assert "[" + "#" * 30 + "] 4/4" in text
