"""Whether speculation pays at this batch width: delivered tok/s measured in windows of steps
with it on and with it off, per batch-width bucket (1, 2-3, 4-7, ...). The better mode runs;
the other is measured again now and then (less often each time a probe loses), so
speculation turns itself off where it is slower (wide batches, text that does not repeat)
and back on when it pays again."""

from __future__ import annotations

from dataclasses import dataclass, field

WINDOW_STEPS = 16  # steps per measurement window
EXPLOIT_WINDOWS = 8  # windows of the better mode between two probes of the other
MAX_EXPLOIT_WINDOWS = 64  # each probe that loses doubles the wait, up to this
_SMOOTH = 0.5  # weight of the newest window in a mode's running tok/s


@dataclass
class _Bucket:
    rate: dict[bool, float | None] = field(default_factory=lambda: {True: None, False: None})
    mode: bool = True  # what the current window runs
    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0
    since_probe: int = 0  # windows since the other mode was last measured
    probe_every: int = EXPLOIT_WINDOWS  # windows of the better mode before the next probe
    probing: bool = False  # the current window measures the worse mode again


class ThroughputGate:
    """``on(width)`` before a step; ``record(width, tokens, seconds)`` after it."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self._buckets: dict[int, _Bucket] = {}

    @staticmethod
    def bucket(width: int) -> int:
        return max(1, width).bit_length()

    def on(self, width: int) -> bool:
        if not self.enabled:
            return True
        return self._buckets.setdefault(self.bucket(width), _Bucket()).mode

    def rates(self) -> dict[int, dict[bool, float | None]]:
        """tok/s per bucket (lowest width of it) and mode, as measured so far."""
        return {1 << (b - 1): dict(s.rate) for b, s in sorted(self._buckets.items())}

    def record(self, width: int, tokens: int, seconds: float) -> None:
        if not self.enabled:
            return
        b = self._buckets.setdefault(self.bucket(width), _Bucket())
        b.steps += 1
        b.tokens += tokens
        b.seconds += seconds
        if b.steps < WINDOW_STEPS:
            return
        rate = b.tokens / b.seconds if b.seconds > 0 else 0.0
        old = b.rate[b.mode]
        b.rate[b.mode] = rate if old is None else _SMOOTH * rate + (1 - _SMOOTH) * old
        b.steps, b.tokens, b.seconds = 0, 0, 0.0
        on, off = b.rate[True], b.rate[False]
        if on is None or off is None:  # measure both modes first
            b.mode = on is None
            return
        best = on >= off
        b.since_probe += 1
        if b.probing:  # a probe ended: wait longer for the next if it lost, else reset
            b.probing = False
            b.probe_every = (min(2 * b.probe_every, MAX_EXPLOIT_WINDOWS) if b.mode != best
                             else EXPLOIT_WINDOWS)
        if b.mode != best:  # back to the better mode
            b.mode, b.since_probe = best, 0
        elif b.since_probe >= b.probe_every:
            b.mode, b.since_probe, b.probing = not best, 0, True
