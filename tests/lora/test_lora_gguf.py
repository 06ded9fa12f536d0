"""GGUF LoRA adapters (llama.cpp's convert_lora_to_gguf.py layout) served by met give what
transformers + peft give on the same PEFT adapter: over an HF base, over a quantized GGUF base,
and bad files are refused naming the problem.

The files are written here as the converter writes them: ``general.type = adapter``,
``adapter.type = lora``, ``adapter.lora.alpha``, ``blk.N.<part>.weight.lora_a`` (PEFT's A,
[r, in]) and ``.lora_b`` (B, [out, r]), and for llama-family models B's q/k rows permuted the
way the converter permutes the base's attn_q/attn_k, so a match proves met undoes it.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf_writing import interleave_rope_rows, start_gguf
from safetensors.torch import load_file, save_file
from test_lora_exact import LOGPROB_ATOL, MAX_NEW, greedy, make_adapter, peft_model
from tiny_models import greedy_trace, load_hf_model_with, oracle_prompts

from met import LLM, SamplingParams
from met.lora.adapter import AdapterError
from met.lora.gguf_adapter import load_gguf_lora

_Q = gguf.GGMLQuantizationType
# The GGUF architecture llama.cpp's converter writes for each tiny arch.
GGUF_ARCH = {"llama": "llama", "llama3_rope": "llama", "llama_tied": "llama",
             "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3"}
PERMUTED = {"llama"}  # GGUF architectures whose q/k rows the converter permutes
PARTS = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
         "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
_PEFT_KEY = re.compile(r"layers\.(\d+)\.\w+\.(\w+)\.lora_([AB])\.weight$")


def _add(writer: gguf.GGUFWriter, name: str, w: np.ndarray, kind: str) -> None:
    """``w`` (torch order) stored as ``kind``; a block type the rows do not fill falls back
    to F16, as llama.cpp's converter does."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    if kind == "F32":
        writer.add_tensor(name, w)
        return
    if kind != "F16":
        try:
            writer.add_tensor(name, gguf.quants.quantize(w, _Q[kind]), raw_dtype=_Q[kind])
            return
        except gguf.quants.QuantError:
            pass
    writer.add_tensor(name, w.astype(np.float16))


def _finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_gguf_lora(adapter_dir: Path, model_dir: Path, out: Path, arch: str = "llama",
                    kind: str = "F32", skip: tuple[str, ...] = (),
                    extra: dict[str, np.ndarray] | None = None,
                    permute: bool | None = None, alpha: float | None = None) -> str:
    """The PEFT adapter in ``adapter_dir`` as llama.cpp's converter writes it for the base in
    ``model_dir`` (``skip``: GGUF tensor names left out; ``extra``: tensors added;
    ``permute``: q/k rows permuted, by default as the converter does for ``arch``;
    ``alpha``: adapter.lora.alpha, by default the PEFT lora_alpha)."""
    if permute is None:
        permute = arch in PERMUTED
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    base = json.loads((model_dir / "config.json").read_text())
    heads = {"q_proj": base["num_attention_heads"], "k_proj": base["num_key_value_heads"]}
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA,
                       float(config["lora_alpha"] if alpha is None else alpha))
    tensors = load_file(str(adapter_dir / "adapter_model.safetensors"))
    for key, t in sorted(tensors.items()):
        layer, module, which = _PEFT_KEY.search(key).groups()
        w = t.float()
        if which == "B" and permute and module in heads:
            w = interleave_rope_rows(w, heads[module])
        name = f"blk.{layer}.{PARTS[module]}.weight.lora_{which.lower()}"
        if name not in skip:
            _add(writer, name, w.numpy(), kind)
    for name, w in (extra or {}).items():
        writer.add_tensor(name, w)
    _finish(writer)
    return str(out)


def round_adapter(adapter_dir: Path, kind: str) -> None:
    """Round the PEFT adapter's matrices to ``kind`` (F16 / BF16) in place, so that peft and
    met's GGUF file hold the same numbers (rounding twice changes nothing)."""
    file = adapter_dir / "adapter_model.safetensors"
    dtype = {"F16": torch.float16, "BF16": torch.bfloat16}[kind]
    save_file({k: t.to(dtype).float() for k, t in load_file(str(file)).items()}, str(file))


