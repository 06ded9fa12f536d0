"""`met serve` flags → server configuration (the server itself is not started here)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from met import cli


@pytest.fixture
def captured(monkeypatch):
    """Replace the server run by a recorder of what it would have been given."""
    seen = {}

    def fake_serve(engine_config, config, attach=None):
        seen["engine"], seen["server"], seen["attach"] = engine_config, config, attach
        return 0

    monkeypatch.setattr("met.api.server.serve", fake_serve)
    return seen


def test_serve_flags_reach_the_server_config(captured, tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.delenv("MET_API_KEY", raising=False)
    ckpt = str(tiny_checkpoint("llama"))
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[0]['content'] }}")
    assert cli.main(["serve", ckpt, "--port", "9001", "--api-key", "a", "--api-key", "b",
                     "--served-model-name", "m1", "--served-model-name", "m2",
                     "--chat-template", str(template),
                     "--request-timeout", "7.5", "--max-queued-requests", "3",
                     "--max-request-body", "1MiB", "--log-requests", "--max-num-seqs", "5"]) == 0
    server, engine = captured["server"], captured["engine"]
    assert server.port == 9001 and server.host == "127.0.0.1"
    assert server.api_keys == ("a", "b")
    assert server.served_model_names == ("m1", "m2")
    assert server.chat_template == "{{ messages[0]['content'] }}"
    assert server.request_timeout == 7.5 and server.max_queued_requests == 3
    assert server.max_body_bytes == 1 << 20 and server.log_requests
    assert engine.model == ckpt and engine.max_num_seqs == 5


def test_serve_defaults(captured, tiny_checkpoint, monkeypatch):
    monkeypatch.setenv("MET_API_KEY", "from-env")
    ckpt = str(tiny_checkpoint("llama"))
    assert cli.main(["serve", ckpt]) == 0
    server = captured["server"]
    assert server.port == 8888 and server.host == "127.0.0.1"
    assert server.api_keys == ("from-env",)
    assert server.served_model_names == (ckpt,)
    assert server.request_timeout == 300 and server.max_queued_requests is None
    assert server.max_body_bytes == 32 << 20


def test_dtype_and_quantization_flags(captured, tiny_checkpoint):
    ckpt = str(tiny_checkpoint("llama"))
    assert cli.main(["serve", ckpt]) == 0
    engine = captured["engine"]
    assert (engine.dtype, engine.quantization) == ("auto", "auto")  # decided at load time
    for flag, want in (("none", None), ("int8", "int8"), ("int4", "int4"), ("auto", "auto")):
        assert cli.main(["serve", ckpt, "--dtype", "float32", "--quantization", flag]) == 0
        assert (captured["engine"].dtype, captured["engine"].quantization) == ("float32", want)


def test_an_unknown_quantization_is_a_clear_cli_error(tiny_checkpoint):
    run = subprocess.run([sys.executable, "-m", "met.cli", "serve", str(tiny_checkpoint("llama")),
                          "--quantization", "int2"],
                         capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 2
    assert "--quantization: invalid choice: 'int2'" in run.stderr
    assert "'auto', 'none', 'int8', 'int4'" in run.stderr


def test_served_model_card_says_what_the_engine_runs_with(start_server, tiny_checkpoint):
    """--quantization int8 with dtype auto runs bfloat16 activations: the startup log and
    /v1/models say so."""
    import httpx
    from serve_harness import wait_until

    server = start_server([str(tiny_checkpoint("llama")), "--quantization", "int8",
                           "--max-model-len", "128", "--served-model-name", "tiny"])
    card = httpx.get(server.base_url + "/models", timeout=30).json()["data"][0]
    assert (card["dtype"], card["quantization"]) == ("bfloat16", "int8")
    assert wait_until(lambda: "dtype bfloat16, quantization int8" in server.log(), 10)


def test_serve_with_a_missing_model_fails_fast():
    run = subprocess.run([sys.executable, "-m", "met.cli", "serve", "/nowhere/model.gguf"],
                         capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 2
    assert "does not exist" in run.stderr


def test_a_taken_port_fails_before_the_model_loads(tiny_checkpoint):
    import socket
    import time

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        start = time.perf_counter()
        run = subprocess.run([sys.executable, "-m", "met.cli", "serve",
                              str(tiny_checkpoint("llama")), "--port", str(port)],
                             capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 1, run.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in run.stderr and "--port" in run.stderr
    assert "memory: weights" not in run.stderr  # no model was loaded first
    assert time.perf_counter() - start < 60
