"""GGUF blocks kept quantized (met/kernels/gguf_blocks.py): the decoder gives gguf-py's values
bit for bit, the product is the float32 product of those values, a row's result does not
depend on its batch, and whole models on such weights greedy-decode as transformers does on
the dequantized float32 weights."""

from __future__ import annotations

import gguf
import kquants
import numpy as np
import pytest
import torch

from met.kernels import gguf_blocks
from met.kernels.gguf_blocks import Blocks

KINDS = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]


@pytest.fixture
def gguf_kernel():
    # Every CPU met targets has AVX2 and the install builds the kernel: missing, it is a defect.
    assert gguf_blocks.available(), ("the gguf_blocks kernel did not load (it needs AVX2 and "
                                     "a build: met kernels build)")


needs_kernel = pytest.mark.usefixtures("gguf_kernel")


def _blocks(kind: str, rows: int, cols: int, seed: int = 0) -> tuple[Blocks, torch.Tensor]:
    """Blocks of a random matrix and gguf-py's dequantized float32 values of them."""
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * 0.05
    data = kquants.quantize(w, kind)
    qtype = gguf.GGMLQuantizationType[kind]
    ref = gguf.quants.dequantize(data, qtype).astype(np.float32).reshape(rows, cols)
    return Blocks(int(qtype), torch.from_numpy(np.ascontiguousarray(data)), cols), \
        torch.from_numpy(ref)


@needs_kernel
@pytest.mark.parametrize("kind", KINDS)
def test_decoder_gives_gguf_py_values_bit_for_bit(kind):
    blocks, ref = _blocks(kind, 12, 512)
    got = blocks.dequantize()
    assert torch.equal(got.view(torch.int32), ref.view(torch.int32))


@needs_kernel
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_product_is_the_float32_product_of_the_values(kind, dtype):
    """13 channels (a partial tile of four) written at a column offset of a wider output."""
    blocks, ref = _blocks(kind, 13, 256, seed=1)
    x = torch.randn(6, 256).to(dtype)
    out = torch.full((6, 20), 7.0, dtype=dtype)
    gguf_blocks._op("linear")(x, blocks.data, blocks.kind, 256, out, 5)
    want = x.double() @ ref.double().T
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out[:, 5:18].double(), want, rtol=tol, atol=tol)
    assert (out[:, :5] == 7).all() and (out[:, 18:] == 7).all(), "wrote outside its columns"


@needs_kernel
@pytest.mark.parametrize("kind", ["Q8_0", "Q4_K", "Q6_K"])
def test_a_rows_result_does_not_depend_on_its_batch(kind):
    blocks, _ = _blocks(kind, 40, 512, seed=2)
    x = torch.randn(9, 512)
    alone = gguf_blocks.linear(x[4:5].contiguous(), [blocks], torch.float32)
    batched = gguf_blocks.linear(x, [blocks], torch.float32)
    assert torch.equal(alone[0], batched[4])


@needs_kernel
def test_segments_of_several_formats_stack_like_one_matrix():
    """A fused q|k|v whose parts are in different formats (Gemma's Q5_0 q, k and Q8_0 v)."""
    q, rq = _blocks("Q5_0", 8, 256, 3)
    k, rk = _blocks("Q5_0", 4, 256, 4)
    v, rv = _blocks("Q8_0", 4, 256, 5)
    segments = gguf_blocks.concat([[q], [k], [v]])
    assert [s.kind_name for s in segments] == ["Q5_0", "Q8_0"]
    x = torch.randn(3, 256)
    got = gguf_blocks.linear(x, segments, torch.float32)
    want = x.double() @ torch.cat([rq, rk, rv]).double().T
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    reference = gguf_blocks.linear(x, segments, torch.float32, native=False)
    torch.testing.assert_close(got, reference, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------
# whole models: met on the blocks vs transformers on their dequantized float32 values

def _tiny(arch: str, out_dir, vocab: int = 512):
    """A random 2-layer model wide enough for K-quant rows (256 values per block)."""
    import transformers

    common = dict(vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                  max_position_embeddings=256, tie_word_embeddings=True, bos_token_id=1,
                  eos_token_id=2, pad_token_id=0)
    if arch == "gemma3":
        config = transformers.Gemma3TextConfig(**common, sliding_window=16,
                                               query_pre_attn_scalar=64)
        model = transformers.Gemma3ForCausalLM(config)
    elif arch == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    torch.manual_seed(0)
    for p in model.parameters():  # weights large enough that logits are far from ties
        torch.nn.init.normal_(p, std=0.08)
    model.save_pretrained(out_dir)
    return model.eval()


@needs_kernel
@pytest.mark.parametrize("arch,kind", [("llama", "Q4_K"), ("llama", "Q8_0"),
                                       ("qwen3", "Q6_K"), ("qwen3", "Q5_K"),
                                       ("gemma3", "Q5_0"), ("gemma3", "Q4_K")])
def test_tiny_models_on_blocks_decode_as_transformers(tmp_path, monkeypatch, arch, kind):
    from met import LLM, SamplingParams
    from met.loader import model_loader

    hf = _tiny(arch, tmp_path)
    kept: dict[str, Blocks] = {}
    state = hf.state_dict()
    for name, w in state.items():  # every projection and the (tied) embedding table
        if w.dim() == 2 and (name.endswith("proj.weight") or "embed_tokens" in name):
            data = kquants.quantize(w.numpy(), kind)
            qtype = gguf.GGMLQuantizationType[kind]
            kept[name] = Blocks(int(qtype), torch.from_numpy(np.ascontiguousarray(data)),
                                w.shape[1])
            deq = gguf.quants.dequantize(data, qtype).reshape(w.shape).astype(np.float32)
            w.copy_(torch.from_numpy(deq))  # transformers runs on these values
    original = model_loader.iter_safetensors

    def with_blocks(path):
        for name, tensor in original(path):
            yield name, kept.get(name, tensor)

    monkeypatch.setattr(model_loader, "iter_safetensors", with_blocks)
    llm = LLM(str(tmp_path), dtype="float32", quantization="gguf", max_model_len=128)
    assert llm.engine.quantization == "gguf"
    prompts = [[1, 17, 42, 99, 7], [1, *range(30, 60)]]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(prompts, outs, strict=True):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            want = hf.generate(ids, max_new_tokens=16, do_sample=False, min_new_tokens=16,
                               pad_token_id=0)[0, len(prompt):].tolist()
        assert out.outputs[0].token_ids == want
