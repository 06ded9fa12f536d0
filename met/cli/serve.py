"""`met serve`: the HTTP server, with a live dashboard when stdout is a terminal."""

from __future__ import annotations

import argparse
import functools
import os
import sys

from met.cli.args import add_engine_args, parse_bytes
from met.cli.args import engine_config as build_engine_config


def add_parser(sub: argparse._SubParsersAction) -> None:
    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (FastAPI + uvicorn)")
    add_engine_args(srv)
    _add_args(srv)
    srv.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from met.api.context import ServerConfig
    from met.api.server import serve
    from met.loader.resolve import resolve_model
    from met.serving.prompts import load_chat_template
    from met.serving.validation import RequestLimits

    engine_config = build_engine_config(args)
    models = pool_config = None
    if args.models_dir is not None or args.models:
        models, pool_config = _router_models(args, engine_config)
        names = list(models)
    else:
        for flag in ("max_loaded_models", "idle_unload_seconds", "model_load_timeout"):
            if getattr(args, flag) is not None:
                raise ValueError(f"--{flag.replace('_', '-')}: only with --models-dir or "
                                 "--models (several models in one server)")
        source = resolve_model(engine_config.model, engine_config.cache_dir)  # fail fast
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
        allow_runtime_lora=args.allow_runtime_lora,
        score_mode=args.score_mode,
    )
    if models is not None:  # the dashboard shows one engine: the plain log here
        return serve(engine_config, config, models=models, pool_config=pool_config)
    return serve(engine_config, config, attach=_face(args))


def _router_models(args: argparse.Namespace, engine_config):
    """--models-dir / --models: the models (name → path) and the pool's flags."""
    from met.api.model_pool import PoolConfig
    from met.loader.models_dir import collect_models

    if engine_config.model is not None:
        raise ValueError("--models-dir: serves the models in the directory; pass MODEL with "
                         "--models instead of as the model argument")
    if args.served_model_name:
        raise ValueError("--served-model-name: with --models-dir each model is served under "
                         "its directory or file name")
    models = collect_models(args.models_dir, list(args.models or []), engine_config.cache_dir)
    pool = PoolConfig(
        max_loaded_models=4 if args.max_loaded_models is None else args.max_loaded_models,
        idle_unload_seconds=args.idle_unload_seconds,
        load_timeout=300.0 if args.model_load_timeout is None else args.model_load_timeout)
    return models, pool


def _face(args: argparse.Namespace):
    """What is shown around the server. At a terminal: startup progress and the banner, then
    the live dashboard (unless --no-tui). Otherwise (a pipe, CI, systemd, TERM=dumb): the
    plain log, ending with the same banner as plain lines."""
    from met.cli.serve_face import PlainFace, ServeFace

    if not sys.stdout.isatty() or os.environ.get("TERM") == "dumb":
        return PlainFace
    return functools.partial(ServeFace, dashboard=args.tui)


def _add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8888)
    p.add_argument("--served-model-name", action="append", default=None,
                   help="the name clients use in 'model' (repeatable; default: the MODEL "
                        "argument)")
    router = p.add_argument_group(
        "several models (llama.cpp's router mode; docs/models-dir.md)")
    router.add_argument("--models-dir", default=None, metavar="DIR",
                        help="serve every model in DIR: each checkpoint directory (config.json "
                             "or one .gguf) under its name, each .gguf file under its name "
                             "without .gguf; loaded when a request names it")
    router.add_argument("--models", nargs="+", default=None, metavar="MODEL",
                        help="more models for the router (paths or HF-cache ids, served under "
                             "the directory / file name, or the id); alone or beside "
                             "--models-dir")
    router.add_argument("--max-loaded-models", type=int, default=None, metavar="N",
                        help="at most N models loaded at once (default 4); loading another "
                             "unloads the least recently used idle one, and waits while all "
                             "are busy")
    router.add_argument("--idle-unload-seconds", type=float, default=None, metavar="S",
                        help="unload a model no request has used for S seconds (default: "
                             "never)")
    router.add_argument("--model-load-timeout", type=float, default=None, metavar="S",
                        help="how long a request waits for its model to load (default 300); "
                             "then 503 + Retry-After (the load goes on)")
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
    p.add_argument("--max-request-body", type=parse_bytes, default=32 << 20,
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
    p.add_argument("--score-mode", choices=("auto", "yesno", "cosine"), default="auto",
                   help="/v1/rerank and /v1/score: yesno = P('yes') of a Qwen3-Reranker-style "
                        "prompt, cosine = cosine of last-token embeddings; auto = yesno when "
                        "the tokenizer has single-token 'yes' and 'no', else cosine")
    p.add_argument("--responses-store-max", type=int, default=1000,
                   help="most /v1/responses results kept for GET and previous_response_id "
                        "(oldest dropped first; 0 = store none)")
    p.add_argument("--allow-runtime-lora", action="store_true",
                   help="allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter "
                        "(behind --api-key; needs --enable-lora)")
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
    p.add_argument("--no-tui", dest="tui", action="store_false",
                   help="no live dashboard in a terminal: the plain log (what a pipe, CI or "
                        "systemd always gets)")
    lim = p.add_argument_group("request limits (a request over one gets a 400 naming the field)")
    lim.add_argument("--max-prompt-tokens", type=int, default=None,
                     help="longest prompt in tokens (default: what the context holds)")
    lim.add_argument("--max-n", type=int, default=64, help="largest n (choices per prompt)")
    lim.add_argument("--max-tokens-limit", type=int, default=None,
                     help="largest max_tokens; also caps an unspecified max_tokens")
    lim.add_argument("--max-stop-strings", type=int, default=16)
    lim.add_argument("--max-stop-string-length", type=int, default=256, help="characters")
    lim.add_argument("--max-tools", type=int, default=128)
    lim.add_argument("--max-tool-schema-bytes", type=parse_bytes, default=64 << 10,
                     help="largest tool definition, as JSON (e.g. 64KiB)")
    lim.add_argument("--max-logit-bias", type=int, default=1024, help="most logit_bias entries")
