"""The lora-mix gate: one server, the same prompts at one concurrency with the base model and
then spread over several adapters; the adapters' tok/s must keep ``min_ratio`` of the base's.

The adapters are random PEFT adapters of the served model's shapes (what a fine-tune of the
same rank costs to serve; their outputs are not the point), written to a temporary directory
and loaded over ``POST /v1/load_lora_adapter``, which also times each load.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from met.bench.floors import get
from met.bench.gates.base import GateContext, GateOutcome, require
from met.bench.progress import Progress
from met.bench.prompts import measure_shape, prompt_set
from met.bench.records import Check
from met.bench.stats import RungStats, rung_stats
from met.bench.sweep import run_batch

_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoRAMixConfig:
    concurrency: int
    adapters: int
    rank: int
    isl: int
    osl: int
    reps: int  # requests per client per measurement
    rounds: int  # base/adapters measurements alternated this many times
    warmup: int
    min_ratio: float


def configure(section: dict[str, Any], path: Path | None) -> LoRAMixConfig:
    g = "lora-mix"
    cfg = LoRAMixConfig(
        concurrency=int(get(section, "concurrency", 32, path, g)),
        adapters=int(get(section, "adapters", 8, path, g)),
        rank=int(get(section, "rank", 16, path, g)), isl=int(get(section, "isl", 110, path, g)),
        osl=int(get(section, "osl", 128, path, g)), reps=int(get(section, "reps", 1, path, g)),
        rounds=int(get(section, "rounds", 2, path, g)),
        warmup=int(get(section, "warmup", 2, path, g)),
        min_ratio=float(require(section, "min_ratio", path, g)))
    if min(cfg.concurrency, cfg.adapters, cfg.rank, cfg.reps, cfg.rounds) < 1:
        raise ValueError(f"{path}: [{g}] concurrency, adapters, rank, reps and rounds must "
                         "be >= 1")
    return cfg


def _shapes(config: Any) -> dict[str, tuple[int, int]]:
    """target -> (in, out) features of a dense decoder's projections."""
    hidden = config.hidden_size
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    inter = config.intermediate_size
    return {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv_heads * head_dim),
            "v_proj": (hidden, kv_heads * head_dim), "o_proj": (heads * head_dim, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
            "down_proj": (inter, hidden)}


def model_config(model: str | None) -> Any:
    """The HF config of the model a gate serves (a GGUF file's from its metadata)."""
    from met.loader.resolve import resolve_model

    source = resolve_model(model)
    if source.path.suffix == ".gguf":
        from met.loader.gguf import load_gguf

        return load_gguf(source.path).config
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(source.path)


def write_random_adapter(config: Any, out_dir: Path, rank: int, seed: int) -> Path:
    """A PEFT adapter (adapter_config.json + adapter_model.safetensors) with random A and
    small random B on every q/k/v/o/gate/up/down projection of ``config``'s layers."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for target, (fan_in, fan_out) in _shapes(config).items():
            block = "self_attn" if target in _TARGETS[:4] else "mlp"
            key = f"base_model.model.model.layers.{layer}.{block}.{target}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) / fan_in
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.01
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    (out_dir / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
        "target_modules": list(_TARGETS), "bias": "none"}))
    return out_dir


async def _rung(ctx: GateContext, bodies: list[dict], c: int, label: str) -> RungStats:
    with Progress(len(bodies), label, ctx.progress) as bar:
        results, wall = await run_batch(ctx.client, ctx.target, bodies, c, 600.0, bar)
    return rung_stats(c, results, wall)


async def run(ctx: GateContext, cfg: LoRAMixConfig) -> GateOutcome:
    config = model_config(ctx.model)
    names = [f"bench-lora-{i}" for i in range(cfg.adapters)]
    loads_ms, sizes = {}, {}
    with tempfile.TemporaryDirectory(prefix="met-bench-lora-") as tmp:
        for i, name in enumerate(names):
            path = write_random_adapter(config, Path(tmp) / name, cfg.rank, seed=1000 + i)
            start = time.perf_counter()
            r = await ctx.client.post(f"{ctx.target.root}/v1/load_lora_adapter",
                                      json={"lora_name": name, "lora_path": str(path)},
                                      headers=ctx.target.headers(), timeout=120)
            if r.status_code != 200:
                raise RuntimeError(f"/v1/load_lora_adapter {name}: {r.status_code} {r.text}")
            loads_ms[name] = round((time.perf_counter() - start) * 1000, 1)
            sizes[name] = r.json().get("bytes")
    slot_bytes = await _slot_bytes(ctx)
    shape = await measure_shape(ctx.client, ctx.target, cfg.isl)
    n = cfg.concurrency * cfg.reps

    def bodies(seed: int, adapters: bool) -> list[dict]:
        prompts = prompt_set(shape, cfg.isl, n, seed=seed)
        out = [ctx.target.body(p, cfg.osl) for p in prompts]
        if adapters:  # the same prompts, request i under adapter i mod adapters
            for i, b in enumerate(out):
                b["model"] = names[i % len(names)]
        return out

    warm = bodies(997, True)[:max(cfg.warmup, len(names))]
    await run_batch(ctx.client, ctx.target, warm, cfg.concurrency, 600.0)
    base_rungs, lora_rungs = [], []
    for k in range(cfg.rounds):
        c = cfg.concurrency
        base_rungs.append(await _rung(ctx, bodies(31 + k, False), c, f"base      r{k}"))
        lora_rungs.append(await _rung(ctx, bodies(31 + k, True), c, f"adapters  r{k}"))
    base = statistics.mean(r.output_tok_s for r in base_rungs)
    tuned = statistics.mean(r.output_tok_s for r in lora_rungs)
    ratio = round(tuned / base, 3) if base else None
    metrics = {
        "config": asdict(cfg), "base_output_tok_s": round(base, 2),
        "lora_output_tok_s": round(tuned, 2), "ratio": ratio,
        "base_rungs": [r.to_dict() for r in base_rungs],
        "lora_rungs": [r.to_dict() for r in lora_rungs],
        "adapter_load_ms": loads_ms, "adapter_load_ms_median":
            round(statistics.median(loads_ms.values()), 1),
        "adapter_bytes": sizes, "slot_bytes": slot_bytes}
    rungs = base_rungs + lora_rungs
    checks = [Check.of("errors", sum(r.errors for r in rungs), "==", 0),
              Check.of("min_output_tokens", min(r.min_output_tokens or 0 for r in rungs), "==",
                       cfg.osl),
              Check.of("lora_over_base_tok_s", ratio, ">=", cfg.min_ratio)]
    return GateOutcome(metrics=metrics, checks=checks)


async def _slot_bytes(ctx: GateContext) -> float | None:
    r = await ctx.client.get(f"{ctx.target.root}/metrics", headers=ctx.target.headers())
    for line in r.text.splitlines():
        if line.startswith("met_lora_slot_bytes"):
            return float(line.rsplit(" ", 1)[1])
    return None
