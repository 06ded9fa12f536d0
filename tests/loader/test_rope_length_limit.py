"""--max-model-len past the trained length: allowed up to what the rope scaling extends
it to, refused with an error naming the flag and the limit otherwise (LLM and met serve)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from met import LLM, SamplingParams


def test_unscaled_rope_refuses_past_max_position_embeddings(tiny_checkpoint):
    with pytest.raises(ValueError, match=r"max_model_len \(--max-model-len\): 600 exceeds the "
                       r"model's limit of 512 tokens \(max_position_embeddings 512.*does not "
                       r"scale past the trained length"):
        LLM(str(tiny_checkpoint("llama")), dtype="float32", max_model_len=600)


def test_dynamic_rope_extends_by_its_factor(tiny_checkpoint):
    """llama_dynamic: max_position_embeddings 32, factor 8 -> 256 allowed, 257 refused."""
    ckpt = str(tiny_checkpoint("llama_dynamic"))
    with pytest.raises(ValueError, match=r"257 exceeds the model's limit of 256 tokens "
                       r"\(rope_type 'dynamic': max_position_embeddings 32 x factor 8"):
        LLM(ckpt, dtype="float32", max_model_len=257)
    llm = LLM(ckpt, dtype="float32", max_model_len=256, enable_prefix_caching=False)
    assert llm.engine.max_model_len == 256
    (out,) = llm.generate([{"prompt_token_ids": list(range(3, 103))}],
                          SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 100  # 200 tokens, past the trained 32


def test_yarn_extends_from_its_original_length(tiny_checkpoint, tmp_path):
    """yarn with original_max_position_embeddings 32 x factor 16 = 512 while the config says
    max_position_embeddings 128: 512 allowed; the default stays the config's 128."""
    ckpt = tmp_path / "yarn"
    shutil.copytree(tiny_checkpoint("llama_yarn"), ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config["max_position_embeddings"] = 128
    (ckpt / "config.json").write_text(json.dumps(config))
    assert LLM(str(ckpt), dtype="float32").engine.max_model_len == 128
    assert LLM(str(ckpt), dtype="float32", max_model_len=512).engine.max_model_len == 512
    with pytest.raises(ValueError, match=r"513 exceeds the model's limit of 512 tokens "
                       r"\(rope_type 'yarn': original_max_position_embeddings 32 x factor 16"):
        LLM(str(ckpt), dtype="float32", max_model_len=513)


def test_serve_refuses_clearly(tiny_checkpoint):
    run = subprocess.run(
        [sys.executable, "-m", "met", "serve", str(tiny_checkpoint("llama")), "--dtype",
         "float32", "--max-model-len", "600", "--port", "0"],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert run.returncode != 0
    assert ("cannot serve: model load failed: max_model_len (--max-model-len): 600 exceeds "
            "the model's limit of 512 tokens") in run.stderr
