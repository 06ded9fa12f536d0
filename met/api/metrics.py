"""Prometheus metrics under ``met_`` (prometheus-client, one registry per app)."""

from __future__ import annotations

from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from met.engine.async_engine import AsyncEngine
from met.serving.generate import ChoiceState, Generation

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                    120.0, 300.0)
_TOKEN_TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                       0.5, 0.75, 1.0, 2.5)


class ServerMetrics:
    """What /metrics shows. Counters move as choices finish; gauges are read at scrape time
    from the engine thread's last published snapshot."""

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        r, labels = self.registry, {"model_name": model_name}
        self._labels = labels
        self.requests = Counter("met_requests", "Finished requests (choices), by finish reason",
                                ["model_name", "finish_reason"], registry=r)
        self.running = Gauge("met_requests_running", "Requests running in the engine",
                             ["model_name"], registry=r).labels(**labels)
        self.waiting = Gauge("met_requests_waiting", "Requests waiting to be scheduled",
                             ["model_name"], registry=r).labels(**labels)
        self.prompt_tokens = Counter("met_prompt_tokens", "Prompt tokens received",
                                     ["model_name"], registry=r).labels(**labels)
        self.generation_tokens = Counter("met_generation_tokens", "Tokens generated",
                                         ["model_name"], registry=r).labels(**labels)
        self.ttft = Histogram("met_time_to_first_token_seconds", "Arrival to first token",
                              ["model_name"], buckets=_LATENCY_BUCKETS,
                              registry=r).labels(**labels)
        self.tpot = Histogram("met_time_per_output_token_seconds",
                              "Mean time between output tokens, per request", ["model_name"],
                              buckets=_TOKEN_TIME_BUCKETS, registry=r).labels(**labels)
        self.e2e = Histogram("met_e2e_request_latency_seconds", "Arrival to last token",
                             ["model_name"], buckets=_LATENCY_BUCKETS, registry=r).labels(**labels)
        self.kv_total = Gauge("met_kv_blocks_total", "KV cache blocks in the pool",
                              ["model_name"], registry=r).labels(**labels)
        self.kv_used = Gauge("met_kv_blocks_used", "KV cache blocks held by live requests",
                             ["model_name"], registry=r).labels(**labels)
        self.kv_usage = Gauge("met_kv_cache_usage_ratio", "Fraction of KV blocks in use",
                              ["model_name"], registry=r).labels(**labels)
        self.preemptions = Gauge("met_num_preemptions", "Preemptions since start",
                                 ["model_name"], registry=r).labels(**labels)
        self.prefix_queries = Counter("met_prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache",
                                      ["model_name"], registry=r).labels(**labels)
        self.prefix_hits = Counter("met_prefix_cache_hits",
                                   "Prompt tokens served from the prefix cache",
                                   ["model_name"], registry=r).labels(**labels)

        self.weight_bytes = Gauge("met_weight_bytes", "Bytes the model's weights take",
                                  ["model_name"], registry=r).labels(**labels)
        self.kv_pool_bytes = Gauge("met_kv_pool_bytes", "Bytes the KV cache pool takes",
                                   ["model_name"], registry=r).labels(**labels)
        self.kv_pool_tokens = Gauge("met_kv_pool_tokens", "Tokens the KV cache pool holds, "
                                    "by the cache's stored type", ["model_name",
                                                                    "kv_cache_dtype"],
                                    registry=r)
        self.kernels = Gauge("met_kernel_info", "The kernels this server runs (value 1): "
                             "linear method, attention backend, CPU ISA",
                             ["model_name", "linear", "attention", "cpu_isa"], registry=r)
        self._kernels_set = False
        spec = ["model_name", "method"]
        self.spec_drafted = Gauge("met_spec_decode_num_draft_tokens", "Speculative draft "
                                  "tokens verified since start", spec, registry=r)
        self.spec_accepted = Gauge("met_spec_decode_num_accepted_tokens", "Of them, the ones "
                                   "the target accepted", spec, registry=r)
        self.spec_verifies = Gauge("met_spec_decode_num_verifies", "Request steps that "
                                   "verified drafts", spec, registry=r)
        self.spec_acceptance = Gauge("met_spec_decode_acceptance_ratio", "Accepted / drafted",
                                     spec, registry=r)
        self.spec_length = Gauge("met_spec_decode_mean_accepted_length", "Tokens a verifying "
                                 "request gains per step (accepted drafts + its own)", spec,
                                 registry=r)
        self._lora_metrics(r)
        # The latest requests' exact latencies, for the terminal dashboard's p50/p99 (the
        # histograms' buckets are too coarse for that).
        self.recent_ttft: deque[float] = deque(maxlen=1024)
        self.recent_tpot: deque[float] = deque(maxlen=1024)

    def _lora_metrics(self, r: CollectorRegistry) -> None:
        per = ["model_name", "adapter"]
        self.lora_requests = Counter("met_lora_requests", "Finished requests (choices) per "
                                     "LoRA adapter", per, registry=r)
        self.lora_tokens = Counter("met_lora_generation_tokens", "Tokens generated per LoRA "
                                   "adapter", per, registry=r)
        self.lora_active = Gauge("met_lora_adapter_requests", "Queued + running requests per "
                                 "LoRA adapter", per, registry=r)
        self.lora_state = Gauge("met_lora_adapter_info", "Each loaded adapter (value 1) and "
                                "where it is: resident (in a slot), in_memory, on_disk",
                                per + ["state"], registry=r)
        self.lora_bytes = Gauge("met_lora_adapter_bytes", "An adapter's matrices in memory",
                                per, registry=r)
        self.lora_slots = Gauge("met_lora_slots", "Adapter slots, and how many running "
                                "requests pin", ["model_name", "kind"], registry=r)
        self.lora_loads = Gauge("met_lora_slot_loads", "Adapters written into a slot since "
                                "start (swaps)", ["model_name"], registry=r)
        self.lora_reads = Gauge("met_lora_disk_reads", "Adapters read from disk again after "
                                "--max-cpu-loras evicted them", ["model_name"], registry=r)
        self.lora_slot_bytes = Gauge("met_lora_slot_bytes", "Bytes the adapter slots take",
                                     ["model_name"], registry=r)

    def _render_lora(self, lora) -> None:
        snap = lora.snapshot()
        self.lora_state.clear()
        for name, a in snap["adapters"].items():
            labels = dict(adapter=name, **self._labels)
            self.lora_state.labels(state=a["state"], **labels).set(1)
            self.lora_active.labels(**labels).set(a["requests"])
            self.lora_bytes.labels(**labels).set(a["bytes"])
        self.lora_slots.labels(kind="total", **self._labels).set(snap["slots"])
        self.lora_slots.labels(kind="pinned", **self._labels).set(snap["slots_pinned"])
        self.lora_loads.labels(**self._labels).set(snap["slot_loads"])
        self.lora_reads.labels(**self._labels).set(snap["disk_reads"])
        self.lora_slot_bytes.labels(**self._labels).set(snap["slot_bytes"])

    def on_choice_done(self, gen: Generation, c: ChoiceState) -> None:
        self.requests.labels(finish_reason=c.finish_reason or "unknown", **self._labels).inc()
        adapter = gen.params[c.prompt_index].lora
        if adapter is not None:
            self.lora_requests.labels(adapter=adapter, **self._labels).inc()
            self.lora_tokens.labels(adapter=adapter, **self._labels).inc(c.num_tokens)
        self.generation_tokens.inc(c.num_tokens)
        if c.index % gen.n == 0:  # once per prompt
            prompt_len = len(gen.prompts[c.prompt_index].token_ids)
            self.prompt_tokens.inc(prompt_len)
            if c.first_token_at is not None:
                self.prefix_queries.inc(prompt_len)
                self.prefix_hits.inc(c.num_cached_tokens)
        if c.first_token_at is not None and c.last_token_at is not None:
            self.ttft.observe(c.first_token_at - gen.arrival)
            self.recent_ttft.append(c.first_token_at - gen.arrival)
            self.e2e.observe(c.last_token_at - gen.arrival)
            if c.num_tokens > 1:
                tpot = (c.last_token_at - c.first_token_at) / (c.num_tokens - 1)
                self.tpot.observe(tpot)
                self.recent_tpot.append(tpot)

    def render(self, engine: AsyncEngine) -> bytes:
        self.refresh(engine)
        return generate_latest(self.registry)

    def refresh(self, engine: AsyncEngine) -> None:
        """Set the gauges from the engine's last published snapshot."""
        s = engine.stats
        self.running.set(s.num_running)
        self.waiting.set(s.num_waiting)
        self.preemptions.set(s.num_preemptions)
        if s.kernels and not self._kernels_set:
            self.kernels.labels(**dict(s.kernels), **self._labels).set(1)
            self._kernels_set = True
        self.weight_bytes.set(s.weight_bytes)
        self.kv_pool_bytes.set(s.kv_pool_bytes)
        if s.kv_pool_tokens:
            self.kv_pool_tokens.labels(kv_cache_dtype=s.kv_cache_dtype,
                                       **self._labels).set(s.kv_pool_tokens)
        if s.spec is not None:
            labels = dict(method=s.spec.method, **self._labels)
            self.spec_drafted.labels(**labels).set(s.spec.drafted)
            self.spec_accepted.labels(**labels).set(s.spec.accepted)
            self.spec_verifies.labels(**labels).set(s.spec.verifies)
            self.spec_acceptance.labels(**labels).set(s.spec.acceptance_rate)
            self.spec_length.labels(**labels).set(s.spec.mean_accepted_length)
        lora = getattr(getattr(engine, "core", None), "lora", None)
        if lora is not None:
            self._render_lora(lora)
        if s.kv is not None:
            self.kv_total.set(s.kv.num_blocks_total)
            self.kv_used.set(s.kv.num_blocks_in_use)
            self.kv_usage.set(s.kv.num_blocks_in_use / max(1, s.kv.num_blocks_total))
