"""GGUF files of the dense families llama.cpp converts (phi3, gemma2, olmo2, granite), written
here from the tiny HF checkpoints the way llama.cpp's converter writes them, must give met the
same greedy tokens and logprobs as the safetensors checkpoint they came from.

They also check what transformers' GGUF config reader leaves out and met puts back from the
metadata: Gemma-2's softcaps and attention scale, Phi-3's partial rotary, and the whole
config of olmo2 and granite (which transformers does not read), Granite's multipliers too.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf_writing import interleave_rope_rows, start_gguf
from safetensors.torch import save_file
from tiny_models import oracle_prompts

from met import LLM, SamplingParams
from met.kernels.gguf_blocks import Blocks
from met.loader.gguf import load_gguf

_Q = gguf.GGMLQuantizationType
MAX_NEW = 24
# GGUF-side names of each family's per-layer tensors (HF module path -> llama.cpp part).
_LAYER_NAMES = {
    "phi3": {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output",
             "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down"},
    "gemma2": {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
               "pre_feedforward_layernorm": "ffn_norm",
               "post_feedforward_layernorm": "post_ffw_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"},
    "olmo2": {"post_attention_layernorm": "post_attention_norm",
              "post_feedforward_layernorm": "post_ffw_norm",
              "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
              "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
              "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down"},
    "granite": {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                "mlp.down_proj": "ffn_down"},
}


@pytest.fixture(autouse=True)
def _no_config_cache(monkeypatch):
    monkeypatch.setenv("MET_CACHE_DIR", "off")  # no converted-config entry left behind


def write_gguf(arch: str, model_dir: Path, out_dir: Path, kind: str = "F32",
               extra_tensors: dict[str, np.ndarray] | None = None) -> tuple[str, Path]:
    """``model_dir`` (a tiny ``arch`` checkpoint) as llama.cpp writes it: Gemma norms as
    (w + 1), q/k rows interleaved for granite only (the others rope NEOX-style in ggml),
    Phi-3's fused projections kept, projections in ``kind``. Returns the file and an HF
    checkpoint directory with the weights and config the file stands for: the reference."""
    out_dir.mkdir()
    path = out_dir / f"tiny-{arch}-{kind}.gguf"
    cfg = json.loads((model_dir / "config.json").read_text())
    head_dim = cfg["head_dim"]
    factor = cfg["rope_parameters"].get("partial_rotary_factor", 1.0)
    writer, cfg, state = start_gguf(model_dir, path, arch, rope_dims=int(head_dim * factor))
    if arch == "gemma2":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_sliding_window(cfg["sliding_window"])
        writer.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    if arch == "granite":  # llama.cpp writes the multipliers as scales
        writer.add_embedding_scale(cfg["embedding_multiplier"])
        writer.add_attention_scale(cfg["attention_multiplier"])
        writer.add_residual_scale(cfg["residual_multiplier"])
        writer.add_logit_scale(cfg["logits_scaling"])
    heads = {"self_attn.q_proj": cfg["num_attention_heads"],
             "self_attn.k_proj": cfg["num_key_value_heads"]} if arch == "granite" else {}

    names = {"model.embed_tokens.weight": "token_embd.weight",
             "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
    for i in range(cfg["num_hidden_layers"]):
        for module, part in _LAYER_NAMES[arch].items():
            names[f"model.layers.{i}.{module}.weight"] = f"blk.{i}.{part}.weight"
    names = {k: v for k, v in names.items() if k in state}
    assert set(names) == set(state), set(state) ^ set(names)
    reference = {}
    for hf_name, w in state.items():
        w = w.float()
        module = hf_name.removeprefix("model.layers.").split(".", 1)[-1].removesuffix(
            ".weight")
        if kind != "F32" and hf_name.endswith("proj.weight"):
            data = gguf.quants.quantize(w.numpy(), _Q[kind])
            w = torch.from_numpy(gguf.quants.dequantize(data, _Q[kind]).reshape(w.shape))
            if module in heads:  # rows permuted after rounding: rounding is per row
                data = interleave_rope_rows(data, heads[module])
            writer.add_tensor(names[hf_name], data, raw_dtype=_Q[kind])
        elif module in heads:
            writer.add_tensor(names[hf_name], interleave_rope_rows(w.numpy(), heads[module]))
        elif arch == "gemma2" and hf_name.endswith("norm.weight"):
            writer.add_tensor(names[hf_name], (w + 1.0).numpy())
        else:
            writer.add_tensor(names[hf_name], w.numpy())
        reference[hf_name] = w.contiguous()
    for name, array in (extra_tensors or {}).items():
        writer.add_tensor(name, array.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    ref = out_dir / "reference"
    shutil.copytree(model_dir, ref)
    save_file(reference, str(ref / "model.safetensors"), metadata={"format": "pt"})
    if arch == "gemma2":
        # llama.cpp's Gemma-2 scale is 1/sqrt(head_dim) (1/sqrt(hidden/heads) for the 27B);
        # the tiny model's query_pre_attn_scalar differs on purpose, so the file stands for
        # the same weights with query_pre_attn_scalar = head_dim.
        ref_cfg = json.loads((ref / "config.json").read_text())
        ref_cfg["query_pre_attn_scalar"] = head_dim
        (ref / "config.json").write_text(json.dumps(ref_cfg, indent=2))
    return str(path), ref


def _run(model: str, prompts: list[list[int]], **kwargs) -> list[list[tuple[int, float]]]:
    llm = LLM(model, dtype="float32", max_model_len=256, enable_prefix_caching=False, **kwargs)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert llm.kv_stats().num_blocks_in_use == 0
    return [[(t, float(getattr(lp[t], "logprob", lp[t])))
             for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs, strict=True)]
            for o in outs]


def _assert_same(got, want, atol: float) -> None:
    for a, b in zip(got, want, strict=True):
        assert [t for t, _ in a] == [t for t, _ in b]
        assert max(abs(x - y) for (_, x), (_, y) in zip(a, b, strict=True)) <= atol


@pytest.mark.parametrize("arch", ["phi3", "gemma2", "olmo2", "granite"])
def test_float_gguf_matches_its_safetensors_checkpoint(arch, tiny_checkpoint, tmp_path):
    path, ref = write_gguf(arch, tiny_checkpoint(arch), tmp_path / "gguf")
    ckpt = load_gguf(path)
    config = ckpt.config
    assert config.model_type == arch
    if arch == "phi3":  # read from rope.dimension_count: transformers leaves 1.0
        assert config.rope_parameters["partial_rotary_factor"] == pytest.approx(0.75)
    elif arch in ("olmo2", "granite"):  # met's own config: transformers reads neither
        want = json.loads((tiny_checkpoint(arch) / "config.json").read_text())
        for field in ("hidden_size", "num_hidden_layers", "num_key_value_heads",
                      "intermediate_size", "vocab_size", "rms_norm_eps",
                      "tie_word_embeddings", "embedding_multiplier", "attention_multiplier",
                      "residual_multiplier", "logits_scaling"):
            if field in want:
                assert getattr(config, field) == pytest.approx(want[field]), field
    else:  # transformers would leave its defaults, 50 and 30, and 256
        assert config.attn_logit_softcapping == pytest.approx(5.0)
        assert config.final_logit_softcapping == pytest.approx(30.0)
        assert config.query_pre_attn_scalar == config.head_dim
        assert config.layer_types == ["sliding_attention", "full_attention"]
        assert config.sliding_window == 8
    prompts = oracle_prompts(arch)
    # (w + 1) - 1 in float32 moves Gemma's norm weights by an ulp: within 1e-5 in logprobs.
    _assert_same(_run(path, prompts), _run(str(ref), prompts), atol=1e-5)


def test_quantized_phi3_gguf_keeps_fused_blocks(tiny_checkpoint, tmp_path):
    """Q8_0 projections kept as blocks (``quantization="gguf"``), the fused qkv / gate_up
    blocks split by whole rows, run what the dequantized checkpoint runs under the same
    flag (its float weights quantized to Q8_0 again: the same blocks, Q8_0 being idempotent
    on its own values)."""
    path, ref = write_gguf("phi3", tiny_checkpoint("phi3"), tmp_path / "gguf", kind="Q8_0")
    kept = dict(load_gguf(path).weights(keep_blocks=True))
    for name in ("self_attn.qkv_proj", "mlp.gate_up_proj"):
        assert isinstance(kept[f"model.layers.0.{name}.weight"], Blocks), name
    prompts = oracle_prompts("phi3")
    _assert_same(_run(path, prompts, quantization="gguf"),
                 _run(str(ref), prompts, quantization="gguf"), atol=1e-5)


def test_phi3_longrope_gguf_is_refused(tiny_checkpoint, tmp_path):
    factors = np.ones(6)
    path, _ = write_gguf("phi3", tiny_checkpoint("phi3"), tmp_path / "gguf",
                         extra_tensors={"rope_factors_long.weight": factors,
                                        "rope_factors_short.weight": factors})
    with pytest.raises(ValueError, match="LongRoPE"):
        load_gguf(path)