def _check_matches(llm, refs: dict, prompts: list[list[int]]) -> None:
    """Every (adapter, prompt): met's greedy tokens are the reference's, logprobs within
    LOGPROB_ATOL."""
    for name, ref in refs.items():
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(), lora=name)
        for prompt, out in zip(prompts, outs, strict=True):
            want = greedy_trace(ref, prompt, MAX_NEW)
            comp = out.outputs[0]
            assert list(comp.token_ids) == want.tokens, f"adapter {name}"
            for step, (tok, entry) in enumerate(zip(comp.token_ids, comp.logprobs,
                                                    strict=True)):
                got = float(getattr(entry[tok], "logprob", entry[tok]))
                assert abs(got - want.logprobs[step]) <= LOGPROB_ATOL, (
                    f"adapter {name}, step {step}: logprob {got} vs {want.logprobs[step]}")


@pytest.mark.parametrize(("arch", "kind"), [("llama", "F32"), ("mistral", "BF16"),
                                            ("qwen3", "F16")])
def test_gguf_adapter_matches_peft(arch, kind, tiny_checkpoint, tmp_path):
    """llama / mistral: q/k rows un-permuted; qwen3: left as they are (NEOX rope in ggml)."""
    model_dir = tiny_checkpoint(arch)
    peft_dir = make_adapter(model_dir, tmp_path / "peft", seed=4)
    if kind != "F32":
        round_adapter(peft_dir, kind)
    path = write_gguf_lora(peft_dir, model_dir, tmp_path / "a.gguf", GGUF_ARCH[arch], kind)
    llm = LLM(str(model_dir), dtype="float32", quantization="none", max_model_len=256,
              lora_modules={"a": path})
    adapter = llm.engine.lora.adapters["a"]
    assert adapter.rank == 8 and len(adapter.weights) == 2 * 7
    prompts = oracle_prompts(arch)[:2]
    _check_matches(llm, {"a": peft_model(model_dir, peft_dir)}, prompts)
    base = llm.generate([{"prompt_token_ids": prompts[0]}], greedy())[0].outputs[0].token_ids
    tuned = llm.generate([{"prompt_token_ids": prompts[0]}], greedy(), lora="a")[0]
    assert list(base) != list(tuned.outputs[0].token_ids), "the adapter changed nothing"


def test_unpermuted_llama_file_gives_other_tokens(tiny_checkpoint, tmp_path):
    """The same llama adapter written without llama.cpp's q/k permutation (so met's un-permute
    scrambles it) no longer matches peft: the permutation test above can fail."""
    model_dir = tiny_checkpoint("llama")
    peft_dir = make_adapter(model_dir, tmp_path / "peft", seed=4)
    wrong = write_gguf_lora(peft_dir, model_dir, tmp_path / "w.gguf", permute=False)
    llm = LLM(str(model_dir), dtype="float32", quantization="none", max_model_len=256,
              lora_modules={"w": wrong})
    prompt = oracle_prompts("llama")[0]
    got = llm.generate([{"prompt_token_ids": prompt}], greedy(), lora="w")[0].outputs[0]
    assert list(got.token_ids) != greedy_trace(peft_model(model_dir, peft_dir), prompt,
                                               MAX_NEW).tokens


def test_q8_0_adapter_tensors_read_as_gguf_py_dequantizes_them(tiny_checkpoint, tmp_path):
    """convert_lora_to_gguf.py --outtype q8_0: A (rows of 64) is Q8_0, B (rows of r = 8)
    falls back to F16; met serves exactly the stored values, scaled by alpha / r."""
    model_dir = tiny_checkpoint("qwen3")
    peft_dir = make_adapter(model_dir, tmp_path / "peft", seed=5, targets=["v_proj"])
    path = write_gguf_lora(peft_dir, model_dir, tmp_path / "q8.gguf", "qwen3", "Q8_0")
    stored = {t.name: t for t in gguf.GGUFReader(path).tensors}
    a_t, b_t = stored["blk.0.attn_v.weight.lora_a"], stored["blk.0.attn_v.weight.lora_b"]
    assert (a_t.tensor_type, b_t.tensor_type) == (_Q.Q8_0, _Q.F16)
    shapes = {(0, "v_proj"): (64, 32), (1, "v_proj"): (64, 32)}
    adapter = load_gguf_lora("q8", path, shapes, 8)
    a, b = adapter.weights[(0, "v_proj")]
    want_a = gguf.quants.dequantize(a_t.data, _Q.Q8_0).reshape(8, 64)
    assert torch.equal(a, torch.from_numpy(want_a))
    assert torch.equal(b, torch.from_numpy(b_t.data.astype(np.float32)) * (16.0 / 8))
    peft_a = load_file(str(peft_dir / "adapter_model.safetensors"))
    peft_a = next(t for k, t in peft_a.items() if "layers.0." in k and "lora_A" in k)
    assert 0 < (a - peft_a).abs().max() < 0.02 * peft_a.abs().max()  # Q8_0, not a copy
    # alpha 0 means unscaled in llama.cpp (scale = alpha ? alpha / r : 1).
    path = write_gguf_lora(peft_dir, model_dir, tmp_path / "a0.gguf", "qwen3", alpha=0.0)
    b0 = load_gguf_lora("a0", path, shapes, 8).weights[(0, "v_proj")][1]
    peft_b = next(t for k, t in load_file(str(peft_dir / "adapter_model.safetensors")).items()
                  if "layers.0." in k and "lora_B" in k)
    assert torch.equal(b0, peft_b.float())


