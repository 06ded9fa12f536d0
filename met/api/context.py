"""Server configuration and the per-app context every route reads (no module-level state)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from met.api.auth import valid_key
from met.api.errors import ApiError
from met.api.metrics import ServerMetrics
from met.api.ratelimit import RateLimiter
from met.engine.async_engine import AsyncEngine, EngineState
from met.sampling.params import SamplingParams
from met.sampling.scoring import SCORE_MODES, resolve_score_mode
from met.serving.beam import BeamGeneration
from met.serving.errors import InvalidRequest
from met.serving.generate import ChoiceState, Generation
from met.serving.prompts import Prompt
from met.serving.protocol import ignored_fields, parse_body
from met.serving.reasoning import REASONING_PARSER_CHOICES
from met.serving.response_store import DEFAULT_STORE_MAX, DEFAULT_STORE_TTL_S, ResponseStore
from met.serving.tool_parsers import TOOL_PARSER_CHOICES
from met.serving.validation import ModelLimits, OutputOptions, RequestLimits

log = logging.getLogger("met.api")

DEFAULT_MAX_BODY_BYTES = 32 << 20


@dataclass(frozen=True)
class ServerConfig:
    """What `met serve` adds on top of the engine config."""

    served_model_names: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 8888
    api_keys: tuple[str, ...] = ()
    request_timeout: float | None = 300.0
    max_queued_requests: int | None = None
    log_requests: bool = False
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    chat_template: str | None = None  # overrides the model's template (the text, not a path)
    request_limits: RequestLimits = field(default_factory=RequestLimits)
    rate_limit_rpm: int | None = None  # requests per minute per key
    rate_limit_tpm: int | None = None  # prompt + max_tokens per minute per key
    shutdown_timeout: float = 30.0  # seconds in-flight requests get after SIGTERM
    tool_call_parser: str = "auto"  # --tool-call-parser (auto: from the chat template)
    reasoning_parser: str = "auto"  # --reasoning-parser (auto: think if the template has it)
    max_thinking_budget: int | None = None  # --max-thinking-budget (reasoning_effort's scale)
    responses_store_max: int = DEFAULT_STORE_MAX  # --responses-store-max (stored responses)
    responses_store_ttl: float = DEFAULT_STORE_TTL_S  # --responses-store-ttl (seconds)
    allow_runtime_lora: bool = False  # --allow-runtime-lora: /v1/load_lora_adapter and unload
    score_mode: str = "auto"  # --score-mode: /v1/rerank and /v1/score (met.sampling.scoring)

    def __post_init__(self) -> None:
        if self.tool_call_parser not in TOOL_PARSER_CHOICES:
            raise ValueError(f"--tool-call-parser: must be one of "
                             f"{', '.join(TOOL_PARSER_CHOICES)}, got {self.tool_call_parser!r}")
        if self.reasoning_parser not in REASONING_PARSER_CHOICES:
            raise ValueError(f"--reasoning-parser: must be one of "
                             f"{', '.join(REASONING_PARSER_CHOICES)}, got "
                             f"{self.reasoning_parser!r}")
        if self.score_mode not in SCORE_MODES:
            raise ValueError(f"--score-mode: must be one of {', '.join(SCORE_MODES)}, got "
                             f"{self.score_mode!r}")
        if not self.served_model_names or not all(self.served_model_names):
            raise ValueError("--served-model-name: needs at least one non-empty name")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port: must be in [0, 65535], got {self.port}")
        if self.request_timeout is not None and self.request_timeout <= 0:
            raise ValueError(f"--request-timeout: must be > 0 seconds, got {self.request_timeout}")
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise ValueError(
                f"--max-queued-requests: must be >= 0, got {self.max_queued_requests}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"--max-request-body: must be >= 1KiB, got {self.max_body_bytes}")
        if any(not k for k in self.api_keys):
            raise ValueError("--api-key: keys must be non-empty")
        for flag, value in (("--rate-limit-rpm", self.rate_limit_rpm),
                            ("--rate-limit-tpm", self.rate_limit_tpm)):
            if value is not None and value < 1:
                raise ValueError(f"{flag}: must be >= 1, got {value}")
        if self.responses_store_max < 0:
            raise ValueError(f"--responses-store-max: must be >= 0 (0 = store nothing), got "
                             f"{self.responses_store_max}")
        if not self.responses_store_ttl > 0:
            raise ValueError(f"--responses-store-ttl: must be > 0 seconds, got "
                             f"{self.responses_store_ttl}")
        if not self.shutdown_timeout >= 0:
            raise ValueError(f"--shutdown-timeout: must be >= 0 seconds, got "
                             f"{self.shutdown_timeout}")

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]


@dataclass(frozen=True)
class ModelInfo:
    """Known once the engine has loaded: what the routes need from the model."""

    tokenizer: Any
    chat_template: str | None
    limits: ModelLimits
    root: str
    dtype: str
    # "int8", "int4", "w8a8", "w4a8" or "none" (what --quantization auto chose, if auto)
    quantization: str
    # The KV cache's element type: "int8" or the model's dtype (--kv-cache-dtype resolved)
    kv_cache_dtype: str = ""
    hidden_size: int = 0  # an embedding's length (the most ``dimensions`` may ask for)
    pooling: str = "last"  # embeddings' defaults (--pooling, --no-normalize-embeddings)
    normalize_embeddings: bool = True
    # /v1/rerank and /v1/score: "yesno" (with the (no, yes) token ids) or "cosine"
    # ("unavailable: why" when --score-mode cannot serve this model)
    score_mode: str = "cosine"
    score_token_ids: tuple[int, int] | None = None


class ServerContext:
    """The app's engine, metrics and config; routes reach it through ``request.app.state``."""

    def __init__(self, config: ServerConfig, engine: AsyncEngine,
                 rate_limiter: RateLimiter | None = None,
                 response_store: ResponseStore | None = None):
        """``rate_limiter`` and ``response_store`` are given when several models share them
        (--models-dir: a key's limits and stored responses are the server's, not a model's)."""
        self.config = config
        self.engine = engine
        self.metrics = ServerMetrics(config.model_name)
        self.model: ModelInfo | None = None
        self.created = int(time.time())
        # "is None", not "or": an empty store is falsy (it has a length).
        self.rate_limiter = (RateLimiter(config.rate_limit_rpm, config.rate_limit_tpm)
                             if rate_limiter is None else rate_limiter)
        self.response_store = (ResponseStore(config.responses_store_max,
                                             config.responses_store_ttl)
                               if response_store is None else response_store)
        # Generations admitted but not yet added to the engine (a route awaits between the
        # two): counted by check_queue so a burst cannot all slip past a full queue.
        self._admitted: weakref.WeakValueDictionary[int, Generation] = \
            weakref.WeakValueDictionary()

    def on_engine_ready(self) -> None:
        core = self.engine.core
        assert core is not None
        loaded = core.loaded
        try:
            score_mode, score_ids = resolve_score_mode(self.config.score_mode, loaded.tokenizer)
        except ValueError as e:  # --score-mode yesno on the wrong tokenizer: the routes say so
            log.error("%s", e)
            score_mode, score_ids = f"unavailable: {e}", None
        self.model = ModelInfo(
            tokenizer=loaded.tokenizer,
            chat_template=self.config.chat_template or loaded.chat_template,
            limits=ModelLimits(core.max_model_len, int(loaded.hf_config.vocab_size),
                               core.config.block_size, core.kv.pool.num_blocks,
                               self.config.request_limits),
            root=str(loaded.source.path),
            dtype=str(core.dtype).removeprefix("torch."),
            quantization=core.quantization or "none",
            kv_cache_dtype=("int8" if core.kv_cache_dtype == "int8"
                            else str(core.dtype).removeprefix("torch.")),
            hidden_size=int(loaded.hf_config.hidden_size),
            pooling=core.config.pooling,
            normalize_embeddings=core.config.normalize_embeddings,
            score_mode=score_mode,
            score_token_ids=score_ids,
        )

    def require_model(self) -> ModelInfo:
        """The loaded model, or a 503 saying why there is none."""
        if self.engine.state == EngineState.FAULTED:
            raise ApiError(503, f"the engine has faulted: {self.engine.fault_reason}", None,
                           "engine_faulted")
        if self.engine.state == EngineState.SLEEPING:
            raise ApiError(503, f"the engine is sleeping (level {self.engine.sleep_level}); "
                           "POST /wake_up to serve again", None, "engine_sleeping",
                           {"Retry-After": "5"})
        if self.model is None or self.engine.state != EngineState.READY:
            raise ApiError(503, "the model is still loading; retry shortly", None,
                           "model_loading", {"Retry-After": "5"})
        return self.model

    def adapter_names(self) -> list[str]:
        """The LoRA adapters the engine serves now (none until it is built)."""
        core = self.engine.core
        lora = getattr(core, "lora", None) if core is not None else None
        return sorted(lora.adapters) if lora is not None else []

    def check_model(self, req) -> None:
        """``req.model`` names the served model or a LoRA adapter (then it becomes the
        request's ``adapter``, as vLLM's clients expect); an unknown adapter is a 404."""
        adapters = self.adapter_names()
        adapter = getattr(req, "adapter", None)
        if adapter is not None and adapter not in adapters:
            raise InvalidRequest(f"adapter: unknown LoRA adapter {adapter!r} (loaded: "
                                 f"{', '.join(adapters) or 'none'})", "adapter",
                                 "model_not_found", 404)
        if req.model in adapters:
            if adapter is None and "adapter" in type(req).model_fields:
                req.adapter = req.model
            return
        self.check_model_name(req.model)

    def check_model_name(self, name: str | None) -> None:
        if name is not None and name not in self.config.served_model_names:
            served = ", ".join(repr(n) for n in self.config.served_model_names)
            raise InvalidRequest(f"model: the model {name!r} does not exist (this server serves "
                                 f"{served})", "model", "model_not_found", 404)

    def check_queue(self) -> None:
        """503 when this request would have to wait and the wait line is already full."""
        limit = self.config.max_queued_requests
        core = self.engine.core
        if limit is None or core is None:
            return
        # Counted on the loop (exact, no lag behind aborts): in-flight choices beyond
        # --max-num-seqs are waiting for a seat.
        seats = core.config.max_num_seqs
        in_flight = self.engine.num_in_flight + self._num_admitted_not_started()
        if in_flight < seats:
            return  # a seat is free: this request starts at once
        waiting = in_flight - seats
        if waiting + 1 > limit:
            raise ApiError(503, f"the server is busy: {waiting} requests are already waiting "
                           f"(--max-queued-requests {limit}); retry later", None, "queue_full",
                           {"Retry-After": "1"})

    def has_pending_requests(self) -> bool:
        """Whether any request is in flight or admitted and about to be added."""
        return bool(self.engine.num_in_flight or self._num_admitted_not_started())

    def live_generations(self) -> list[Generation]:
        """The requests admitted and not yet finished (read by the terminal dashboard)."""
        return list(self._admitted.values())

    def _num_admitted_not_started(self) -> int:
        engine = self.engine
        return sum(len(g.choices) for g in list(self._admitted.values())
                   if not any(c.finished or engine.has_request(c.request_id)
                              for c in g.choices))

    def new_generation(self, request: Request, kind: str, prompts: list[Prompt],
                       params: list[SamplingParams], n: int,
                       options: OutputOptions) -> Generation:
        """Admit a validated request (charging its rate limits): its Generation."""
        model = self.require_model()
        if self.rate_limiter.enabled:
            tokens = n * sum(len(p.token_ids) + sp.max_tokens
                             for p, sp in zip(prompts, params, strict=True))
            self.rate_limiter.admit(rate_limit_key(request, self.config), tokens)
        kind_cls = BeamGeneration if params[0].num_beams > 1 else Generation
        gen = kind_cls(self.engine, model.tokenizer, prompts, params, n, options,
                       self.config.request_timeout, self._on_choice_done,
                       request_id=request_id(request))
        self._admitted[id(gen)] = gen
        if self.config.log_requests:
            # Prompts are user data: only ever logged when the operator asked for it.
            log.info("request %s: %s, %d prompt(s) of %s tokens, n=%d, params=%s, stop=%s, "
                     "prompt=%s", gen.request_id, kind, len(prompts),
                     [len(p.token_ids) for p in prompts], n, params[0], options.stop,
                     [_clip(p.text) if p.text is not None else p.token_ids[:64]
                      for p in prompts])
        return gen

    def _on_choice_done(self, gen: Generation, c: ChoiceState) -> None:
        if all(ch.finished for ch in gen.choices):
            self._admitted.pop(id(gen), None)
        self.metrics.on_choice_done(gen, c)
        if self.config.log_requests and all(ch.finished for ch in gen.choices):
            log.info("request %s done in %.3fs: prompt_tokens=%d completion_tokens=%d "
                     "cached_tokens=%d finish_reasons=%s", gen.request_id,
                     time.monotonic() - gen.arrival, gen.prompt_tokens, gen.completion_tokens,
                     gen.cached_tokens, [ch.finish_reason for ch in gen.choices])


