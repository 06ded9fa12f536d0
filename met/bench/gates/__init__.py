"""The gates of `met bench run GATE`, by name."""

from __future__ import annotations

from met.bench.gates import kat, lora, perf, structured
from met.bench.gates.base import Gate, GateContext, GateOutcome

GATES: dict[str, Gate] = {g.name: g for g in (
    Gate("concurrency-sweep",
         "the concurrency ladder (streamed, ignore_eos); per rung: no errors, every request "
         "gets osl tokens, output tok/s >= floor (optional TTFT p50 ceiling)",
         perf.configure_sweep, perf.run_sweep_gate),
    Gate("decode-floor",
         "median single-stream decode tok/s over runs of one fixed prompt >= floor",
         perf.configure_decode, perf.run_decode),
    Gate("ttft-cold",
         "time to first token at prompt lengths 256/1024/4096 (as the model allows), "
         "fresh prompts, median <= ceiling",
         perf.configure_ttft_cold, perf.run_ttft),
    Gate("ttft-warm",
         "the same with the prompt's prefix already in the prefix cache (checked via "
         "usage cached_tokens), median <= ceiling",
         perf.configure_ttft_warm, perf.run_ttft),
    Gate("first-request",
         "a server started with no native kernels built: the first request's TTFT after "
         "ready within max_ratio of the median of the next ones (nothing compiles late)",
         perf.configure_first_request, perf.run_first_request, fresh_kernels=True),
    Gate("lora-mix",
         "the same prompts at one concurrency on the base model, then spread over several "
         "rank-r adapters (loaded over /v1/load_lora_adapter, timed): adapters' output "
         "tok/s >= min_ratio of the base's; no errors",
         lora.configure, lora.run),
    Gate("kat-equality",
         "fixed prompts (greedy and seeded sampling) byte-identical one at a time, all at "
         "once, and all at once in reverse order",
         kat.configure, kat.run, needs_floors=False),
    Gate("structured-validity",
         "chat requests with response_format json_schema (strict); every output parses "
         "and validates (jsonschema)",
         structured.configure, structured.run, needs_floors=False),
)}

__all__ = ["GATES", "Gate", "GateContext", "GateOutcome"]
