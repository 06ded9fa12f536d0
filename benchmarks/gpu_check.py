"""The one prepared device check for a session that has a GPU (issue: GPU backend).

    python benchmarks/gpu_check.py [--device cuda] [--layers 32] [--out .benchmarks]

Prints and writes one JSON record (.benchmarks/gpu-check-<utc>.json) with:
- the device, torch and triton versions, the measured device copy bandwidth;
- exactness: every tiny random architecture (tests/tiny_models.py), float32 greedy on the
  device through met (TF32 off) vs the test suite's transformers float32 oracle, tokens equal;
- decode at 1 stream of a Llama-3-8B-shaped random bfloat16 model built on the device from
  a config (--layers of them; no download): tok/s and % of the copy-bandwidth roofline
  (weight bytes per token / step time);
- 64 streams, prompt 512, output 256: met tok/s vs transformers' static-batch generate on
  the same device and weights; TTFT at 1 stream; the same with --kv-cache-dtype fp8.
`--device cpu --small` runs the same steps on a few-MB model (a dry run of the script).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def copy_bandwidth(device: str) -> float:
    """Bytes per second of a large device-to-device copy (read + write counted)."""
    n = (1 << 30) if device != "cpu" else (1 << 26)
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    sync(device)
    t = time.perf_counter()
    reps = 10
    for _ in range(reps):
        b.copy_(a)
    sync(device)
    return 2 * n * reps / (time.perf_counter() - t)


def sync(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize()


def exactness(device: str) -> dict:
    from tiny_models import ARCHS, build_tiny_checkpoint, hf_greedy_trace, oracle_prompts

    from met import LLM
    from met.sampling import SamplingParams

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    result = {}
    for arch in ARCHS:
        d = build_tiny_checkpoint(arch, Path(tempfile.mkdtemp()) / arch)
        prompts = oracle_prompts(arch)
        llm = LLM(str(d), device=device, dtype="float32", max_model_len=256)
        params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        # The test suite's oracle: transformers float32 greedy, checked full-context (CPU).
        same = sum(list(out.outputs[0].token_ids) == hf_greedy_trace(d, p, 32).tokens
                   for out, p in zip(outs, prompts, strict=True))
        result[arch] = {"prompts": len(prompts), "token_exact": same,
                        "attention": llm.engine.loaded.kernel_plan.attention.name}
        print(arch, result[arch], flush=True)
        del llm
    return result


def build_8b_shaped(device: str, layers: int, small: bool) -> Path:
    from tiny_models import build_tiny_checkpoint
    from transformers import LlamaConfig, LlamaForCausalLM

    d = Path(tempfile.mkdtemp()) / "llama8b"
    # The tokenizer files of the tiny llama (met needs one; its ids are < vocab_size).
    build_tiny_checkpoint("llama", d)
    cfg = (LlamaConfig(hidden_size=256, intermediate_size=768, num_hidden_layers=layers,
                       num_attention_heads=8, num_key_value_heads=2, vocab_size=4096)
           if small else
           LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
                       num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                       rope_theta=500000.0, max_position_embeddings=8192))
    cfg.torch_dtype = "bfloat16"
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    model.save_pretrained(d)
    del model
    return d


def met_run(path: Path, device: str, streams: int, isl: int, osl: int, **kw) -> dict:
    from met import LLM
    from met.sampling import SamplingParams

    llm = LLM(str(path), device=device, dtype="bfloat16", max_model_len=isl + osl + 16,
              max_num_seqs=max(streams, 1), **kw)
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(10, 4000, (isl,), generator=g).tolist()}
               for _ in range(streams)]
    params = SamplingParams(max_tokens=osl, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    t = time.perf_counter()
    first = llm.generate(prompts[:1], SamplingParams(max_tokens=1, ignore_eos=True))
    ttft = time.perf_counter() - t
    del first
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    res = {"streams": streams, "tok_s": tokens / wall, "ttft_1_stream_s": ttft,
           "weight_bytes": llm.engine.weight_bytes,
           "kernels": dict(llm.engine.kernel_labels)}
    del llm
    return res


def hf_run(path: Path, device: str, streams: int, isl: int, osl: int) -> dict:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(10, 4000, (streams, isl), generator=g).to(device)
    hf.generate(ids[:1], max_new_tokens=4, do_sample=False)
    sync(device)
    t = time.perf_counter()
    hf.generate(ids, max_new_tokens=osl, min_new_tokens=osl, do_sample=False)
    sync(device)
    wall = time.perf_counter() - t
    del hf
    return {"streams": streams, "tok_s": streams * osl / wall}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--small", action="store_true", help="a few-MB model (dry run)")
    ap.add_argument("--skip-exactness", action="store_true")
    ap.add_argument("--out", default=str(ROOT / ".benchmarks"))
    a = ap.parse_args()
    dev = a.device
    rec: dict = {"kind": "gpu-check", "utc": datetime.now(UTC).isoformat(),
                 "torch": torch.__version__,
                 "device": torch.cuda.get_device_name(0) if dev != "cpu" else "cpu"}
    try:
        import triton
        rec["triton"] = triton.__version__
    except ImportError:
        rec["triton"] = None
    rec["copy_bandwidth_gb_s"] = copy_bandwidth(dev) / 1e9
    print(json.dumps(rec), flush=True)
    if not a.skip_exactness:
        rec["exactness"] = exactness(dev)
    path = build_8b_shaped(dev, a.layers, a.small)
    isl, osl, wide = (512, 256, 64) if not a.small else (64, 32, 8)
    one = met_run(path, dev, 1, 128 if not a.small else 32, 128 if not a.small else 32)
    one["roofline_pct"] = 100 * one["weight_bytes"] * one["tok_s"] / (
        rec["copy_bandwidth_gb_s"] * 1e9)
    rec["decode_1_stream"] = one
    print("1 stream", one, flush=True)
    rec["met_64"] = met_run(path, dev, wide, isl, osl)
    print("met", rec["met_64"], flush=True)
    rec["met_64_fp8_kv"] = met_run(path, dev, wide, isl, osl, kv_cache_dtype="fp8")
    print("met fp8 KV", rec["met_64_fp8_kv"], flush=True)
    rec["transformers_64"] = hf_run(path, dev, wide, isl, osl)
    rec["ratio_vs_transformers"] = rec["met_64"]["tok_s"] / rec["transformers_64"]["tok_s"]
    print("transformers", rec["transformers_64"], "ratio", rec["ratio_vs_transformers"])
    out = Path(a.out)
    out.mkdir(exist_ok=True)
    name = f"gpu-check-{rec['utc'][:19].replace(':', '')}{'-small' if a.small else ''}.json"
    (out / name).write_text(json.dumps(rec, indent=1))
    print("record:", out / name)


if __name__ == "__main__":
    main()
