"""Per-request sampling parameters (vLLM's names and defaults)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token, and when to stop.

    temperature 0 means greedy. top_k 0 or -1 disables top-k. A request with a seed
    draws from its own generator, so its output never depends on its batch mates.
    logprobs=None returns none; logprobs=k returns the chosen token's logprob plus the
    k most likely tokens' (of the raw model distribution, before temperature/top-k/top-p).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens: must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature: must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k: must be -1, 0 (off) or a positive integer, got {self.top_k}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens: must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs: must be in [0, 20], got {self.logprobs}")
        # Accept any iterable of ints from callers, store an immutable tuple.
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
