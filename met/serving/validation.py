"""Request fields → SamplingParams + output options, with 400s that name the field and range."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from met.sampling.params import (
    DRY_DEFAULT_BREAKERS,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    RepetitionDetection,
    SamplingParams,
)
from met.serving.errors import InvalidRequest, from_value_error
from met.serving.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    Unsupported,
    refuse_unsupported,
)

MAX_N = 128
MAX_BEAMS = 16
_MAX_SEED = 2**63 - 1
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass(frozen=True)
class RequestLimits:
    """What the operator allows one request to ask for (``met serve`` flags); None = no limit
    beyond what the model can hold. Each breach is a 400 naming the field."""

    max_prompt_tokens: int | None = None  # --max-prompt-tokens
    max_n: int = 64  # --max-n
    max_tokens: int | None = None  # --max-tokens-limit
    max_stop_strings: int = 16  # --max-stop-strings
    max_stop_string_chars: int = 256  # --max-stop-string-length
    max_tools: int = 128  # --max-tools
    max_tool_schema_bytes: int = 64 << 10  # --max-tool-schema-bytes (each tool, as JSON)
    max_logit_bias: int = 1024  # --max-logit-bias

    def __post_init__(self) -> None:
        for flag, value, low in (
            ("--max-prompt-tokens", self.max_prompt_tokens, 1), ("--max-n", self.max_n, 1),
            ("--max-tokens-limit", self.max_tokens, 1),
            ("--max-stop-strings", self.max_stop_strings, 0),
            ("--max-stop-string-length", self.max_stop_string_chars, 1),
            ("--max-tools", self.max_tools, 0),
            ("--max-tool-schema-bytes", self.max_tool_schema_bytes, 2),
            ("--max-logit-bias", self.max_logit_bias, 0),
        ):
            if value is not None and value < low:
                raise ValueError(f"{flag}: must be >= {low}, got {value}")
        if self.max_n > MAX_N:
            raise ValueError(f"--max-n: must be <= {MAX_N}, got {self.max_n}")


@dataclass(frozen=True)
class ModelLimits:
    """What the loaded engine can hold (fixed once the model is loaded), and what the
    operator lets one request ask for."""

    max_model_len: int
    vocab_size: int
    block_size: int
    num_kv_blocks: int
    requests: RequestLimits = field(default_factory=RequestLimits)

    @property
    def max_sequence_tokens(self) -> int:
        """Longest prompt + output one request can have (context and KV pool both bound it)."""
        return min(self.max_model_len, self.num_kv_blocks * self.block_size)


@dataclass(frozen=True)
class OutputOptions:
    """What the serving layer (not the engine) does with the generated tokens."""

    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    min_tokens: int = 0  # stop strings only count from this many output tokens on


def check_ranges(req: SamplingFields, max_tokens: int | None,
                 max_tokens_param: str = "max_tokens") -> None:
    """Field-by-field checks that do not depend on the prompt."""
    _in_range("temperature", req.temperature, 0.0, 2.0)
    if req.top_p is not None and not 0.0 < req.top_p <= 1.0:
        raise InvalidRequest(f"top_p: must be in (0, 1], got {req.top_p}", "top_p")
    if req.top_k is not None and req.top_k < -1:
        raise InvalidRequest(f"top_k: must be -1 or 0 (off) or a positive integer, got "
                             f"{req.top_k}", "top_k")
    _in_range("n", req.n, 1, MAX_N)
    if max_tokens is not None and max_tokens < 1:
        raise InvalidRequest(f"{max_tokens_param}: must be >= 1, got {max_tokens}",
                             max_tokens_param)
    if req.min_tokens < 0:
        raise InvalidRequest(f"min_tokens: must be >= 0, got {req.min_tokens}", "min_tokens")
    if max_tokens is not None and req.min_tokens > max_tokens:
        raise InvalidRequest(f"min_tokens: must be <= {max_tokens_param} ({max_tokens}), got "
                             f"{req.min_tokens}", "min_tokens")
    if req.seed is not None and not -_MAX_SEED <= req.seed <= _MAX_SEED:
        raise InvalidRequest(f"seed: must be in [-2**63 + 1, 2**63 - 1], got {req.seed}", "seed")
    for s in stop_strings(req):
        if not s:
            raise InvalidRequest("stop: stop strings must be non-empty", "stop")
    _in_range("min_p", req.min_p, 0.0, 1.0)
    if req.top_n_sigma is not None and not req.top_n_sigma >= 0:
        raise InvalidRequest(f"top_n_sigma: must be >= 0 (0 = off), got {req.top_n_sigma}",
                             "top_n_sigma")
    if req.repetition_penalty is not None and not 0 < req.repetition_penalty <= 10:
        raise InvalidRequest(f"repetition_penalty: must be in (0, 10] (1 = off), got "
                             f"{req.repetition_penalty}", "repetition_penalty")
    if req.repetition_penalty_window is not None and req.repetition_penalty_window < 1:
        raise InvalidRequest(f"repetition_penalty_window: must be >= 1, got "
                             f"{req.repetition_penalty_window}", "repetition_penalty_window")
    _in_range("presence_penalty", req.presence_penalty, -2.0, 2.0)
    _in_range("frequency_penalty", req.frequency_penalty, -2.0, 2.0)
    if req.lz_penalty is not None and not req.lz_penalty >= 0:
        raise InvalidRequest(f"lz_penalty: must be >= 0 (0 = off), got {req.lz_penalty}",
                             "lz_penalty")
    if req.dry_multiplier is not None and not req.dry_multiplier >= 0:
        raise InvalidRequest(f"dry_multiplier: must be >= 0 (0 = off), got "
                             f"{req.dry_multiplier}", "dry_multiplier")
    if req.dry_base is not None and not 1 < req.dry_base <= 10:
        raise InvalidRequest(f"dry_base: must be in (1, 10], got {req.dry_base}", "dry_base")
    if req.dry_allowed_length is not None and req.dry_allowed_length < 1:
        raise InvalidRequest(f"dry_allowed_length: must be >= 1, got {req.dry_allowed_length}",
                             "dry_allowed_length")
    logit_bias(req)
    if req.allowed_token_ids is not None and not req.allowed_token_ids:
        raise InvalidRequest("allowed_token_ids: must name at least one token id",
                             "allowed_token_ids")
    for w in req.bad_words or ():
        if not (w.strip() if isinstance(w, str) else w):
            raise InvalidRequest("bad_words: entries must be non-empty strings or token-id "
                                 "lists", "bad_words")
    requested_logprobs(req)
    requested_prompt_logprobs(req)
    repetition_detection(req)
    if req.stream_options is not None and not req.stream:
        raise InvalidRequest("stream_options: only allowed with stream: true",
                             "stream_options")
    if req.cache_salt is not None and not req.cache_salt:
        raise InvalidRequest("cache_salt: must be a non-empty string", "cache_salt")
    check_unsupported(req)
    if isinstance(req, CompletionRequest):
        check_best_of(req)


# OpenAI chat fields met cannot honour, with the values that ask for nothing (accepted).
_UNSUPPORTED_CHAT: Unsupported = {
    "audio": ((None,), "audio output is not served"),
    "modalities": ((None, ["text"]), "only [\"text\"] is served"),
    "prediction": ((None,), "predicted outputs are not served"),
    "functions": ((None, []), "the deprecated functions API is not served; send tools"),
    "function_call": ((None,), "the deprecated functions API is not served; send "
                               "tool_choice"),
    "web_search_options": ((None,), "web search is not served"),
    "verbosity": ((None,), "verbosity control is not served"),
    "service_tier": ((None, "auto", "default"), "there is one service tier"),
    "store": ((None, False), "chat completions are not stored (see /v1/responses)"),
}


def check_unsupported(req: SamplingFields) -> None:
    """OpenAI fields with no machinery behind them: a 400 naming the field unless it has
    the value that asks for nothing."""
    if isinstance(req, ChatCompletionRequest):
        refuse_unsupported(req, _UNSUPPORTED_CHAT)


def check_best_of(req: CompletionRequest) -> None:
    """``best_of`` (vLLM's and legacy OpenAI's): best_of candidates run, the n with the
    highest cumulative logprob come back; at least n, and not with stream or beams."""
    if req.best_of is None or req.best_of == req.n:
        return
    _in_range("best_of", req.best_of, 1, MAX_N)
    if req.best_of < req.n:
        raise InvalidRequest(f"best_of: must be >= n ({req.n}), got {req.best_of}", "best_of")
    if req.stream:
        raise InvalidRequest("best_of: cannot be combined with stream (the best candidates "
                             "are known only at the end); send stream: false", "best_of")
    if req.num_beams > 1:
        raise InvalidRequest("best_of: not available with beam search (num_beams > 1)",
                             "best_of")


def num_candidates(req: SamplingFields) -> int:
    """How many choices run per prompt: best_of (completions) or n."""
    best_of = getattr(req, "best_of", None)
    return max(req.n, best_of or 0)


def repetition_detection(req: SamplingFields) -> RepetitionDetection | None:
    """``repetition_detection`` checked; the 400 names the sub-field, e.g.
    ``repetition_detection.min_count``."""
    if req.repetition_detection is None:
        return None
    try:
        return RepetitionDetection(**req.repetition_detection.model_dump())
    except ValueError as e:
        raise from_value_error(e, "repetition_detection") from None


def requested_logprobs(req: SamplingFields) -> int | None:
    """How many top logprobs the engine must return per token (None: no logprobs).

    Chat: ``logprobs`` (bool) + ``top_logprobs`` in [0, 20]; completions: ``logprobs`` in
    [0, 20] (OpenAI caps it at 5; vLLM, like us, at 20)."""
    if isinstance(req, ChatCompletionRequest):
        if req.top_logprobs is not None:
            _in_range("top_logprobs", req.top_logprobs, 0, MAX_LOGPROBS)
            if not req.logprobs:
                raise InvalidRequest("top_logprobs: requires logprobs to be true",
                                     "top_logprobs")
        return (req.top_logprobs or 0) if req.logprobs else None
    if isinstance(req, CompletionRequest) and req.logprobs is not None:
        _in_range("logprobs", req.logprobs, 0, MAX_LOGPROBS)
        return req.logprobs
    return None


def requested_prompt_logprobs(req: SamplingFields) -> int | None:
    """How many top logprobs per prompt token (None: none): the explicit
    ``prompt_logprobs`` (vLLM's field, chat and completions), and for completions ``echo``
    with ``logprobs`` (the echoed prompt's tokens carry logprobs too, as in vLLM; not when
    streaming)."""
    if isinstance(req, ChatCompletionRequest) and req.prompt_logprobs is not None:
        _in_range("prompt_logprobs", req.prompt_logprobs, 0, MAX_LOGPROBS)
        if req.stream:
            raise InvalidRequest("prompt_logprobs: not supported with stream",
                                 "prompt_logprobs")
        if req.num_beams > 1:
            raise InvalidRequest("prompt_logprobs: not available with beam search "
                                 "(num_beams > 1)", "prompt_logprobs")
        return req.prompt_logprobs
    if not isinstance(req, CompletionRequest):
        return None
    if req.prompt_logprobs is not None:
        _in_range("prompt_logprobs", req.prompt_logprobs, 0, MAX_LOGPROBS)
        if req.stream:
            raise InvalidRequest("prompt_logprobs: not supported with stream",
                                 "prompt_logprobs")
    wanted = [k for k in (req.prompt_logprobs,
                          req.logprobs if req.echo and not req.stream else None)
              if k is not None]
    return max(wanted) if wanted else None


def logit_bias(req: SamplingFields) -> dict[int, float] | None:
    """``logit_bias`` with integer token ids; 400 for a key that is not one or a bias out of
    [-100, 100]."""
    if req.logit_bias is None:
        return None
    out = {}
    for key, bias in req.logit_bias.items():
        try:
            tid = int(key)
        except ValueError:
            raise InvalidRequest(f"logit_bias: keys must be token ids, got {key!r}",
                                 "logit_bias") from None
        if tid < 0:
            raise InvalidRequest(f"logit_bias: keys must be token ids >= 0, got {key!r}",
                                 "logit_bias")
        if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise InvalidRequest(f"logit_bias: biases must be in [-100, 100], got {bias} for "
                                 f"token {key}", "logit_bias")
        out[tid] = bias
    return out


def bad_words_ids(req: SamplingFields, tokenizer: Any) -> tuple[tuple[int, ...], ...]:
    """``bad_words`` as token-id sequences. A string bans both its tokenization alone and
    with a leading space (as vLLM does), since mid-text words usually carry the space."""
    out: list[tuple[int, ...]] = []
    for w in req.bad_words or ():
        if isinstance(w, list):
            variants = [tuple(w)]
        elif tokenizer is None:
            raise InvalidRequest("bad_words: strings need a tokenizer; pass token-id lists",
                                 "bad_words")
        else:
            text = w.lstrip()
            variants = [tuple(tokenizer.encode(v, add_special_tokens=False))
                        for v in (text, " " + text)]
        for v in variants:
            if v and v not in out:
                out.append(v)
    return tuple(out)


def stop_strings(req: SamplingFields) -> tuple[str, ...]:
    if req.stop is None:
        return ()
    return (req.stop,) if isinstance(req.stop, str) else tuple(req.stop)


def build_params(req: SamplingFields, max_tokens: int | None, prompt_len: int,
                 limits: ModelLimits, default_max_tokens: int | None,
                 prompt_param: str, max_tokens_param: str = "max_tokens",
                 tokenizer: Any = None) -> SamplingParams:
    """SamplingParams for one prompt of ``prompt_len`` tokens, or an InvalidRequest.

    ``max_tokens=None`` uses ``default_max_tokens`` (None: the rest of the context), clamped
    to what is left of the context so an unspecified length never fails.
    """
    check_request_limits(req, max_tokens, limits.requests, max_tokens_param)
    check_beam_fields(req)
    room = limits.max_sequence_tokens - prompt_len
    if max_tokens is None:
        if room < 1:
            raise _too_long(prompt_len, 1, limits, prompt_param, prompt_param)
        max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
        if limits.requests.max_tokens is not None:
            max_tokens = min(max_tokens, limits.requests.max_tokens)
    elif max_tokens > room:
        raise _too_long(prompt_len, max_tokens, limits, max_tokens_param, prompt_param)
    bias = logit_bias(req)
    bad_words = bad_words_ids(req, tokenizer)
    for name, ids in (("stop_token_ids", req.stop_token_ids or ()),
                      ("logit_bias", bias or ()),
                      ("bad_words", (t for w in bad_words for t in w)),
                      ("allowed_token_ids", req.allowed_token_ids or ())):
        for t in ids:
            if not 0 <= t < limits.vocab_size:
                raise InvalidRequest(f"{name}: token id {t} is outside the vocabulary "
                                     f"[0, {limits.vocab_size})", name)
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None else req.top_k,
            seed=req.seed,
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos,
            min_tokens=min(req.min_tokens, max_tokens),
            min_p=req.min_p or 0.0,
            top_n_sigma=req.top_n_sigma or 0.0,
            repetition_penalty=(1.0 if req.repetition_penalty is None
                                else req.repetition_penalty),
            repetition_penalty_window=req.repetition_penalty_window or 256,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            lz_penalty=req.lz_penalty or 0.0,
            dry_multiplier=req.dry_multiplier or 0.0,
            dry_base=1.75 if req.dry_base is None else req.dry_base,
            dry_allowed_length=2 if req.dry_allowed_length is None else req.dry_allowed_length,
            dry_sequence_breakers=(DRY_DEFAULT_BREAKERS if req.dry_sequence_breakers is None
                                   else tuple(req.dry_sequence_breakers)),
            logit_bias=bias,
            bad_words=bad_words,
            allowed_token_ids=(None if req.allowed_token_ids is None
                               else tuple(req.allowed_token_ids)),
            logprobs=requested_logprobs(req),
            prompt_logprobs=requested_prompt_logprobs(req),
            repetition_detection=repetition_detection(req),
            num_beams=req.num_beams,
            length_penalty=req.length_penalty,
            early_stopping=req.early_stopping,
            speculative=req.speculative,
            lora=getattr(req, "adapter", None),
            cache_salt=req.cache_salt,
        )
    except ValueError as e:
        raise from_value_error(e) from None


def check_beam_fields(req: SamplingFields) -> None:
    """Beam search returns its best beams at the end: no streaming, no per-token logprobs,
    no grammar, and at most num_beams choices."""
    _in_range("num_beams", req.num_beams, 1, MAX_BEAMS)
    if req.num_beams == 1:
        return
    if req.stream:
        raise InvalidRequest("stream: beam search (num_beams > 1) cannot stream; send "
                             "stream: false", "stream")
    if req.n > req.num_beams:
        raise InvalidRequest(f"n: must be <= num_beams ({req.num_beams}) with beam search, got "
                             f"{req.n}", "n")
    if requested_logprobs(req) is not None:
        raise InvalidRequest("logprobs: not available with beam search (num_beams > 1)",
                             "logprobs")
    for name in ("response_format", "structured_outputs", "guided_json", "guided_regex",
                 "guided_choice", "guided_grammar", "tools", "thinking_token_budget",
                 "max_thinking_tokens", "thinking_budget", "reasoning_effort"):
        value = getattr(req, name, None)
        if value is not None and not (name == "response_format" and value.type == "text"):
            raise InvalidRequest(f"{name}: not available with beam search (num_beams > 1)",
                                 name)


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice ``index`` of an n > 1 request: a seeded request's choices use seed + index, so
    they differ from each other and each is reproducible."""
    if index == 0 or params.seed is None:
        return params
    return dataclasses.replace(params, seed=params.seed + index)


def output_options(req: SamplingFields) -> OutputOptions:
    return OutputOptions(stop_strings(req), req.include_stop_str_in_output,
                         req.skip_special_tokens, req.min_tokens)


def check_request_limits(req: SamplingFields, max_tokens: int | None, lim: RequestLimits,
                         max_tokens_param: str = "max_tokens") -> None:
    """The operator's per-request limits (``met serve --max-n`` and friends)."""
    if req.n > lim.max_n:
        raise InvalidRequest(f"n: must be <= {lim.max_n} on this server (--max-n), got {req.n}",
                             "n")
    best_of = getattr(req, "best_of", None)
    if best_of is not None and best_of > lim.max_n:
        raise InvalidRequest(f"best_of: must be <= {lim.max_n} on this server (--max-n), got "
                             f"{best_of}", "best_of")
    if lim.max_tokens is not None and max_tokens is not None and max_tokens > lim.max_tokens:
        raise InvalidRequest(f"{max_tokens_param}: must be <= {lim.max_tokens} on this server "
                             f"(--max-tokens-limit), got {max_tokens}", max_tokens_param)
    stops = stop_strings(req)
    if len(stops) > lim.max_stop_strings:
        raise InvalidRequest(f"stop: at most {lim.max_stop_strings} stop strings on this server "
                             f"(--max-stop-strings), got {len(stops)}", "stop")
    for s in stops:
        if len(s) > lim.max_stop_string_chars:
            raise InvalidRequest(f"stop: each stop string must be at most "
                                 f"{lim.max_stop_string_chars} characters "
                                 f"(--max-stop-string-length), got {len(s)}", "stop")
    if req.logit_bias is not None and len(req.logit_bias) > lim.max_logit_bias:
        raise InvalidRequest(f"logit_bias: at most {lim.max_logit_bias} entries on this server "
                             f"(--max-logit-bias), got {len(req.logit_bias)}", "logit_bias")
    _check_tools(getattr(req, "tools", None), lim)


def _check_tools(tools: Any, lim: RequestLimits) -> None:
    """How many tools, and how big each one's definition is (its JSON schema is compiled
    into a grammar, whose cost grows with its size)."""
    if not tools:
        return
    if len(tools) > lim.max_tools:
        raise InvalidRequest(f"tools: at most {lim.max_tools} tools on this server "
                             f"(--max-tools), got {len(tools)}", "tools")
    for i, tool in enumerate(tools):
        raw = tool.model_dump(exclude_none=True) if hasattr(tool, "model_dump") else tool
        size = len(json.dumps(raw, ensure_ascii=False, default=str).encode())
        if size > lim.max_tool_schema_bytes:
            raise InvalidRequest(f"tools.{i}: the tool definition is {size} bytes of JSON, over "
                                 f"this server's {lim.max_tool_schema_bytes} "
                                 f"(--max-tool-schema-bytes)", f"tools.{i}")


def check_prompt_tokens(ids: list[int], limits: ModelLimits, param: str) -> None:
    if not ids:
        raise InvalidRequest(f"{param}: must contain at least one token", param)
    cap = limits.requests.max_prompt_tokens
    if cap is not None and len(ids) > cap:
        raise InvalidRequest(f"{param}: {len(ids)} tokens, over this server's limit of "
                             f"{cap} prompt tokens (--max-prompt-tokens)", param,
                             "context_length_exceeded")
    bad = [t for t in ids if not 0 <= t < limits.vocab_size]
    if bad:
        raise InvalidRequest(f"{param}: token ids {bad[:5]} are outside the vocabulary "
                             f"[0, {limits.vocab_size})", param)


def _in_range(name: str, value: float | int | None, lo: float, hi: float) -> None:
    if value is not None and not lo <= value <= hi:
        raise InvalidRequest(f"{name}: must be in [{lo:g}, {hi:g}], got {value}", name)


def _too_long(prompt_len: int, max_tokens: int, limits: ModelLimits, param: str,
              prompt_param: str) -> InvalidRequest:
    limit = limits.max_sequence_tokens
    what = (f"max_model_len ({limits.max_model_len})" if limit == limits.max_model_len
            else f"the KV cache ({limit} tokens)")
    return InvalidRequest(
        f"{param}: this model's maximum context length is {limit} tokens ({what}), but "
        f"{prompt_len + max_tokens} were requested ({prompt_len} in the {prompt_param}, "
        f"{max_tokens} to generate); shorten the {prompt_param} or lower max_tokens",
        param, "context_length_exceeded",
    )
