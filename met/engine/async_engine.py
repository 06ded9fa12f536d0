"""AsyncEngine: EngineCore in its own thread, an asyncio front that only posts messages.

The engine thread is the single owner of the EngineCore. The asyncio side never touches it:
it posts typed messages (``_Add``, ``_Abort``, ``_Sleep``, ``_WakeUp``, ``_ResetPrefixCache``,
``_Shutdown``) into a thread-safe inbox and
reads each request's output from an ``OutputStream`` that the engine thread feeds through
``loop.call_soon_threadsafe``. Between two steps the thread drains the whole inbox, so an
abort (a client that went away) takes effect before the next step and frees its KV blocks.

Sleep: level 1 frees the KV pool (the weights stay loaded); level 2 also drops the whole
core, weights included, and wake rebuilds it with ``core_factory`` (the weights are read
again from the model's path). Sleep is refused (``EngineBusy``) while any request is in
flight: nothing is drained or cut short.

Faults: a request that fails to be added fails alone. A step that raises faults the engine
(``state`` faulted, ``fault_reason`` set): every stream gets a ``RequestFailed`` and new
requests are refused, since a half-applied step leaves the core in no state to go on.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from met.cache.kv_manager import KVStats
from met.engine.core import EngineCore, RequestUpdate
from met.sampling.params import SamplingParams
from met.spec.decoder import SpecStats

log = logging.getLogger(__name__)

# How long the engine thread waits for messages when a step produced nothing (e.g. a
# non-final prefill chunk or a request that cannot be admitted yet): short, so it never
# delays work, long enough not to spin a core.
_IDLE_POLL_S = 0.001
# The longest the engine thread waits for the loop to take a step's outputs (`_post`) before
# it goes on anyway: a busy loop delays the next step by at most this.
_HANDOVER_WAIT_S = 0.005


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _Shutdown:
    pass


@dataclass(frozen=True)
class _Sleep:
    level: int
    reply: concurrent.futures.Future


@dataclass(frozen=True)
class _WakeUp:
    reply: concurrent.futures.Future


@dataclass(frozen=True)
class _ResetPrefixCache:
    reply: concurrent.futures.Future


class EngineBusy(Exception):
    """The engine cannot do that now (sleep while requests run): the API's 409."""


SLEEP_LEVELS = (1, 2)


@dataclass(frozen=True)
class RequestFailed:
    """Delivered on a request's stream instead of an update when the engine could not serve it."""

    request_id: str
    message: str
    is_client_error: bool  # True: the request itself was invalid (a 400), else an engine fault


@dataclass(frozen=True)
class EngineStats:
    """A snapshot the engine thread publishes after every inbox drain and every step."""

    num_running: int
    num_waiting: int
    num_preemptions: int
    kv: KVStats | None
    # The kernel plan's labels (linear method, attention backend, CPU ISA), fixed at load.
    kernels: tuple[tuple[str, str], ...] = ()
    weight_bytes: int = 0  # what the model's weights take (EngineCore.weight_bytes)
    kv_pool_bytes: int = 0  # what the KV pool takes
    kv_pool_tokens: int = 0  # the tokens it holds (blocks x block size)
    kv_cache_dtype: str = ""  # the element type the cache stores (EngineCore.kv_stored)
    spec: SpecStats | None = None  # speculative decoding's totals; None: it is off


StreamItem = RequestUpdate | RequestFailed


