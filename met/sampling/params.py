"""Per-request sampling parameters (vLLM's names and defaults)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from met.sampling.pooling import PoolingParams
from met.sampling.thinking import ThinkingBudget

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0
DRY_DEFAULT_BREAKERS: tuple[str, ...] = ("\n", ":", "\"", "*")


@dataclass(frozen=True)
class RepetitionDetection:
    """Stop a generation whose output ends in one pattern repeated ``min_count`` times in a
    row, for any pattern length in ``[min_pattern_size, max_pattern_size]`` tokens."""

    min_pattern_size: int = 1
    max_pattern_size: int = 32
    min_count: int = 4

    def __post_init__(self) -> None:
        name = "repetition_detection"
        if self.min_pattern_size < 1:
            raise ValueError(f"{name}.min_pattern_size: must be >= 1, got "
                             f"{self.min_pattern_size}")
        if self.max_pattern_size < self.min_pattern_size:
            raise ValueError(f"{name}.max_pattern_size: must be >= min_pattern_size "
                             f"({self.min_pattern_size}), got {self.max_pattern_size}")
        if self.min_count < 2:
            raise ValueError(f"{name}.min_count: must be >= 2, got {self.min_count}")

    def matches(self, tokens: Sequence[int], start: int = 0) -> bool:
        """Whether ``tokens[start:]`` ends in a repeated pattern. Only the last
        ``max_pattern_size × min_count`` tokens are read (no copy), and a pattern length is
        dropped at its first mismatch, so text that does not repeat costs about one comparison
        per pattern length."""
        n = len(tokens)
        for size in range(self.min_pattern_size, self.max_pattern_size + 1):
            span = size * self.min_count
            if span > n - start:
                break
            # The tail is `pattern × min_count` iff each of its tokens equals the one `size`
            # positions later.
            if all(tokens[i] == tokens[i + size] for i in range(n - span, n - size)):
                return True
        return False


@dataclass(frozen=True)
class StructuredOutputs:
    """Constrain the output to a grammar: set exactly one field.

    - json: a JSON schema (a mapping or its JSON text); json_object: any JSON object;
    - regex: a regular expression the whole output matches;
    - choice: the output is exactly one of these strings;
    - grammar: an EBNF grammar (GBNF style, with a ``root`` rule);
    - structural_tag: xgrammar's structural-tag spec (a mapping or its JSON text): free text
      until a trigger string, then the tagged part held to its schema (tool calls).
    Mappings are stored as canonical JSON text, so equal specs compare and hash equal (the
    compiled-grammar cache key is ``(kind, spec)``).
    """

    json: str | Mapping[str, Any] | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    structural_tag: str | Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        for name in ("json", "structural_tag"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                object.__setattr__(self, name, json.dumps(value, sort_keys=True))
        if self.choice is not None:
            choice = tuple(self.choice)
            if not choice or not all(isinstance(c, str) for c in choice):
                raise ValueError("structured_outputs.choice: must be a non-empty list of strings")
            object.__setattr__(self, "choice", choice)
        set_fields = [n for n in ("json", "regex", "choice", "grammar", "structural_tag")
                      if getattr(self, n) is not None] + (["json_object"] if self.json_object
                                                          else [])
        if len(set_fields) != 1:
            raise ValueError("structured_outputs: set exactly one of json, json_object, regex, "
                             f"choice, grammar, structural_tag (got {set_fields or 'none'})")

    @property
    def kind(self) -> str:
        if self.json_object:
            return "json_object"
        return next(n for n in ("json", "regex", "choice", "grammar", "structural_tag")
                    if getattr(self, n) is not None)

    @property
    def spec(self) -> str:
        """The spec as text (choices joined as a JSON list)."""
        if self.json_object:
            return ""
        if self.choice is not None:
            return json.dumps(list(self.choice))
        return getattr(self, self.kind)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token, and when to stop.

    Order of the logit edits: min_tokens masking → repetition / presence / frequency
    penalties → bad_words and allowed_token_ids masks → logit_bias; then, for sampled rows,
    top_n_sigma → temperature → top_k → min_p → top_p → sample. Greedy rows (temperature 0)
    take the argmax of the edited logits.

    - temperature 0 means greedy. top_k 0 or -1 disables top-k. min_p 0, top_n_sigma 0 and
      top_p 1 are off.
    - repetition_penalty (> 0, 1 = off) divides positive / multiplies negative logits of every
      token seen in the last ``repetition_penalty_window`` tokens, prompt included.
    - presence_penalty / frequency_penalty (−2..2) subtract ``presence`` once and
      ``frequency × count`` for each token already generated (output tokens only, as OpenAI).
    - lz_penalty (>= 0): for n = 3, 4, 5, the n-gram "last n−1 tokens + candidate" that
      already occurs ``count`` times in the last 256 tokens costs the candidate
      ``lz_penalty · (n − 2) · count``.
    - DRY (dry_multiplier > 0 turns it on): a candidate that would extend a repeat of the
      last ``m >= dry_allowed_length`` tokens costs ``dry_multiplier · dry_base^(m −
      dry_allowed_length)``; matches never cross a sequence breaker (strings, each meaning
      the last token of its tokenization, or token ids).
    - logit_bias {token id: bias in [−100, 100]} is added last, after the penalties.
    - bad_words: token-id sequences that are never completed in the output.
    - allowed_token_ids: only these tokens can be generated.
    - A request with a seed draws from its own generator, so its output never depends on its
      batch mates.
    - repetition_detection: once ``min_tokens`` are out, an output that ends in one pattern
      (``min_pattern_size``..``max_pattern_size`` tokens) repeated ``min_count`` times in a
      row finishes with finish_reason "length" and stop_reason "repetition". A mapping with
      those keys is accepted.
    - num_beams > 1 runs beam search instead of sampling (transformers' rules, so the
      output equals ``generate(num_beams=…)``): scores are sums of raw logprobs, finished
      hypotheses are ranked by ``score / generated_len ** length_penalty``, and
      ``early_stopping`` (true / false / "never") decides when to stop. Temperature, filters,
      penalties and seeds do not apply to it; ``n`` best beams come back (n <= num_beams).
    - thinking_budget (a ``ThinkingBudget``): the engine ends a reasoning model's thinking
      after ``budget`` tokens (at a sentence end within ``grace_tokens``, never inside a code
      fence) by forcing the end marker; a grammar applies only after the thinking ends.
    - logprobs=k returns the chosen token's logprob plus the k most likely tokens' of the
      **raw model distribution** (log-softmax of the model's logits, before any penalty,
      mask, bias, temperature or filter).
    - prompt_logprobs=k gives, for each prompt token after the first, its logprob given the
      tokens before it plus the k most likely tokens there (raw distribution; the first
      token has None). Such a request skips the prefix cache, so that every prompt position
      is computed.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    top_n_sigma: float = 0.0
    repetition_penalty: float = 1.0
    repetition_penalty_window: int = 256
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    lz_penalty: float = 0.0
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_sequence_breakers: tuple[str | int, ...] = DRY_DEFAULT_BREAKERS
    logit_bias: Mapping[int, float] | tuple[tuple[int, float], ...] | None = None
    bad_words: tuple[tuple[int, ...], ...] = field(default_factory=tuple)
    allowed_token_ids: tuple[int, ...] | None = None
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    repetition_detection: RepetitionDetection | Mapping[str, int] | None = None
    structured_outputs: StructuredOutputs | None = None
    num_beams: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    thinking_budget: ThinkingBudget | None = None
    # False: this request never speculates (where the engine runs with a speculative config).
    speculative: bool = True
    # The LoRA adapter this request runs under (a name the engine has loaded); None: the base.
    lora: str | None = None
    # Set: the request is an embedding (met.sampling.pooling): its prompt runs, no token is
    # sampled, and it finishes with the pooled vector.
    pooling: PoolingParams | None = None
    # Mixed into the prefix-cache hashes of this request's blocks: requests with different
    # salts never share KV (vLLM's cache_salt).
    cache_salt: str | None = None
    # Output handling above the engine (the server's request fields, honoured by met.LLM;
    # the engine never reads them): ``n`` completions per prompt (seeded: seed + index),
    # of ``best_of`` candidates ranked by cumulative logprob; ``stop`` strings end a
    # completion and are cut from its text unless include_stop_str_in_output.
    n: int = 1
    best_of: int | None = None
    stop: tuple[str, ...] | str = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens: must be >= 1, got {self.max_tokens}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature: must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k: must be -1, 0 (off) or a positive integer, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p: must be in [0, 1], got {self.min_p}")
        if not (self.top_n_sigma >= 0 and math.isfinite(self.top_n_sigma)):
            raise ValueError(f"top_n_sigma: must be >= 0 (0 = off), got {self.top_n_sigma}")
        if not (self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty)):
            raise ValueError(
                f"repetition_penalty: must be > 0 (1 = off), got {self.repetition_penalty}")
        if self.repetition_penalty_window < 1:
            raise ValueError(f"repetition_penalty_window: must be >= 1, got "
                             f"{self.repetition_penalty_window}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name}: must be in [-2, 2], got {value}")
        if not (self.lz_penalty >= 0 and math.isfinite(self.lz_penalty)):
            raise ValueError(f"lz_penalty: must be >= 0 (0 = off), got {self.lz_penalty}")
        if not (self.dry_multiplier >= 0 and math.isfinite(self.dry_multiplier)):
            raise ValueError(f"dry_multiplier: must be >= 0 (0 = off), got {self.dry_multiplier}")
        if not (self.dry_base > 1 and math.isfinite(self.dry_base)):
            raise ValueError(f"dry_base: must be > 1, got {self.dry_base}")
        if self.dry_allowed_length < 1:
            raise ValueError(f"dry_allowed_length: must be >= 1, got {self.dry_allowed_length}")
        object.__setattr__(self, "dry_sequence_breakers", tuple(self.dry_sequence_breakers))
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens: must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        # The HTTP API caps logprobs at MAX_LOGPROBS; in-process callers (beam search) may
        # ask for more.
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs: must be >= 0, got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs: must be in [0, {MAX_LOGPROBS}], got "
                             f"{self.prompt_logprobs}")
        if self.n < 1:
            raise ValueError(f"n: must be >= 1, got {self.n}")
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of: must be >= n ({self.n}), got {self.best_of}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError("stop: stop strings must be non-empty strings")
        object.__setattr__(self, "stop", stop)
        if self.num_beams < 1:
            raise ValueError(f"num_beams: must be >= 1 (1 = no beam search), got "
                             f"{self.num_beams}")
        if not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty: must be a finite number, got "
                             f"{self.length_penalty}")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping: must be true, false or \"never\", got "
                             f"{self.early_stopping!r}")
        rd = self.repetition_detection
        if isinstance(rd, Mapping):
            unknown = set(rd) - {"min_pattern_size", "max_pattern_size", "min_count"}
            if unknown:
                raise ValueError(f"repetition_detection: unknown keys {sorted(unknown)}; "
                                 f"expected min_pattern_size, max_pattern_size, min_count")
            object.__setattr__(self, "repetition_detection", RepetitionDetection(**rd))
        elif rd is not None and not isinstance(rd, RepetitionDetection):
            raise ValueError(f"repetition_detection: must be a RepetitionDetection, a mapping "
                             f"or None, got {type(rd).__name__}")
        # Accept any iterable / mapping from callers, store immutable (hashable) values.
        object.__setattr__(self, "stop_token_ids", _token_ids("stop_token_ids",
                                                              self.stop_token_ids))
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        words = tuple(_token_ids("bad_words", w) for w in self.bad_words)
        if any(not w for w in words):
            raise ValueError("bad_words: each entry must be a non-empty token-id sequence")
        object.__setattr__(self, "bad_words", words)
        if self.allowed_token_ids is not None:
            allowed = _token_ids("allowed_token_ids", self.allowed_token_ids)
            if not allowed:
                raise ValueError("allowed_token_ids: must name at least one token id")
            object.__setattr__(self, "allowed_token_ids", allowed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def max_token_id(self) -> int:
        """The largest token id any parameter names (-1 when none): checked against the vocab."""
        ids = [*self.stop_token_ids, *(t for t, _ in self.logit_bias or ()),
               *(t for w in self.bad_words for t in w), *(self.allowed_token_ids or ()),
               *(self.pooling.token_ids or () if self.pooling is not None else ())]
        return max(ids, default=-1)


def _token_ids(name: str, ids: Iterable[int]) -> tuple[int, ...]:
    out = tuple(int(t) for t in ids)
    if any(t < 0 for t in out):
        raise ValueError(f"{name}: token ids must be >= 0, got {[t for t in out if t < 0][:5]}")
    return out


def _logit_bias(bias: Mapping[int, float] | Iterable[tuple[int, float]] | None
                ) -> tuple[tuple[int, float], ...] | None:
    if bias is None:
        return None
    items = bias.items() if isinstance(bias, Mapping) else bias
    out = tuple(sorted((int(t), float(b)) for t, b in items))
    for t, b in out:
        if t < 0:
            raise ValueError(f"logit_bias: token ids must be >= 0, got {t}")
        if not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias: biases must be in [-100, 100], got {b} for token {t}")
    return out or None