# --- refusals ---------------------------------------------------------------------------


def test_bad_gguf_adapters_are_refused_naming_the_problem(tiny_checkpoint, tmp_path):
    model_dir = tiny_checkpoint("llama")
    llm = LLM(str(model_dir), dtype="float32", quantization="none", max_model_len=256,
              enable_lora=True, max_lora_rank=8)
    peft_dir = make_adapter(model_dir, tmp_path / "good", seed=1)
    good = write_gguf_lora(peft_dir, model_dir, tmp_path / "good.gguf")

    def refused(path, match):
        with pytest.raises(AdapterError, match=match):
            llm.load_lora_adapter("x", str(path))

    base, _ = write_gguf_base(model_dir, tmp_path / "base", "Q8_0")
    refused(base, r"not a LoRA adapter GGUF \(general.type is 'model'")
    refused(tmp_path / "none.gguf", "missing file .*none.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all")
    refused(tmp_path / "junk.gguf", "is not a GGUF file")
    big = make_adapter(model_dir, tmp_path / "big", seed=1, rank=16)
    refused(write_gguf_lora(big, model_dir, tmp_path / "big.gguf"),
            "rank 16 exceeds --max-lora-rank 8")
    wide_dir = tiny_checkpoint("llama", head_dim=32)
    wide = make_adapter(wide_dir, tmp_path / "wide", seed=1)
    refused(write_gguf_lora(wide, wide_dir, tmp_path / "wide.gguf"),
            r"layer 0 k_proj: shape mismatch, lora_a \(8, 64\) and lora_b \(64, 8\), the "
            r"base needs \(8, 64\) and \(32, 8\)")
    refused(write_gguf_lora(peft_dir, model_dir, tmp_path / "half.gguf",
                            skip=("blk.1.ffn_up.weight.lora_b",)),
            "layer 1 up_proj has lora_a without its pair")
    embd = {"token_embd.weight.lora_a": np.ones((8, 384), np.float32)}
    refused(write_gguf_lora(peft_dir, model_dir, tmp_path / "embd.gguf", extra=embd),
            "tensor token_embd.weight.lora_a is not a LoRA matrix of a decoder layer")
    refused(write_gguf_lora(peft_dir, model_dir, tmp_path / "qwen.gguf", arch="qwen2"),
            "the adapter is for architecture 'qwen2', the base model is 'llama'")
    # Nothing was registered, the engine keeps serving, and the good file still loads.
    assert list(llm.engine.lora.adapters) == []
    llm.load_lora_adapter("good", good)
    assert llm.generate(["hi"], greedy(), lora="good")[0].outputs[0].token_ids


# --- a quantized GGUF base ----------------------------------------------------------------


