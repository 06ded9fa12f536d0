"""`met generate` as a user runs it."""

from __future__ import annotations

import subprocess
import sys

from met import LLM, SamplingParams


def test_generate_prints_the_completion(tiny_checkpoint):
    ckpt = str(tiny_checkpoint("llama"))
    prompt = "hello world"
    expected = LLM(ckpt, dtype="float32", max_model_len=64).generate(
        [prompt], SamplingParams(max_tokens=8, temperature=0.0))[0].outputs[0].text
    run = subprocess.run(
        [sys.executable, "-m", "met.cli", "generate", ckpt, "--prompt", prompt,
         "--max-tokens", "8", "--dtype", "float32", "--max-model-len", "64"],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.rstrip("\n") == expected
    assert "tokens in" in run.stderr


def test_generate_reports_a_missing_model_clearly(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "met.cli", "generate", str(tmp_path / "nope.gguf"),
         "--prompt", "x"],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert run.returncode == 2
    assert "does not exist" in run.stderr
