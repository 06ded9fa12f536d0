"""Model arguments: directories, sharded checkpoints, HF-cache ids, clear errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from met import LLM, SamplingParams
from met.loader.resolve import resolve_model

PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPT = {"prompt_token_ids": list(range(20, 40))}


def _tokens(llm: LLM) -> list[int]:
    return llm.generate([PROMPT], PARAMS)[0].outputs[0].token_ids


def _fake_hf_cache(root, model_id: str, checkpoint) -> None:
    repo = root / ("models--" + model_id.replace("/", "--"))
    snap = repo / "snapshots" / "0123abcd"
    shutil.copytree(checkpoint, snap)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0123abcd")


def test_model_id_resolves_in_cache_dir_and_env(tiny_checkpoint, tmp_path, monkeypatch):
    ckpt = tiny_checkpoint("llama")
    reference = _tokens(LLM(str(ckpt), dtype="float32", max_model_len=64))
    _fake_hf_cache(tmp_path / "cache", "acme/tiny-llama", ckpt)
    assert _tokens(LLM("acme/tiny-llama", dtype="float32", max_model_len=64,
                       cache_dir=str(tmp_path / "cache"))) == reference
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    assert resolve_model("acme/tiny-llama").path.name == "0123abcd"


def test_missing_model_id_names_every_place_searched(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    with pytest.raises(FileNotFoundError) as err:
        resolve_model("acme/not-here", cache_dir=str(tmp_path / "c"))
    msg = str(err.value)
    assert "acme/not-here" in msg and str(tmp_path / "c") in msg
    assert str(tmp_path / "home" / "hub") in msg and "never downloads" in msg


def test_sharded_checkpoint_loads_like_a_single_file(tiny_checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM

    ckpt = tiny_checkpoint("qwen2")
    reference = _tokens(LLM(str(ckpt), dtype="float32", max_model_len=64))
    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="50KB")
    for f in ckpt.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy(f, tmp_path / "sharded" / f.name)
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    assert _tokens(LLM(str(tmp_path / "sharded"), dtype="float32", max_model_len=64)) == reference


def test_unsupported_architecture_lists_supported_ones(tiny_checkpoint, tmp_path):
    ckpt = tiny_checkpoint("llama")
    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["FalconForCausalLM"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="FalconForCausalLM.*LlamaForCausalLM.*Gemma3ForCausalLM"):
        LLM(str(bad), dtype="float32")


def test_bad_engine_settings_name_the_field(tiny_checkpoint):
    ckpt = str(tiny_checkpoint("llama"))
    with pytest.raises(ValueError, match="block_size"):
        LLM(ckpt, block_size=12)
    with pytest.raises(ValueError, match="dtype"):
        LLM(ckpt, dtype="float64")
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(ckpt, max_model_len=10**7)