def write_gguf_base(model_dir: Path, out_dir: Path, kind: str) -> tuple[str, Path]:
    """The tiny llama as a llama.cpp GGUF (projections and head in ``kind``, q/k rows
    permuted, byte-level BPE vocabulary), and an HF checkpoint directory holding the
    weights that file dequantizes to: the reference model."""
    out_dir.mkdir()
    path = out_dir / f"tiny-{kind}.gguf"
    writer, cfg, state = start_gguf(model_dir, path, "llama")

    names = {"model.embed_tokens.weight": "token_embd.weight",
             "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
    for i in range(cfg["num_hidden_layers"]):
        names[f"model.layers.{i}.input_layernorm.weight"] = f"blk.{i}.attn_norm.weight"
        names[f"model.layers.{i}.post_attention_layernorm.weight"] = f"blk.{i}.ffn_norm.weight"
        for module, part in PARTS.items():
            group = "self_attn" if part.startswith("attn") else "mlp"
            names[f"model.layers.{i}.{group}.{module}.weight"] = f"blk.{i}.{part}.weight"
    assert set(names) == set(state), set(state) ^ set(names)
    heads = {"q_proj": cfg["num_attention_heads"], "k_proj": cfg["num_key_value_heads"]}
    dequantized = {}
    for hf_name, w in state.items():
        w = w.float()
        if hf_name.endswith(("proj.weight", "lm_head.weight")):
            data = gguf.quants.quantize(w.numpy(), _Q[kind])
            w = torch.from_numpy(gguf.quants.dequantize(data, _Q[kind]).reshape(w.shape))
            module = hf_name.split(".")[-2]
            if module in heads:  # rows permuted after rounding: rounding is per row
                data = interleave_rope_rows(torch.from_numpy(data), heads[module]).numpy()
            writer.add_tensor(names[hf_name], data, raw_dtype=_Q[kind])
        else:
            writer.add_tensor(names[hf_name], w.numpy())
        dequantized[hf_name] = w.contiguous()
    _finish(writer)

    ref = out_dir / "dequantized"
    shutil.copytree(model_dir, ref)
    save_file(dequantized, str(ref / "model.safetensors"), metadata={"format": "pt"})
    return str(path), ref


def _scores(llm, seq: list[int], start: int, lora: str | None) -> torch.Tensor:
    """met's logprob of each token of ``seq`` from position ``start`` on, given those
    before it."""
    out = llm.generate([{"prompt_token_ids": seq}], SamplingParams(max_tokens=1,
                                                                   prompt_logprobs=0),
                       lora=lora)[0]
    rows = out.prompt_logprobs
    return torch.tensor([float(getattr(rows[i][seq[i]], "logprob", rows[i][seq[i]]))
                         for i in range(start, len(seq))])


def _hf_scores(model, seq: list[int], start: int) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([seq]), use_cache=False).logits[0].double()
    rows = torch.log_softmax(logits, dim=-1)[start - 1:len(seq) - 1]
    return rows.gather(1, torch.tensor(seq[start:]).unsqueeze(1)).squeeze(1).float()


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0"])
def test_adapter_on_a_quantized_gguf_base_moves_it_as_peft_does(kind, tiny_checkpoint,
                                                                 tmp_path, monkeypatch):
    """met on the GGUF base keeps the blocks (``quantization="gguf"``), peft runs the HF
    model holding the values those blocks dequantize to. The quantization noise is the same
    on both sides, so what is left is float32 summation order (~1e-5 per logprob, as
    between met and transformers on float weights): the adapter's shift of every logprob
    (adapter minus base, on the adapter's own continuation) agrees within 2 · LOGPROB_ATOL,
    and greedy tokens agree exactly, for the base and for the adapter."""
    monkeypatch.setenv("MET_CACHE_DIR", "off")  # no converted-config entry left behind
    model_dir = tiny_checkpoint("llama")
    path, ref_dir = write_gguf_base(model_dir, tmp_path / "base", kind)
    peft_dir = make_adapter(model_dir, tmp_path / "peft", seed=6)
    adapter = write_gguf_lora(peft_dir, model_dir, tmp_path / "a.gguf")
    llm = LLM(path, dtype="float32", quantization="gguf", max_model_len=256,
              lora_modules={"a": adapter})
    assert llm.engine.loaded.quantization == "gguf"
    tuned, base = peft_model(ref_dir, peft_dir), load_hf_model_with(ref_dir)
    prompts = oracle_prompts("llama")[:2]
    _check_matches(llm, {"a": tuned, None: base}, prompts)

    original = load_hf_model_with(model_dir)  # the unquantized weights
    for prompt in prompts:
        seq = prompt + greedy_trace(tuned, prompt, MAX_NEW).tokens
        start = len(prompt)
        met_delta = _scores(llm, seq, start, "a") - _scores(llm, seq, start, None)
        peft_delta = _hf_scores(tuned, seq, start) - _hf_scores(base, seq, start)
        assert (met_delta - peft_delta).abs().max() <= 2 * LOGPROB_ATOL
        assert met_delta.abs().max() > 0.5, "the adapter barely moved the output"
        # The base really is the quantized one: its logprobs are off the float weights'.
        quant_gap = (_scores(llm, seq, start, None) - _hf_scores(original, seq, start)).abs()
        assert quant_gap.max() > 10 * LOGPROB_ATOL
