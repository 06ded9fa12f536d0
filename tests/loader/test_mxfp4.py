"""gpt-oss checkpoints as OpenAI ships them: expert weights in MXFP4 (``*_blocks`` FP4 codes
and ``*_scales`` power-of-two exponents, ``quantization_config.quant_method: mxfp4``). met
dequantizes them at load; greedy output equals transformers' on the same file (its MXFP4
path dequantized, float32), and other quantization methods are refused by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import greedy_trace, oracle_prompts

from met import LLM, SamplingParams
from met.loader.checkpoint_quant import dequantize_mxfp4

MAX_NEW = 24
_FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                     -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _to_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, out, in] floats as MXFP4: per 32 inputs the smallest power of two that fits the
    largest magnitude in 6, each value rounded to the nearest FP4 code."""
    e, o, i = w.shape
    groups = w.reshape(e, o, i // 32, 32)
    exp = torch.ceil(torch.log2(groups.abs().amax(-1).clamp_min(1e-30) / 6.0)).clamp(-127, 127)
    codes = ((groups / torch.pow(2.0, exp)[..., None])[..., None] - _FP4).abs().argmin(-1)
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), (exp + 127).to(torch.uint8)


def _mxfp4_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    out = {}
    for name, w in load_file(str(src / "model.safetensors")).items():
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            # the float checkpoint stores [E, in, out]; MXFP4 groups the inputs of each row
            out[f"{name}_blocks"], out[f"{name}_scales"] = _to_mxfp4(w.transpose(1, 2))
        else:
            out[name] = w
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                   "model.embed_tokens", "lm_head"]}
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_dequantize_matches_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 8, 4, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(110, 140, (3, 8, 4), dtype=torch.uint8, generator=gen)
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
    got = dequantize_mxfp4(blocks, scales).float().transpose(1, 2)
    assert torch.equal(got, want)


def test_mxfp4_gpt_oss_matches_transformers(tiny_checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM, Mxfp4Config

    path = _mxfp4_checkpoint(tiny_checkpoint("gpt_oss"), tmp_path / "mxfp4")
    hf = AutoModelForCausalLM.from_pretrained(
        str(path), quantization_config=Mxfp4Config(dequantize=True), dtype=torch.float32)
    float_experts = load_file(str(tiny_checkpoint("gpt_oss") / "model.safetensors"))
    moved = (hf.model.layers[0].mlp.experts.gate_up_proj
             - float_experts["model.layers.0.mlp.experts.gate_up_proj"]).abs().max()
    assert moved > 1e-3  # the file's experts are not the float ones: the test sees MXFP4
    prompts = oracle_prompts("gpt_oss")
    refs = [greedy_trace(hf, p, MAX_NEW) for p in prompts]
    assert min(min(r.margins) for r in refs) > 1e-2  # no near-tie decides the comparison

    llm = LLM(str(path), dtype="float32", max_model_len=256, quantization="none")
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for out, ref in zip(outs, refs, strict=True):
        got = out.outputs[0]
        assert list(got.token_ids) == ref.tokens
        lps = [float(getattr(lp[t], "logprob", lp[t]))
               for t, lp in zip(got.token_ids, got.logprobs, strict=True)]
        assert max(abs(a - b) for a, b in zip(lps, ref.logprobs, strict=True)) < 1e-4


def test_other_quantized_checkpoints_are_refused(tiny_checkpoint, tmp_path):
    path = tmp_path / "awq"
    shutil.copytree(tiny_checkpoint("llama"), path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quantization_config.quant_method: 'awq'"):
        LLM(str(path), dtype="float32", max_model_len=256)
