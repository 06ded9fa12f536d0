"""AsyncEngine hands each step's outputs to the event loop before it starts the next step:
the loop's consumers have already taken step n's tokens when step n + 1 begins (so the loop's
work and the step's threads do not share the cores), and a loop that does not answer delays
a step by at most the hand-over wait."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from met.engine import async_engine
from met.engine.async_engine import AsyncEngine, OutputStream
from met.engine.core import RequestUpdate
from met.sampling.params import SamplingParams

STEPS = 6


class _CountingCore:
    """Stands in for EngineCore: one token per step for one request, finished after STEPS;
    each step records how many items the consumer had received when it began."""

    kernel_labels = ()  # EngineCore's kernel-plan labels (none here)
    weight_bytes = kv_pool_bytes = kv_pool_tokens = 0  # what EngineCore reports of its memory
    kv_stored = "float32"
    spec = None  # speculative decoding off

    def __init__(self, received: list):
        self.received = received
        self.requests: dict[str, int] = {}
        self.scheduler = SimpleNamespace(running=[], waiting=[], num_preemptions=0)
        self.seen_at_step: list[int] = []

    def kv_stats(self):
        return None

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def add_request(self, request_id, prompt_token_ids, params) -> None:
        self.requests[request_id] = 0

    def abort_request(self, request_id) -> None:
        self.requests.pop(request_id, None)

    def step(self) -> list[RequestUpdate]:
        self.seen_at_step.append(len(self.received))
        updates = []
        for rid in list(self.requests):
            n = self.requests[rid] = self.requests[rid] + 1
            done = n == STEPS
            updates.append(RequestUpdate(rid, [n], [], done, "length" if done else None, None,
                                         0))
            if done:
                del self.requests[rid]
        return updates


async def _consume(engine: AsyncEngine, received: list) -> None:
    engine.start()
    await engine.wait_ready()
    stream = OutputStream()
    engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=STEPS), stream)
    while True:
        item = await stream.get(timeout=30)
        received.append(item.new_token_ids[0])
        if item.finished:
            break
    await engine.shutdown()


def test_each_step_starts_after_the_loop_took_the_previous_ones_tokens(monkeypatch):
    monkeypatch.setattr(async_engine, "_HANDOVER_WAIT_S", 30.0)  # no timing in the assertion
    received: list[int] = []
    core = _CountingCore(received)
    asyncio.run(_consume(AsyncEngine(lambda: core), received))
    assert received == list(range(1, STEPS + 1))
    assert core.seen_at_step == list(range(STEPS))


def test_a_loop_that_does_not_answer_delays_a_step_by_the_wait_only(monkeypatch):
    """The loop is blocked (a long synchronous handler) while the steps run: the engine still
    steps on after each wait, and the consumer then gets every token in order."""
    monkeypatch.setattr(async_engine, "_HANDOVER_WAIT_S", 0.05)
    received: list[int] = []
    core = _CountingCore(received)
    engine = AsyncEngine(lambda: core)

    async def run() -> float:
        engine.start()
        await engine.wait_ready()
        stream = OutputStream()
        engine.add_request("r", [1], SamplingParams(max_tokens=STEPS), stream)
        start = time.perf_counter()
        while len(core.seen_at_step) < STEPS and time.perf_counter() - start < 10:
            time.sleep(0.001)  # blocks the loop: nothing is handed over meanwhile
        blocked_for = time.perf_counter() - start
        while not received or received[-1] != STEPS:
            received.append((await stream.get(timeout=10)).new_token_ids[0])
        await engine.shutdown()
        return blocked_for

    blocked_for = asyncio.run(run())
    assert core.seen_at_step == [0] * STEPS  # every step ran while the loop was blocked
    assert received == list(range(1, STEPS + 1))
    assert blocked_for < 5  # ~ (STEPS - 1) waits of 0.05 s, not stuck
