"""Per-request pooling parameters: a request with them is an embedding, not a generation.

They live beside SamplingParams (a request carries them in ``SamplingParams.pooling``) so
every layer that reads a request's parameters — scheduler, runner, engine, API — sees them
without a new message kind.
"""

from __future__ import annotations

from dataclasses import dataclass

from met.config import POOLING_TYPES


@dataclass(frozen=True)
class PoolingParams:
    """How a prompt's final-norm hidden states become one vector.

    - pooling "last": the last prompt token's state (Qwen3-Embedding, e5-mistral); "mean":
      the mean over every prompt token's state.
    - dimensions: keep the first ``dimensions`` components (Matryoshka); with ``normalize``
      the truncated vector is scaled to unit L2 norm afterwards.
    """

    pooling: str = "last"
    normalize: bool = True
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.pooling not in POOLING_TYPES:
            raise ValueError(f"pooling: must be one of {', '.join(POOLING_TYPES)}, got "
                             f"{self.pooling!r}")
        if self.dimensions is not None and (isinstance(self.dimensions, bool)
                                            or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise ValueError(f"dimensions: must be an integer >= 1, got {self.dimensions!r}")