def _clip(text: str, limit: int = 2000) -> str:
    return repr(text if len(text) <= limit else text[:limit] + f"… [{len(text)} chars]")


def rate_limit_key(request: Request, config: ServerConfig) -> str:
    """Whom a rate limit counts against: the API key when the server has keys (hashed, so
    the table never holds the keys themselves), else the client's address."""
    if config.api_keys:
        key = valid_key(dict(request.scope["headers"]), config.api_keys)
        if key is not None:
            return "key:" + hashlib.sha256(key.encode()).hexdigest()[:24]
    return "addr:" + (request.client.host if request.client else "unknown")


ROUTED_CONTEXT_KEY = "met_ctx"  # scope["state"] key where the model router puts a context


def server_context(request: Request) -> ServerContext:
    """The context serving this request: the one engine's, or (``--models-dir``) the one of
    the model the request names, which the model router (model_router.py) put in the scope.
    A request that names no model on a several-model server is a 400 naming ``model``."""
    routed = request.scope.get("state", {}).get(ROUTED_CONTEXT_KEY)
    if routed is not None:
        return routed
    ctx = request.app.state.ctx
    if ctx is None:
        names = ", ".join(repr(n) for n in request.app.state.pool.names())
        raise InvalidRequest(f"model: this server serves several models; name one in "
                             f"'model' (one of {names})", "model")
    return ctx


