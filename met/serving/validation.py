"""Request fields → SamplingParams + output options, with 400s that name the field and range."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from met.sampling.params import SamplingParams
from met.serving.errors import InvalidRequest, from_value_error
from met.serving.protocol import SamplingFields

MAX_N = 128
_MAX_SEED = 2**63 - 1
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass(frozen=True)
class ModelLimits:
    """What the loaded engine can hold; fixed once the model is loaded."""

    max_model_len: int
    vocab_size: int
    block_size: int
    num_kv_blocks: int

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


def stop_strings(req: SamplingFields) -> tuple[str, ...]:
    if req.stop is None:
        return ()
    return (req.stop,) if isinstance(req.stop, str) else tuple(req.stop)


def build_params(req: SamplingFields, max_tokens: int | None, prompt_len: int,
                 limits: ModelLimits, default_max_tokens: int | None,
                 prompt_param: str, max_tokens_param: str = "max_tokens") -> SamplingParams:
    """SamplingParams for one prompt of ``prompt_len`` tokens, or an InvalidRequest.

    ``max_tokens=None`` uses ``default_max_tokens`` (None: the rest of the context), clamped
    to what is left of the context so an unspecified length never fails.
    """
    room = limits.max_sequence_tokens - prompt_len
    if max_tokens is None:
        if room < 1:
            raise _too_long(prompt_len, 1, limits, prompt_param, prompt_param)
        max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
    elif max_tokens > room:
        raise _too_long(prompt_len, max_tokens, limits, max_tokens_param, prompt_param)
    for t in req.stop_token_ids or ():
        if not 0 <= t < limits.vocab_size:
            raise InvalidRequest(f"stop_token_ids: {t} is outside the vocabulary "
                                 f"[0, {limits.vocab_size})", "stop_token_ids")
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
        )
    except ValueError as e:
        raise from_value_error(e) from None


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice ``index`` of an n > 1 request: a seeded request's choices use seed + index, so
    they differ from each other and each is reproducible."""
    if index == 0 or params.seed is None:
        return params
    return dataclasses.replace(params, seed=params.seed + index)


def output_options(req: SamplingFields) -> OutputOptions:
    return OutputOptions(stop_strings(req), req.include_stop_str_in_output,
                         req.skip_special_tokens, req.min_tokens)


def check_prompt_tokens(ids: list[int], limits: ModelLimits, param: str) -> None:
    if not ids:
        raise InvalidRequest(f"{param}: must contain at least one token", param)
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
