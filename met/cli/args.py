"""Flags shared by the commands that run an engine (`serve`, `generate`, `chat`)."""

from __future__ import annotations

import argparse
import json

from met.config import KV_CACHE_DTYPES, POOLING_TYPES, QUANTIZATION_CHOICES, SpeculativeConfig
from met.kernels.registry import attention_backend_names, linear_method_names, lora_backend_names
from met.loader.resolve import hf_cache_dirs


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="checkpoint dir, .gguf file or HF-cache model id "
                        "(default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--model", dest="model_flag", default=None, help="same as the positional MODEL")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: bfloat16 on CUDA and on CPUs with AMX-BF16 or AVX512-BF16, else "
                        "float32 (float32 is the exact reference)")
    p.add_argument("--quantization", default="auto",
                   choices=list(QUANTIZATION_CHOICES),
                   help="quantized linear layers: gguf (a GGUF's own Q4_K/Q6_K/Q8_0/... "
                        "blocks kept as they are, float32 sums: weights at the file's size); "
                        "int8 (per output channel) or int4 (groups "
                        "of 32; a Q4_0/Q4_1 GGUF keeps its own integers exactly) weight-only "
                        "with bfloat16 activations; w4a8 (those 4-bit blocks times int8 "
                        "activations in blocks of 32, the fastest at few streams) or w8a8 "
                        "(int8 weights per channel, int8 activations per row); auto: w4a8 "
                        "for a Q4_0/Q4_1 GGUF in bfloat16 on a CPU with AVX512-VNNI (without "
                        "it int4 for --max-num-seqs <= 4), else none")
    p.add_argument("--device", default="auto",
                   help="auto (CUDA when torch sees a GPU, else the CPU), cpu, cuda or cuda:N")
    p.add_argument("--linear-backend", default="auto", choices=["auto", *linear_method_names()],
                   help="force a linear method (`met kernels list` shows what runs here and "
                        "why not); it implies its quantization; auto: the first that runs")
    p.add_argument("--attention-backend", default="auto",
                   choices=["auto", *attention_backend_names()],
                   help="force an attention backend (torch: the PyTorch reference)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-memory", type=parse_bytes, default=None,
                   help="KV pool size, e.g. 512MiB, 2GiB or bytes")
    p.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                   help="auto: the model's dtype, except int8 where --dtype auto chose "
                        "float32 + w4a8 (CPUs without native bfloat16); model: the model's "
                        "dtype always; int8: each key/value row as int8 with a float32 scale, "
                        "~half the bytes per token of bfloat16 (more tokens in the pool, less "
                        "to read per decode step)")
    p.add_argument("--speculative-config", default=None, type=_parse_speculative,
                   help='speculative decoding as JSON with vLLM\'s keys, e.g. '
                        '\'{"method": "ngram", "num_speculative_tokens": 4}\'; methods: '
                        'ngram (prompt lookup: prompt_lookup_min/max), suffix (also over '
                        'recent finished requests: suffix_cache_requests); "gate": false '
                        'speculates even where it measured slower. Output is the same as '
                        'without it')
    p.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters over the base model (--lora-modules, or loaded "
                        "while serving with --allow-runtime-lora)")
    p.add_argument("--lora-modules", nargs="+", type=_parse_lora_module, default=None,
                   metavar="NAME=PATH",
                   help="LoRA adapters to serve, PEFT directories or llama.cpp GGUF LoRA "
                        "files, each under its name (a request's `model` or `adapter` field "
                        "picks it); implies --enable-lora")
    p.add_argument("--max-loras", type=int, default=4,
                   help="adapters resident at once (slots); more wait in the queue")
    p.add_argument("--max-lora-rank", type=int, default=16,
                   help="the largest adapter rank accepted (slots are sized for it)")
    p.add_argument("--max-cpu-loras", type=int, default=None,
                   help="adapters kept in memory (least recently used dropped, read from "
                        "disk again when asked for); default: all; at least --max-loras")
    p.add_argument("--lora-backend", default="auto", choices=["auto", *lora_backend_names()],
                   help="the LoRA delta's kernel: cpu-native (each row alone, "
                        "batch-invariant) or torch (the reference); auto: the first that runs")
    p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching",
                   action="store_false")
    p.add_argument("--state-snapshots", type=int, default=None,
                   help="hybrid state-space models: prefix-cache snapshots of the recurrent "
                        "state kept at block boundaries (LRU); default 4 x --max-num-seqs")
    p.add_argument("--pooling", default="last", choices=list(POOLING_TYPES),
                   help="embeddings (/v1/embeddings): pool the prompt's final-norm hidden "
                        "states by its last token (Qwen3-Embedding) or their mean; a request's "
                        "`pooling` field overrides it")
    p.add_argument("--no-normalize-embeddings", dest="normalize_embeddings",
                   action="store_false", help="return embeddings without L2 normalization")
    p.add_argument("--cache-dir", default=None,
                   help=f"HF cache to search (else {', '.join(map(str, hf_cache_dirs(None)))})")


