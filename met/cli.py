"""Command line: `met generate`, `met serve`, `met bench`, `met kernels` (`python -m met` too)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

from met.bench.cli import add_bench_parser
from met.config import KV_CACHE_DTYPES, QUANTIZATION_CHOICES
from met.kernels.cli import add_parser as add_kernels_parser
from met.kernels.registry import attention_backend_names, linear_method_names
from met.loader.resolve import hf_cache_dirs


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="checkpoint dir, .gguf file or HF-cache model id "
                        "(default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--model", dest="model_flag", default=None, help="same as the positional MODEL")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: bfloat16 on CUDA and on CPUs with AMX-BF16 or AVX512-BF16, else "
                        "float32 (float32 is the exact reference)")
    p.add_argument("--quantization", default="auto",
                   choices=list(QUANTIZATION_CHOICES),
                   help="quantized linear layers: int8 (per output channel) or int4 (groups "
                        "of 32; a Q4_0/Q4_1 GGUF keeps its own integers exactly) weight-only "
                        "with bfloat16 activations; w4a8 (those 4-bit blocks times int8 "
                        "activations in blocks of 32, the fastest at few streams) or w8a8 "
                        "(int8 weights per channel, int8 activations per row); auto: w4a8 "
                        "for a Q4_0/Q4_1 GGUF in bfloat16 on a CPU with AVX512-VNNI (without "
                        "it int4 for --max-num-seqs <= 4), else none")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
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
    p.add_argument("--kv-cache-memory", type=_parse_bytes, default=None,
                   help="KV pool size, e.g. 512MiB, 2GiB or bytes")
    p.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                   help="auto: the model's dtype, except int8 where --dtype auto chose "
                        "float32 + w4a8 (CPUs without native bfloat16); model: the model's "
                        "dtype always; int8: each key/value row as int8 with a float32 scale, "
                        "~half the bytes per token of bfloat16 (more tokens in the pool, less "
                        "to read per decode step)")
    p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching",
                   action="store_false")
    p.add_argument("--cache-dir", default=None,
                   help=f"HF cache to search (else {', '.join(map(str, hf_cache_dirs(None)))})")


def _parse_bytes(text: str) -> int:
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9}
    low = text.strip().lower()
    for suffix, mult in units.items():
        if low.endswith(suffix):
            return int(float(low[: -len(suffix)]) * mult)
    try:
        return int(low)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 512MiB or 2GiB)") from None


def _build_llm(args: argparse.Namespace):
    from met import LLM

    return LLM(
        args.model_flag or args.model, dtype=args.dtype, device=args.device,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory, enable_prefix_caching=args.enable_prefix_caching,
        cache_dir=args.cache_dir, quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype, linear_backend=args.linear_backend,
        attention_backend=args.attention_backend,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from met import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, seed=args.seed, min_p=args.min_p, top_n_sigma=args.top_n_sigma,
        repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, logit_bias=args.logit_bias,
        stop_token_ids=args.stop_token_ids,
    )  # before loading the model, so a bad value fails at once
    llm = _build_llm(args)
    start = time.perf_counter()
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
    else:
        out = llm.generate([args.prompt], params)[0]
    elapsed = time.perf_counter() - start
    print(out.outputs[0].text)
    n = len(out.outputs[0].token_ids)
    stop = out.outputs[0].stop_reason
    print(f"[{n} tokens in {elapsed:.2f}s, finish_reason={out.outputs[0].finish_reason}"
          f"{'' if stop is None else f', stop_reason={stop}'}]", file=sys.stderr)
    return 0


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


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
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


def _engine_config(args: argparse.Namespace):
    from met.config import EngineConfig

    return EngineConfig(
        model=args.model_flag or args.model, dtype=args.dtype, device=args.device,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory, enable_prefix_caching=args.enable_prefix_caching,
        cache_dir=args.cache_dir, quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype, linear_backend=args.linear_backend,
        attention_backend=args.attention_backend,
    )


def cmd_serve(args: argparse.Namespace) -> int:
    from met.api.context import ServerConfig
    from met.api.server import serve
    from met.loader.resolve import resolve_model
    from met.serving.prompts import load_chat_template
    from met.serving.validation import RequestLimits

    engine_config = _engine_config(args)
    source = resolve_model(engine_config.model, engine_config.cache_dir)  # fail fast, not later
    names = args.served_model_name or [
        engine_config.model if engine_config.model else source.path.stem.split(".")[0]]
    keys = list(args.api_key or [])
    if not keys and os.environ.get("MET_API_KEY"):
        keys = [os.environ["MET_API_KEY"]]
    config = ServerConfig(
        served_model_names=tuple(names), host=args.host, port=args.port, api_keys=tuple(keys),
        request_timeout=args.request_timeout, max_queued_requests=args.max_queued_requests,
        log_requests=args.log_requests, max_body_bytes=args.max_request_body,
        chat_template=load_chat_template(args.chat_template),
        request_limits=RequestLimits(
            max_prompt_tokens=args.max_prompt_tokens, max_n=args.max_n,
            max_tokens=args.max_tokens_limit, max_stop_strings=args.max_stop_strings,
            max_stop_string_chars=args.max_stop_string_length, max_tools=args.max_tools,
            max_tool_schema_bytes=args.max_tool_schema_bytes,
            max_logit_bias=args.max_logit_bias),
        rate_limit_rpm=args.rate_limit_rpm, rate_limit_tpm=args.rate_limit_tpm,
        shutdown_timeout=args.shutdown_timeout,
        tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
        max_thinking_budget=args.max_thinking_budget,
        responses_store_max=args.responses_store_max,
        responses_store_ttl=args.responses_store_ttl,
    )
    return serve(engine_config, config)


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8888)
    p.add_argument("--served-model-name", action="append", default=None,
                   help="the name clients use in 'model' (repeatable; default: the MODEL "
                        "argument)")
    p.add_argument("--api-key", action="append", default=None,
                   help="require 'Authorization: Bearer KEY' or 'x-api-key: KEY' (repeatable; "
                        "default $MET_API_KEY)")
    p.add_argument("--chat-template", default=None,
                   help="Jinja chat template (a file or the text) instead of the model's")
    p.add_argument("--request-timeout", type=float, default=300.0,
                   help="seconds; a request past it finishes with finish_reason 'timeout'")
    p.add_argument("--max-queued-requests", type=int, default=None,
                   help="at most this many requests wait for a seat (beyond the "
                        "--max-num-seqs running); more get 503 + Retry-After")
    p.add_argument("--max-request-body", type=_parse_bytes, default=32 << 20,
                   help="largest request body (413 above it), e.g. 32MiB")
    p.add_argument("--log-requests", action="store_true",
                   help="log every request (prompt, parameters, token counts, latency); "
                        "without it no prompt or output is ever logged")
    p.add_argument("--tool-call-parser", default="auto",
                   choices=["auto", "hermes", "llama3_json", "mistral", "qwen3_coder"],
                   help="how tool calls are read from the output (auto: from the chat "
                        "template; hermes when it shows no format)")
    p.add_argument("--reasoning-parser", default="auto", choices=["auto", "think", "none"],
                   help="split <think>...</think> into reasoning_content (auto: when the chat "
                        "template uses <think>)")
    p.add_argument("--max-thinking-budget", type=int, default=None,
                   help="cap on thinking tokens for every request of a <think> model (also the "
                        "scale of reasoning_effort low/medium/high = 1/4, 1/2, all; default "
                        "16384 for reasoning_effort, no cap otherwise)")
    p.add_argument("--responses-store-max", type=int, default=1000,
                   help="most /v1/responses results kept for GET and previous_response_id "
                        "(oldest dropped first; 0 = store none)")
    p.add_argument("--responses-store-ttl", type=float, default=3600.0,
                   help="seconds a stored /v1/responses result is kept")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM/SIGINT; then "
                        "they end with an error")
    p.add_argument("--rate-limit-rpm", type=int, default=None,
                   help="requests per minute per API key (per client address without keys); "
                        "over it: 429 + Retry-After")
    p.add_argument("--rate-limit-tpm", type=int, default=None,
                   help="tokens (prompt + max_tokens) per minute per API key or address")
    lim = p.add_argument_group("request limits (a request over one gets a 400 naming the field)")
    lim.add_argument("--max-prompt-tokens", type=int, default=None,
                     help="longest prompt in tokens (default: what the context holds)")
    lim.add_argument("--max-n", type=int, default=64, help="largest n (choices per prompt)")
    lim.add_argument("--max-tokens-limit", type=int, default=None,
                     help="largest max_tokens; also caps an unspecified max_tokens")
    lim.add_argument("--max-stop-strings", type=int, default=16)
    lim.add_argument("--max-stop-string-length", type=int, default=256, help="characters")
    lim.add_argument("--max-tools", type=int, default=128)
    lim.add_argument("--max-tool-schema-bytes", type=_parse_bytes, default=64 << 10,
                     help="largest tool definition, as JSON (e.g. 64KiB)")
    lim.add_argument("--max-logit-bias", type=int, default=1024, help="most logit_bias entries")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="met", description="met: LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete one prompt and print the text")
    _add_engine_args(gen)
    gen.add_argument("--prompt", required=True)
    _add_sampling_args(gen)
    gen.add_argument("--chat", action="store_true",
                     help="wrap the prompt as a user message with the model's chat template")
    gen.set_defaults(func=cmd_generate)

    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (FastAPI + uvicorn)")
    _add_engine_args(srv)
    _add_serve_args(srv)
    srv.set_defaults(func=cmd_serve)

    add_bench_parser(sub)
    add_kernels_parser(sub)

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"met: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
