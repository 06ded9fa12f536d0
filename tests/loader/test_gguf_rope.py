"""GGUF rope metadata: llama.cpp's ``{arch}.rope.scaling.*`` keys and a Llama-3
``rope_freqs`` tensor become met's rope parameters, so a scaled-rope model read from GGUF
reproduces transformers on the original checkpoint."""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf_writing import interleave_rope_rows, start_gguf
from tiny_models import MAX_NEW_TOKENS, oracle_prompts

from met import LLM, SamplingParams
from met.loader.gguf import gguf_rope_scaling, load_gguf
from met.loader.gguf_file import read_gguf


def _llama3_rope_freqs(rope: dict, head_dim: int) -> np.ndarray:
    """The per-frequency divisors llama.cpp's converter writes as rope_freqs for llama3."""
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32)
                                          / head_dim))
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def write_gguf(model_dir: Path, path: Path, rope_metadata) -> str:
    """The tiny float32 llama at ``model_dir`` as llama.cpp would write it; ``rope_metadata``
    (writer, config) adds the rope keys or tensors."""
    writer, cfg, state = start_gguf(model_dir, path, "llama")
    rope_metadata(writer, cfg)
    parts = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
             "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    heads = {"q_proj": cfg["num_attention_heads"], "k_proj": cfg["num_key_value_heads"]}
    top = {"model.embed_tokens.weight": "token_embd.weight",
           "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
    for name, w in state.items():
        data = w.float().numpy()
        if name in top:
            writer.add_tensor(top[name], data)
            continue
        _, _, layer, *_, module, _ = name.split(".")
        if module in heads:
            data = interleave_rope_rows(data, heads[module])
        writer.add_tensor(f"blk.{layer}.{parts[module]}.weight", np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def _llama3_metadata(writer, cfg):
    writer.add_tensor("rope_freqs.weight", _llama3_rope_freqs(cfg["rope_parameters"],
                                                              cfg["head_dim"]))


def _yarn_metadata(writer, cfg):
    rope = cfg["rope_parameters"]
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])


@pytest.mark.parametrize(("arch", "metadata"), [("llama3_rope", _llama3_metadata),
                                                ("llama_yarn", _yarn_metadata)])
def test_scaled_rope_gguf_matches_transformers(arch, metadata, tiny_checkpoint, tmp_path):
    from test_oracle_models import assert_matches_hf

    model_dir = tiny_checkpoint(arch)
    path = write_gguf(model_dir, tmp_path / f"{arch}.gguf", metadata)
    params = load_gguf(path).config.rope_parameters
    if arch == "llama_yarn":
        want = json.loads((model_dir / "config.json").read_text())["rope_parameters"]
        assert {k: params[k] for k in want} == want
    else:
        assert len(params["freq_factors"]) == 8 and max(params["freq_factors"]) == 8.0
    llm = LLM(path, dtype="float32", block_size=16, max_model_len=256)
    prompts = oracle_prompts(arch)
    params = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True,
                            logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for out, prompt in zip(outs, prompts, strict=True):
        assert_matches_hf(out, model_dir, prompt)  # positions past the original length


def test_unscaled_and_unsupported_scaling(tiny_checkpoint, tmp_path):
    model_dir = tiny_checkpoint("llama")
    plain = write_gguf(model_dir, tmp_path / "plain.gguf", lambda w, c: None)
    assert gguf_rope_scaling(read_gguf(plain)) == {}
    assert load_gguf(plain).config.rope_parameters.get("rope_type", "default") == "default"

    def longrope(writer, cfg):
        writer.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE)
        writer.add_rope_scaling_factor(4.0)

    bad = write_gguf(model_dir, tmp_path / "longrope.gguf", longrope)
    with pytest.raises(ValueError, match=r"llama\.rope\.scaling\.type: 'longrope' is not "
                       "supported"):
        gguf_rope_scaling(read_gguf(bad))