def parse_bytes(text: str) -> int:
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9}
    low = text.strip().lower()
    for suffix, mult in units.items():
        if low.endswith(suffix):
            return int(float(low[: -len(suffix)]) * mult)
    try:
        return int(low)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 512MiB or 2GiB)") from None


def _parse_lora_module(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"lora_modules: expected NAME=PATH, got {text!r}")
    return name, path


def _parse_speculative(text: str) -> SpeculativeConfig | None:
    try:
        return SpeculativeConfig.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _parse_logit_bias(text: str) -> dict[int, float]:
    try:
        raw = json.loads(text)
        if not isinstance(raw, dict):
            raise ValueError
        return {int(k): float(v) for k, v in raw.items()}
    except (ValueError, TypeError):
        raise argparse.ArgumentTypeError(
            f"not a JSON object of token id -> bias: {text!r} (try '{{\"42\": 5.0}}')"
        ) from None


def _parse_token_ids(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(t) for t in text.replace(",", " ").split())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a list of token ids: {text!r} (try 2,13)") from None


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """The sampler's fields (see SamplingParams); defaults are the ones that turn each off."""
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 or -1 = off")
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--top-n-sigma", type=float, default=0.0, help="0 = off")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="1 = off")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="-2..2")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="-2..2")
    p.add_argument("--logit-bias", type=_parse_logit_bias, default=None,
                   help='JSON {token id: bias in -100..100}, e.g. \'{"42": 5}\'')
    p.add_argument("--stop-token-ids", type=_parse_token_ids, default=(),
                   help="token ids that end the generation, e.g. 2,13")
    p.add_argument("--seed", type=int, default=None)


def sampling_params(args: argparse.Namespace):
    """SamplingParams from the sampling flags (a bad value raises ValueError at once)."""
    from met import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, seed=args.seed, min_p=args.min_p, top_n_sigma=args.top_n_sigma,
        repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, logit_bias=args.logit_bias,
        stop_token_ids=args.stop_token_ids,
    )


def _engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        dtype=args.dtype, device=args.device,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory, enable_prefix_caching=args.enable_prefix_caching,
        cache_dir=args.cache_dir, quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype, linear_backend=args.linear_backend,
        attention_backend=args.attention_backend,
        speculative_config=args.speculative_config,
        enable_lora=args.enable_lora,
        lora_modules=dict(args.lora_modules) if args.lora_modules else None,
        max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras, lora_backend=args.lora_backend,
        pooling=args.pooling, normalize_embeddings=args.normalize_embeddings,
        state_snapshots=args.state_snapshots,
    )


def model_arg(args: argparse.Namespace) -> str | None:
    return args.model_flag or args.model


def build_llm(args: argparse.Namespace):
    from met import LLM

    return LLM(model_arg(args), **_engine_kwargs(args))


def engine_config(args: argparse.Namespace):
    from met.config import EngineConfig

    return EngineConfig(model=model_arg(args), **_engine_kwargs(args))
