"""Per-key token-bucket rate limits (``met serve --rate-limit-rpm / --rate-limit-tpm``).

A request is charged at admission: one request against the RPM bucket and its prompt tokens
plus ``max_tokens`` (times ``n``) against the TPM bucket. Buckets refill continuously at
limit/60 per second up to the limit; a request that does not fit gets 429 with the seconds
until it would fit in ``Retry-After``. Nothing is refunded when a request stops early, so a
client cannot exceed its limit by asking for much and cancelling.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from met.api.errors import ApiError
from met.serving.errors import InvalidRequest

# Keys whose buckets are full are forgotten (a full bucket is the same as a new one), at most
# this often, so a stream of distinct clients cannot grow the table without bound.
_PRUNE_EVERY_S = 60.0


@dataclass
class TokenBucket:
    """``capacity`` units, refilled at ``capacity / 60`` per second."""

    capacity: float
    level: float
    updated: float

    def refill(self, now: float) -> None:
        rate = self.capacity / 60.0
        self.level = min(self.capacity, self.level + (now - self.updated) * rate)
        self.updated = now

    def wait_for(self, amount: float) -> float:
        """Seconds until ``amount`` units are available (0: now)."""
        missing = amount - self.level
        return 0.0 if missing <= 0 else missing / (self.capacity / 60.0)


class RateLimiter:
    """Requests- and tokens-per-minute buckets per key (an API key, or the client address)."""

    def __init__(self, rpm: int | None, tpm: int | None,
                 clock: Callable[[], float] = time.monotonic):
        self.rpm = rpm
        self.tpm = tpm
        self._clock = clock
        self._buckets: dict[tuple[str, str], TokenBucket] = {}
        self._pruned = clock()

    @property
    def enabled(self) -> bool:
        return self.rpm is not None or self.tpm is not None

    def admit(self, key: str, tokens: int) -> None:
        """Charge one request of ``tokens`` tokens to ``key``, or raise 429 (400 when the
        request alone is over the per-minute token limit: waiting would never help)."""
        if not self.enabled:
            return
        now = self._clock()
        self._prune(now)
        if self.tpm is not None and tokens > self.tpm:
            raise InvalidRequest(
                f"max_tokens: this request needs {tokens} tokens (prompt + max_tokens, times n), "
                f"over this server's limit of {self.tpm} tokens per minute (--rate-limit-tpm); "
                f"lower max_tokens", "max_tokens", "rate_limit_exceeded")
        charges = [(kind, limit, amount) for kind, limit, amount in
                   (("requests", self.rpm, 1), ("tokens", self.tpm, tokens))
                   if limit is not None]
        buckets = []
        wait = 0.0
        for kind, limit, amount in charges:
            bucket = self._bucket(key, kind, limit, now)
            buckets.append((bucket, amount))
            wait = max(wait, bucket.wait_for(amount))
        if wait > 0:
            limits = ", ".join(f"{limit} {kind}" for kind, limit, _ in charges)
            raise ApiError(429, f"rate limit exceeded for this key ({limits} per minute); retry "
                           f"in {math.ceil(wait)} s", None, "rate_limit_exceeded",
                           {"Retry-After": str(max(1, math.ceil(wait)))})
        for bucket, amount in buckets:
            bucket.level -= amount

    def _bucket(self, key: str, kind: str, limit: int, now: float) -> TokenBucket:
        bucket = self._buckets.get((key, kind))
        if bucket is None:
            bucket = self._buckets[(key, kind)] = TokenBucket(float(limit), float(limit), now)
        bucket.refill(now)
        return bucket

    def _prune(self, now: float) -> None:
        if now - self._pruned < _PRUNE_EVERY_S:
            return
        self._pruned = now
        for k, bucket in list(self._buckets.items()):
            bucket.refill(now)
            if bucket.level >= bucket.capacity:
                del self._buckets[k]
