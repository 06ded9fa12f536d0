"""MoE GGUF files (llama.cpp's qwen3moe, and Mixtral written as llama with experts): the
expert stacks stay quantized under ``--quantization gguf`` and run through the quantized
matmul per expert group, giving the tokens the same file gives dequantized at load."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf_writing import interleave_rope_rows, start_gguf
from tiny_models import oracle_prompts

from met import LLM, SamplingParams
from met.kernels import gguf_blocks
from met.layers.moe import ExpertStack

_Q = gguf.GGMLQuantizationType
MAX_NEW = 16


def write_moe_gguf(model_dir: Path, path: Path, kind: str) -> int:
    """The tiny qwen3_moe or mixtral checkpoint as llama.cpp writes it (experts stacked
    [E, out, in] as ffn_{gate,up,down}_exps, stored as ``kind``; the other linear layers
    Q8_0, embedding and norms float32); returns the bytes of the expert tensors' data."""
    cfg = json.loads((model_dir / "config.json").read_text())
    mixtral = cfg["model_type"] == "mixtral"
    experts = cfg.get("num_local_experts") or cfg["num_experts"]
    expert_ff = cfg["intermediate_size"] if mixtral else cfg["moe_intermediate_size"]
    writer, cfg, state = start_gguf(model_dir, path, "llama" if mixtral else "qwen3moe",
                                    name="tiny-moe", feed_forward=cfg["intermediate_size"])
    writer.add_expert_feed_forward_length(expert_ff)
    writer.add_expert_count(experts)
    writer.add_expert_used_count(cfg["num_experts_per_tok"])
    writer.add_key_length(cfg["head_dim"])
    writer.add_value_length(cfg["head_dim"])
    writer.add_add_bos_token(mixtral)

    def f32(name: str, w: torch.Tensor) -> None:
        writer.add_tensor(name, np.ascontiguousarray(w.float().numpy()))

    def q8(name: str, w: np.ndarray) -> None:
        # Every linear layer in Q8_0: --quantization gguf would turn a float one into Q8_0
        # blocks, and the dequantized-at-load reference must hold the same values.
        data = gguf.quants.quantize(np.ascontiguousarray(w, dtype=np.float32), _Q.Q8_0)
        writer.add_tensor(name, data, raw_dtype=_Q.Q8_0)

    f32("token_embd.weight", state["model.embed_tokens.weight"])
    f32("output_norm.weight", state["model.norm.weight"])
    q8("output.weight", state["lm_head.weight"].numpy())
    moe = "block_sparse_moe" if mixtral else "mlp"
    projections = {"gate": "w1", "down": "w2", "up": "w3"} if mixtral else {
        p: f"{p}_proj" for p in ("gate", "up", "down")}
    expert_bytes = 0
    heads = {"q": cfg["num_attention_heads"], "k": cfg["num_key_value_heads"]}
    for i in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{i}"
        f32(f"blk.{i}.attn_norm.weight", state[f"{pre}.input_layernorm.weight"])
        f32(f"blk.{i}.ffn_norm.weight", state[f"{pre}.post_attention_layernorm.weight"])
        for p, part in (("q", "attn_q"), ("k", "attn_k"), ("v", "attn_v"), ("o", "attn_output")):
            w = state[f"{pre}.self_attn.{p}_proj.weight"].numpy()
            if mixtral and p in heads:
                w = interleave_rope_rows(w, heads[p])
            q8(f"blk.{i}.{part}.weight", w)
        if not mixtral:
            f32(f"blk.{i}.attn_q_norm.weight", state[f"{pre}.self_attn.q_norm.weight"])
            f32(f"blk.{i}.attn_k_norm.weight", state[f"{pre}.self_attn.k_norm.weight"])
        q8(f"blk.{i}.ffn_gate_inp.weight", state[f"{pre}.{moe}.gate.weight"].numpy())
        for proj, hf in projections.items():
            stacked = torch.stack([state[f"{pre}.{moe}.experts.{e}.{hf}.weight"]
                                   for e in range(experts)]).float().numpy()
            data = gguf.quants.quantize(stacked, _Q[kind])
            expert_bytes += data.nbytes
            writer.add_tensor(f"blk.{i}.ffn_{proj}_exps.weight", data, raw_dtype=_Q[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expert_bytes


def _greedy(llm: LLM, prompts) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [(list(o.outputs[0].token_ids),
             [float(getattr(lp[t], "logprob", lp[t]))
              for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs, strict=True)])
            for o in outs]


@pytest.mark.parametrize("arch,kind", [("qwen3_moe", "Q8_0"), ("qwen3_moe", "Q4_0"),
                                       ("mixtral", "Q8_0")])
def test_experts_stay_quantized_and_give_the_dequantized_tokens(arch, kind, tiny_checkpoint,
                                                                  tmp_path, monkeypatch):
    """Kept as blocks, the experts multiply the very values dequantize-at-load gives, in
    float32: the same greedy tokens, logprobs within 1e-4. The model holds the experts at
    their quantized size (no float copy)."""
    monkeypatch.setenv("MET_CACHE_DIR", "off")
    path = tmp_path / f"tiny-{arch}-{kind}.gguf"
    expert_bytes = write_moe_gguf(tiny_checkpoint(arch), path, kind)
    common = dict(dtype="float32", max_model_len=256, enable_prefix_caching=False)
    kept = LLM(str(path), quantization="gguf", **common)
    assert kept.engine.quantization == "gguf"
    dequantized = LLM(str(path), quantization=None, **common)

    model = kept.engine.runner.model
    stacks = [m for m in model.modules() if isinstance(m, ExpertStack)]
    assert len(stacks) == 2 and all(set(s.blocks) == {"gate", "up", "down"} for s in stacks)
    # The native quantized kernel where it is built (AVX2), gguf-py's dequantize elsewhere.
    assert all(s.native == gguf_blocks.available() for s in stacks)
    assert sum(b.nbytes for s in stacks for b in s.segments) == expert_bytes
    for s in stacks:
        for p in (s.gate_proj, s.up_proj, s.down_proj):
            assert p.untyped_storage().nbytes() <= p.element_size()  # no float copy
    float_experts = sum(p.numel() * 4 for s in stacks for p in s.parameters())
    saved = dequantized.engine.runner.model.weight_bytes() - model.weight_bytes()
    # Everything else is float in both (the dense layers' Q8_0 blocks of the gguf model
    # are smaller still), so at least the experts' float size minus their blocks is saved.
    assert saved >= float_experts - expert_bytes

    prompts = oracle_prompts(arch)
    got, ref = _greedy(kept, prompts), _greedy(dequantized, prompts)
    for (tokens, lps), (ref_tokens, ref_lps) in zip(got, ref, strict=True):
        assert tokens == ref_tokens
        assert max(abs(a - b) for a, b in zip(lps, ref_lps, strict=True)) <= 1e-4


@pytest.mark.parametrize("kind", ["Q4_0", "Q8_0", "Q4_K", "Q6_K"])
def test_blocks_grouped_equals_dequantized_grouped_mm(kind):
    """The per-expert-group quantized matmul (native kernel and gguf-py reference) against
    the grouped float matmul over the same dequantized values; 256-wide rows so K-quant
    experts (Q4_K_M files' Q4_K and Q6_K) are covered too."""
    from kquants import quantize

    from met.kernels.gguf_blocks import Blocks
    from met.kernels.grouped_mm import grouped_mm
    from met.layers.moe import _blocks_grouped

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(5, 24, 256, generator=gen)
    blocks = [Blocks(int(_Q[kind]), torch.from_numpy(quantize(w[e].numpy(), kind)), 256)
              for e in range(5)]
    values = torch.stack([b.dequantize() for b in blocks])
    offsets = torch.tensor([3, 3, 10, 11, 11], dtype=torch.int32)  # experts 1 and 4 empty
    x = torch.randn(11, 256, generator=gen)
    want = grouped_mm(x, values, offsets)
    for native in (False, gguf_blocks.available()):
        got = _blocks_grouped(x, blocks, offsets, native)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