class OutputStream:
    """The outputs of one or more engine requests (an HTTP request's choices), in order."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[StreamItem] = asyncio.Queue()

    def put(self, item: StreamItem) -> None:
        self._queue.put_nowait(item)

    async def get(self, timeout: float | None = None) -> StreamItem:
        """Next item; raises TimeoutError after ``timeout`` seconds (None: wait forever)."""
        # Not asyncio.wait_for: on Python 3.11 it swallows a cancellation (a client that
        # disconnected) when an item arrives in the same loop iteration, and the request
        # would then run to the end instead of being aborted.
        async with asyncio.timeout(None if timeout is None else max(timeout, 0.0)):
            return await self._queue.get()


class EngineState:
    LOADING = "loading"
    READY = "ready"
    FAULTED = "faulted"
    STOPPED = "stopped"
    SLEEPING = "sleeping"  # POST /sleep: KV (and at level 2 the weights) freed; /wake_up


class AsyncEngine:
    """Runs an EngineCore (built by ``core_factory`` in the engine thread) beside asyncio.

    Call ``start()`` from the event loop; ``add_request``/``abort_request`` from the same loop.
    ``state`` is loading until the core is built, then ready (or faulted, with ``fault_reason``).
    """

    def __init__(self, core_factory: Callable[[], EngineCore]):
        self._core_factory = core_factory
        self._runtime_adapters: dict[str, str] = {}  # name -> path, kept over a level-2 sleep
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, OutputStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = asyncio.Event()
        self._handed_over = threading.Event()  # set by the loop once a step's items are out
        self.state = EngineState.LOADING
        self.fault_reason: str | None = None
        self.core: EngineCore | None = None  # read-only from the loop: immutable config only
        self.stats = EngineStats(0, 0, 0, None)
        self.load_seconds: float | None = None
        self.sleep_level: int | None = None  # while sleeping: 1 (KV freed) or 2 (weights too)

    # ------------------------------------------------------------------ asyncio side

    def start(self) -> None:
        """Start the engine thread; it builds the core, then serves messages until shutdown."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="met-engine", daemon=True)
        self._thread.start()

    async def wait_ready(self) -> None:
        """Return once the core is built (or the load failed: check ``state``)."""
        await self._ready.wait()

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    stream: OutputStream) -> None:
        """Queue a request whose updates go to ``stream``. Validate before calling this.
        When the engine faulted or stopped in the meantime, the stream gets the failure
        (the client an error naming the reason), as every request in flight did."""
        if self.state in (EngineState.FAULTED, EngineState.STOPPED):
            why = (f"engine faulted: {self.fault_reason}" if self.state == EngineState.FAULTED
                   else "the server is shutting down")
            stream.put(RequestFailed(request_id, why, False))
            return
        if self.state == EngineState.SLEEPING:  # slept between the route's check and here
            stream.put(RequestFailed(request_id, "the engine is sleeping (POST /wake_up)",
                                     False))
            return
        if self.state != EngineState.READY:
            raise RuntimeError(f"engine is {self.state}")
        if request_id in self._streams:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        self._streams[request_id] = stream
        self._inbox.put(_Add(request_id, list(prompt_token_ids), params))

    async def sleep(self, level: int = 1) -> bool:
        """Free the KV pool (level 1) or the KV pool and the weights (level 2); False if it
        already sleeps. Raises EngineBusy while requests are in flight (none is cut short),
        RuntimeError when the engine is not ready."""
        if level not in SLEEP_LEVELS:
            raise ValueError(f"level: must be 1 or 2, got {level}")
        if self.state == EngineState.SLEEPING:
            return False
        if self.state != EngineState.READY:
            raise RuntimeError(f"the engine is {self.state}")
        if self._streams:
            raise EngineBusy(f"{len(self._streams)} requests are running; sleep once they "
                             "finish")
        # From here no request is added (they get a 503); one posted before this line is
        # in the inbox ahead of _Sleep, so the engine thread sees it and refuses.
        self.state = EngineState.SLEEPING
        reply: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(_Sleep(level, reply))
        try:
            await asyncio.wrap_future(reply)
        except BaseException:
            if self.state == EngineState.SLEEPING:
                self.state = EngineState.READY
            raise
        self.sleep_level = level
        return True

    async def wake_up(self) -> bool:
        """Reallocate what ``sleep`` freed (level 2: reload the weights); False if it was
        awake. A reload that fails faults the engine (``fault_reason`` says why)."""
        if self.state != EngineState.SLEEPING:
            if self.state == EngineState.READY:
                return False
            raise RuntimeError(f"the engine is {self.state}")
        reply: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(_WakeUp(reply))
        await asyncio.wrap_future(reply)
        self.sleep_level = None
        self.state = EngineState.READY
        return True

    async def reset_prefix_cache(self) -> int:
        """Forget every cached block no request holds (the engine thread does it between
        two steps); how many blocks were forgotten."""
        if self.state not in (EngineState.READY, EngineState.SLEEPING):
            raise RuntimeError(f"the engine is {self.state}")
        reply: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(_ResetPrefixCache(reply))
        return await asyncio.wrap_future(reply)

    def abort_request(self, request_id: str) -> None:
        """Stop a request; its stream gets nothing more. Unknown or finished ids are ignored."""
        if self._streams.pop(request_id, None) is not None:
            self._inbox.put(_Abort(request_id))

    def has_request(self, request_id: str) -> bool:
        """Whether ``request_id`` was added and has not yet finished, failed or been aborted."""
        return request_id in self._streams

    def fail_all(self, message: str) -> int:
        """End every in-flight request with ``message`` (its client gets an error) and abort
        it in the engine; returns how many there were. Used when a drain runs out of time."""
        rids = list(self._streams)
        self._deliver([RequestFailed(rid, message, False) for rid in rids])
        for rid in rids:
            self._inbox.put(_Abort(rid))
        return len(rids)

    @property
    def num_in_flight(self) -> int:
        """Requests (choices) added and not yet finished or aborted, as the loop sees them."""
        return len(self._streams)

    async def shutdown(self) -> None:
        """Abort what is left, stop the engine thread and wait for it."""
        self._deliver([RequestFailed(rid, "the server is shutting down", False)
                       for rid in list(self._streams)])
        self._inbox.put(_Shutdown())
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30.0)
        if self.state != EngineState.FAULTED:
            self.state = EngineState.STOPPED

    def _deliver(self, items: list[StreamItem]) -> None:
        for item in items:
            stream = self._streams.get(item.request_id)
            if stream is None:
                continue  # aborted: drop what was produced in the step that raced the abort
            if isinstance(item, RequestFailed) or item.finished:
                del self._streams[item.request_id]
            stream.put(item)

    def _set_ready(self) -> None:
        self._ready.set()

    def _post(self, items: list[StreamItem]) -> None:
        """Hand ``items`` to the loop and wait (at most _HANDOVER_WAIT_S) until the tasks
        they woke have run: the next step's threads then do not share the cores with the
        loop's formatting and writing, which, overlapped, stretched every step (1 stream:
        TPOT 6.3-6.7 → 5.7-5.9 ms on 2 cores)."""
        if items and self._loop is not None and not self._loop.is_closed():
            self._handed_over.clear()
            self._loop.call_soon_threadsafe(self._deliver_then_signal, items)
            self._handed_over.wait(_HANDOVER_WAIT_S)

    def _deliver_then_signal(self, items: list[StreamItem]) -> None:
        try:
            self._deliver(items)
        finally:
            # Queued after the wake-ups of the tasks the items woke (the ready queue is FIFO):
            # it runs once each of them has taken its turn.
            self._loop.call_soon(self._handed_over.set)

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        start = time.perf_counter()
        try:
            core = self._core_factory()
            self._publish(core)
        except BaseException as e:  # any load failure becomes the fault reason
            log.exception("model load failed")
            self.fault_reason = f"model load failed: {e}"
            self.state = EngineState.FAULTED
            self._call_loop(self._set_ready)
            return
        self.core = core
        del core  # level-2 sleep drops the core: no frame may keep it (and its weights)
        self.load_seconds = time.perf_counter() - start
        self.state = EngineState.READY
        self._call_loop(self._set_ready)
        try:
            self._serve()
        except BaseException as e:  # the loop itself broke: fault every request
            log.exception("engine loop crashed")
            self.fault_reason = f"engine loop crashed: {e}"
            self.state = EngineState.FAULTED
            self._call_loop(self._fail_all_streams)

    def _call_loop(self, fn: Callable[[], None]) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(fn)

    def _fail_all_streams(self) -> None:
        self._deliver([RequestFailed(rid, f"engine faulted: {self.fault_reason}", False)
                       for rid in list(self._streams)])

    def _serve(self) -> None:
        stalled = False  # the last step produced nothing (a prefill chunk, or no room yet)
        while True:
            core = self.core  # None while asleep at level 2
            if core is None or not core.has_unfinished():
                wait: float | None = None  # idle: sleep until a message comes
            else:
                wait = _IDLE_POLL_S if stalled else 0.0
            failed: list[StreamItem] = []
            for msg in self._drain(wait):
                if isinstance(msg, _Shutdown):
                    if core is not None:
                        for rid in list(core.requests):
                            core.abort_request(rid)
                        self._publish(core)
                    return
                if isinstance(msg, _Sleep | _WakeUp | _ResetPrefixCache):
                    self._control(msg)
                    core = self.core
                elif core is None:  # asleep: the loop refuses adds, so only a stray abort
                    if isinstance(msg, _Add):
                        failed.append(RequestFailed(msg.request_id, "the engine is sleeping "
                                                    "(POST /wake_up)", False))
                elif isinstance(msg, _Add):
                    failure = self._add(core, msg)
                    if failure is not None:
                        failed.append(failure)
                else:
                    core.abort_request(msg.request_id)
            # Publish before posting, so a client that sees its response sees fresh stats.
            if core is not None:
                self._publish(core)
            self._post(failed)
            if core is None or not core.has_unfinished():
                continue
            # A request that fails on its own comes back as an update with ``error``: its
            # constraints left no token (a grammar that its allowed_token_ids, bad_words or
            # min_tokens make impossible), so it is the request's fault (a 400), and no
            # other request is touched. A step that raises instead leaves the core
            # half-updated (tokens counted as computed but not sampled, KV written for
            # blocks the prefix cache already published), so it cannot be trusted with
            # another step: the exception reaches _run, which faults the engine.
            updates: list[StreamItem] = [
                RequestFailed(u.request_id, u.error, True) if u.error else u
                for u in core.step()]
            self._publish(core)
            self._post(updates)
            stalled = not updates

    def _control(self, msg: _Sleep | _WakeUp | _ResetPrefixCache) -> None:
        """Sleep, wake or reset the prefix cache, between two steps; the answer (or the
        error) goes to ``msg.reply``. A failed reload faults the engine."""
        try:
            result = self._apply_control(msg)
        except BaseException as e:
            msg.reply.set_exception(e)
            return
        msg.reply.set_result(result)

    def _apply_control(self, msg: _Sleep | _WakeUp | _ResetPrefixCache) -> object:
        core = self.core
        if isinstance(msg, _ResetPrefixCache):
            if core is None:
                return 0  # asleep at level 2: there is no cache to reset
            dropped = core.drop_cached_prefixes()
            self._publish(core)
            return dropped
        if isinstance(msg, _Sleep):
            if core is None:
                return None
            if core.requests:
                raise EngineBusy(f"{len(core.requests)} requests are running; sleep once "
                                 "they finish")
            core.free_kv_cache()
            self._publish(core)
            if msg.level == 2:
                # Adapters loaded at runtime are read again on wake (the factory loads only
                # --lora-modules); their paths are all that is kept.
                lora = core.lora
                self._runtime_adapters = ({} if lora is None else
                                          {n: a.path for n, a in lora.adapters.items()})
                self.core = None
                del core
                # The server froze what loading left (gc.freeze): collect it, cycles too.
                gc.unfreeze()
                gc.collect()
                _empty_device_cache()
            log.info("engine asleep (level %d)", msg.level)
            return None
        if core is None:  # level 2: build the core again, weights read from the model path
            start = time.perf_counter()
            try:
                core = self._core_factory()
            except BaseException as e:
                log.exception("reloading the model on wake failed")
                self.fault_reason = f"model reload on wake failed: {e}"
                self.state = EngineState.FAULTED
                raise
            self.core = core
            self._reload_adapters(core)
            log.info("engine awake: model reloaded in %.1fs", time.perf_counter() - start)
        else:
            core.allocate_kv_cache()
            log.info("engine awake: KV pool reallocated")
        self._publish(core)
        return None

    def _reload_adapters(self, core: EngineCore) -> None:
        """Register again the adapters a level-2 sleep dropped with the core; one that no
        longer loads (its files gone) is left out with an error line, and the rest serve."""
        adapters, self._runtime_adapters = self._runtime_adapters, {}
        if core.lora is None:
            return
        for name, path in adapters.items():
            if name in core.lora.adapters:
                continue  # a --lora-modules one: the factory loaded it
            try:
                core.lora.register(name, path)
            except ValueError as e:
                log.error("lora %s: not loaded again on wake: %s", name, e)

    @staticmethod
    def _add(core: EngineCore, msg: _Add) -> RequestFailed | None:
        """Add one request; a failure (bad input found late, a grammar that does not compile)
        fails that request alone and leaves nothing of it in the core."""
        if msg.request_id in core.requests:  # never touch the request that holds the id
            return RequestFailed(msg.request_id, f"request_id: {msg.request_id!r} is already "
                                 "in use", True)
        try:
            core.add_request(msg.request_id, msg.prompt_token_ids, msg.params)
            return None
        except ValueError as e:
            AsyncEngine._discard(core, msg.request_id)
            return RequestFailed(msg.request_id, str(e), True)
        except Exception as e:
            log.exception("request %s could not be added", msg.request_id)
            AsyncEngine._discard(core, msg.request_id)
            return RequestFailed(msg.request_id, f"the request could not be started: {e}",
                                 False)

    @staticmethod
    def _discard(core: EngineCore, request_id: str) -> None:
        """Drop what a failed add left behind (it may have failed half-way)."""
        try:
            core.abort_request(request_id)
        except Exception:
            log.exception("request %s: cleanup after a failed add failed", request_id)
            core.requests.pop(request_id, None)

    def _drain(self, wait: float | None) -> list:
        """Every message in the inbox; first wait up to ``wait`` s (None: forever) for one."""
        messages = []
        if wait is None or wait > 0:
            try:
                messages.append(self._inbox.get(timeout=wait))
            except queue.Empty:
                return messages
        while True:
            try:
                messages.append(self._inbox.get_nowait())
            except queue.Empty:
                return messages

    def _publish(self, core: EngineCore) -> None:
        sched = core.scheduler
        self.stats = EngineStats(len(sched.running), len(sched.waiting), sched.num_preemptions,
                                 core.kv_stats(), core.kernel_labels, core.weight_bytes,
                                 core.kv_pool_bytes, core.kv_pool_tokens,
                                 core.kv_stored,
                                 core.spec.stats() if core.spec is not None else None)


def _empty_device_cache() -> None:
    """Hand freed GPU memory back to the driver (a no-op without CUDA)."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
