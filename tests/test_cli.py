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


def test_generate_sampler_flags_match_the_offline_llm(tiny_checkpoint):
    ckpt = str(tiny_checkpoint("llama"))
    prompt = "hello world"
    llm = LLM(ckpt, dtype="float32", max_model_len=64)
    sampler = dict(max_tokens=12, temperature=0.9, seed=5, min_p=0.02, top_n_sigma=3.0,
                   repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.3,
                   logit_bias={40: 4.0})

    def offline(**kw) -> tuple[list[int], str]:
        out = llm.generate([prompt], SamplingParams(**kw))[0].outputs[0]
        return out.token_ids, out.text

    plain_ids, _ = offline(max_tokens=12, temperature=0.9, seed=5)
    ids, _ = offline(**sampler)
    assert ids != plain_ids  # the flags have an effect
    stop_at = next(i for i in range(3, 12) if ids[i] not in ids[:i])
    stops = [ids[stop_at], llm.tokenizer.vocab_size - 1]
    ref_ids, ref_text = offline(**sampler, stop_token_ids=stops)
    assert ref_ids == ids[:stop_at + 1]
    run = subprocess.run(
        [sys.executable, "-m", "met.cli", "generate", ckpt, "--prompt", prompt,
         "--dtype", "float32", "--max-model-len", "64", "--max-tokens", "12",
         "--temperature", "0.9", "--seed", "5", "--min-p", "0.02", "--top-n-sigma", "3",
         "--repetition-penalty", "1.5", "--presence-penalty", "0.5",
         "--frequency-penalty", "0.3", "--logit-bias", '{"40": 4.0}',
         "--stop-token-ids", ",".join(map(str, stops))],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.rstrip("\n") == ref_text
    assert f"finish_reason=stop, stop_reason={ids[stop_at]}" in run.stderr


def test_generate_kv_cache_dtype_flag_reaches_the_engine(tiny_checkpoint):
    """--kv-cache-dtype int8: the same completion as the offline LLM with an int8 cache,
    and the startup log says which cache it built."""
    ckpt = str(tiny_checkpoint("llama"))
    prompt = "hello world"
    expected = LLM(ckpt, dtype="float32", max_model_len=64, kv_cache_dtype="int8").generate(
        [prompt], SamplingParams(max_tokens=8, temperature=0.0))[0].outputs[0].text
    run = subprocess.run(
        [sys.executable, "-m", "met.cli", "generate", ckpt, "--prompt", prompt,
         "--max-tokens", "8", "--dtype", "float32", "--max-model-len", "64",
         "--kv-cache-dtype", "int8"],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.rstrip("\n") == expected
    assert "int8 rows + scales" in run.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "met.cli", "generate", ckpt, "--prompt", prompt,
         "--kv-cache-dtype", "fp4"],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert bad.returncode == 2 and "--kv-cache-dtype" in bad.stderr