def response_store(request: Request) -> ResponseStore:
    """The stored /v1/responses results (one store per server, shared by all its models)."""
    routed = request.scope.get("state", {}).get(ROUTED_CONTEXT_KEY)
    if routed is not None:
        return routed.response_store
    ctx = request.app.state.ctx
    return ctx.response_store if ctx is not None else request.app.state.pool.response_store


def request_id(request: Request) -> str:
    return request.scope.get("state", {}).get("request_id") or "unknown"


async def read_json(request: Request, limit: int) -> Any:
    """The body as JSON, or 413 over ``limit`` bytes / 400 when it is not JSON."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise InvalidRequest(f"request body: {int(length)} bytes is over the {limit}-byte limit",
                             None, "request_too_large", 413)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise InvalidRequest(f"request body: over the {limit}-byte limit", None,
                                 "request_too_large", 413)
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InvalidRequest(f"request body: malformed JSON ({e})", None, "invalid_json") from None


IGNORED_FIELDS_HEADER = "x-met-ignored-fields"


def parse_request(request: Request, model: type, body: Any,
                  field_names: frozenset[str] | None = None) -> Any:
    """``parse_body`` (400s naming the field), and vLLM's rule for fields no model defines:
    accepted, logged as a warning and named in the response's x-met-ignored-fields header."""
    req = parse_body(model, body) if field_names is None else parse_body(model, body,
                                                                          field_names)
    ignored = sorted(ignored_fields(req, body))
    if ignored:
        log.warning("request %s: ignored unknown fields: %s", request_id(request),
                    ", ".join(ignored))
        request.scope.setdefault("state", {})["ignored_fields"] = ignored
    return req


class ClientDisconnected(Exception):
    """The client went away before the response was ready."""


async def until_disconnected(request: Request, work: Any) -> Any:
    """Await ``work``; if the client disconnects first, cancel it (which aborts its requests)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    if task in done:
        watcher.cancel()
        return task.result()
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    raise ClientDisconnected()


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
