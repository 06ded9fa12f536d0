"""Per-request pooling parameters: a request with them is an embedding, not a generation.

They live beside SamplingParams (a request carries them in ``SamplingParams.pooling``) so
every layer that reads a request's parameters — scheduler, runner, engine, API — sees them
without a new message kind.
"""

from __future__ import annotations

from dataclasses import dataclass

from met.config import POOLING_TYPES

POOLING_KINDS = ("embed", "score")


@dataclass(frozen=True)
class PoolingParams:
    """How a prompt's final-norm hidden states become one vector.

    - pooling "last": the last prompt token's state (Qwen3-Embedding, e5-mistral); "mean":
      the mean over every prompt token's state.
    - dimensions: keep the first ``dimensions`` components (Matryoshka); with ``normalize``
      the truncated vector is scaled to unit L2 norm afterwards.
    - kind "score" (decoder rerankers, Qwen3-Reranker style): the vector is instead the
      softmax over the last prompt position's logits of ``token_ids`` only (e.g. (no, yes):
      its element 1 is the relevance score). Pooling is then always "last".
    """

    pooling: str = "last"
    normalize: bool = True
    dimensions: int | None = None
    kind: str = "embed"
    token_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.kind not in POOLING_KINDS:
            raise ValueError(f"kind: must be one of {', '.join(POOLING_KINDS)}, got "
                             f"{self.kind!r}")
        if self.kind == "score":
            ids = tuple(self.token_ids or ())
            if len(ids) < 2 or any(isinstance(t, bool) or not isinstance(t, int) or t < 0
                                   for t in ids):
                raise ValueError(f"token_ids: a score needs two or more token ids >= 0, got "
                                 f"{self.token_ids!r}")
            object.__setattr__(self, "token_ids", ids)
            if self.pooling != "last" or self.dimensions is not None:
                raise ValueError("pooling: a score reads the last position only (pooling "
                                 "'last', no dimensions)")
        elif self.token_ids is not None:
            raise ValueError("token_ids: only a kind 'score' request takes token_ids")
        if self.pooling not in POOLING_TYPES:
            raise ValueError(f"pooling: must be one of {', '.join(POOLING_TYPES)}, got "
                             f"{self.pooling!r}")
        if self.dimensions is not None and (isinstance(self.dimensions, bool)
                                            or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise ValueError(f"dimensions: must be an integer >= 1, got {self.dimensions!r}")
