"""MoE GGUF files (llama.cpp's qwen3moe and qwen2moe, and Mixtral written as llama with
experts): the expert stacks stay quantized under ``--quantization gguf`` and run through
the quantized matmul per expert group, giving the tokens the same file gives dequantized at
load."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf_writing import interleave_rope_rows, start_gguf
from safetensors.torch import load_file, save_file
from tiny_models import oracle_prompts

from met import LLM, SamplingParams
from met.kernels import gguf_blocks
from met.layers.moe import ExpertStack
from met.loader.gguf import load_gguf

_Q = gguf.GGMLQuantizationType
MAX_NEW = 16


def write_moe_gguf(model_dir: Path, path: Path, kind: str,
                   reference: dict[str, torch.Tensor] | None = None) -> int:
    """The tiny qwen3_moe or mixtral checkpoint as llama.cpp writes it (experts stacked
    [E, out, in] as ffn_{gate,up,down}_exps, stored as ``kind``; the other linear layers
    Q8_0, embedding and norms float32); returns the bytes of the expert tensors' data.
    ``reference`` (for qwen2_moe) receives every tensor as the file's values dequantized,
    under its HF name: the checkpoint the file stands for."""
    cfg = json.loads((model_dir / "config.json").read_text())
    mixtral = cfg["model_type"] == "mixtral"
    qwen2 = cfg["model_type"] == "qwen2_moe"
    experts = cfg.get("num_local_experts") or cfg["num_experts"]
    expert_ff = cfg["intermediate_size"] if mixtral else cfg["moe_intermediate_size"]
    arch = "llama" if mixtral else "qwen2moe" if qwen2 else "qwen3moe"
    writer, cfg, state = start_gguf(model_dir, path, arch,
                                    name="tiny-moe", feed_forward=cfg["intermediate_size"])
    if qwen2:
        writer.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    ref = reference if reference is not None else {}
    writer.add_expert_feed_forward_length(expert_ff)
    writer.add_expert_count(experts)
    writer.add_expert_used_count(cfg["num_experts_per_tok"])
    writer.add_key_length(cfg["head_dim"])
    writer.add_value_length(cfg["head_dim"])
    writer.add_add_bos_token(mixtral)

    def f32(name: str, w: torch.Tensor, hf: str | None = None) -> None:
        writer.add_tensor(name, np.ascontiguousarray(w.float().numpy()))
        if hf is not None:
            ref[hf] = w.float().reshape(state[hf].shape)

    def q8(name: str, w: np.ndarray, hf: str | None = None) -> None:
        # Every linear layer in Q8_0: --quantization gguf would turn a float one into Q8_0
        # blocks, and the dequantized-at-load reference must hold the same values.
        data = gguf.quants.quantize(np.ascontiguousarray(w, dtype=np.float32), _Q.Q8_0)
        writer.add_tensor(name, data, raw_dtype=_Q.Q8_0)
        if hf is not None:
            ref[hf] = torch.from_numpy(gguf.quants.dequantize(data, _Q.Q8_0).reshape(w.shape))

    f32("token_embd.weight", state["model.embed_tokens.weight"], "model.embed_tokens.weight")
    f32("output_norm.weight", state["model.norm.weight"], "model.norm.weight")
    q8("output.weight", state["lm_head.weight"].numpy(), "lm_head.weight")
    moe = "block_sparse_moe" if mixtral else "mlp"
    projections = {"gate": "w1", "down": "w2", "up": "w3"} if mixtral else {
        p: f"{p}_proj" for p in ("gate", "up", "down")}
    expert_bytes = 0
    heads = {"q": cfg["num_attention_heads"], "k": cfg["num_key_value_heads"]}
    for i in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{i}"
        for norm, hf in (("attn_norm", "input_layernorm"),
                         ("ffn_norm", "post_attention_layernorm")):
            f32(f"blk.{i}.{norm}.weight", state[f"{pre}.{hf}.weight"], f"{pre}.{hf}.weight")
        for p, part in (("q", "attn_q"), ("k", "attn_k"), ("v", "attn_v"), ("o", "attn_output")):
            hf = f"{pre}.self_attn.{p}_proj.weight"
            w = state[hf].numpy()
            if mixtral and p in heads:
                w = interleave_rope_rows(w, heads[p])
            q8(f"blk.{i}.{part}.weight", w, None if mixtral else hf)
            if f"{pre}.self_attn.{p}_proj.bias" in state:
                f32(f"blk.{i}.{part}.bias", state[hf[:-6] + "bias"], hf[:-6] + "bias")
        if not mixtral and not qwen2:
            f32(f"blk.{i}.attn_q_norm.weight", state[f"{pre}.self_attn.q_norm.weight"])
            f32(f"blk.{i}.attn_k_norm.weight", state[f"{pre}.self_attn.k_norm.weight"])
        q8(f"blk.{i}.ffn_gate_inp.weight", state[f"{pre}.{moe}.gate.weight"].numpy(),
           f"{pre}.{moe}.gate.weight")
        for proj, hf in projections.items():
            stacked = torch.stack([state[f"{pre}.{moe}.experts.{e}.{hf}.weight"]
                                   for e in range(experts)]).float().numpy()
            data = gguf.quants.quantize(stacked, _Q[kind])
            expert_bytes += data.nbytes
            writer.add_tensor(f"blk.{i}.ffn_{proj}_exps.weight", data, raw_dtype=_Q[kind])
            values = gguf.quants.dequantize(data, _Q[kind]).reshape(stacked.shape)
            for e in range(experts):
                ref[f"{pre}.{moe}.experts.{e}.{hf}.weight"] = torch.from_numpy(values[e].copy())
        if qwen2:  # the shared expert, its gate one row stored 1-D as llama.cpp does
            for proj in ("gate", "up", "down"):
                hf = f"{pre}.mlp.shared_expert.{proj}_proj.weight"
                w = state[hf]
                if w.shape[1] % 32:  # rows Q8_0 cannot split (48 wide): float, as llama.cpp
                    f32(f"blk.{i}.ffn_{proj}_shexp.weight", w, hf)
                else:
                    q8(f"blk.{i}.ffn_{proj}_shexp.weight", w.numpy(), hf)
            hf = f"{pre}.mlp.shared_expert_gate.weight"
            f32(f"blk.{i}.ffn_gate_inp_shexp.weight", state[hf].reshape(-1), hf)
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


def test_qwen2_moe_gguf_runs_the_checkpoint_it_stands_for(tiny_checkpoint, tmp_path,
                                                          monkeypatch):
    """A qwen2moe file (shared expert and its 1-D gate, qkv biases, the experts' widths from
    expert_feed_forward_length / expert_shared_feed_forward_length, which transformers'
    GGUF config leaves out) gives the tokens of the safetensors checkpoint holding the
    file's dequantized values; kept as blocks too, where the 48-wide shared down projection
    (rows Q8_0 cannot split) stays float."""
    monkeypatch.setenv("MET_CACHE_DIR", "off")
    model_dir = tiny_checkpoint("qwen2_moe")
    path = tmp_path / "tiny-qwen2moe.gguf"
    reference: dict[str, torch.Tensor] = {}
    write_moe_gguf(model_dir, path, "Q8_0", reference)
    ref_dir = tmp_path / "reference"
    shutil.copytree(model_dir, ref_dir)
    state = load_file(str(model_dir / "model.safetensors"))
    assert set(reference) == set(state), set(reference) ^ set(state)
    save_file({k: v.contiguous() for k, v in reference.items()},
              str(ref_dir / "model.safetensors"), metadata={"format": "pt"})
    config = load_gguf(str(path)).config
    assert (config.moe_intermediate_size, config.shared_expert_intermediate_size) == (32, 48)
    common = dict(dtype="float32", max_model_len=256, enable_prefix_caching=False)
    prompts = oracle_prompts("qwen2_moe")
    for quantization in (None, "gguf"):
        # under gguf both quantize their float layers (the shared gate) to the same Q8_0
        want = _greedy(LLM(str(ref_dir), quantization=quantization, **common), prompts)
        got = _greedy(LLM(str(path), quantization=quantization, **common), prompts)
        for (tokens, lps), (ref_tokens, ref_lps) in zip(got, want, strict=True):
            assert tokens == ref_tokens, quantization
            assert max(abs(a - b) for a, b in zip(lps, ref_lps, strict=True)) <= 1e-4
