"""`met bench run GATE`: floors → pinned `met serve` → measure → stop → record (→ sign)."""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import httpx

from met.bench.floors import Floors, default_floors_path, machine_class, model_slug
from met.bench.gates import GATES, GateContext, GateOutcome
from met.bench.loadgen import Target
from met.bench.records import Check, Record, command_line, write_record
from met.bench.server import SERVED_NAME, ManagedServer
from met.bench.signing import sign_file
from met.bench.sweep import new_client


@dataclass(frozen=True)
class GateRun:
    """What `met bench run` was asked to do."""

    gate: str
    model: str | None = None  # None: the embedded model
    floors: Path | None = None  # None: benchmarks/floors/<model>.<machine>.toml
    device: str = "cpu"
    records_dir: Path | None = None  # None: <repo>/.benchmarks
    sign: bool = False


def _floors_for(run: GateRun) -> Floors:
    gate = GATES[run.gate]
    path = run.floors or default_floors_path(run.model, run.device)
    if path.exists() or run.floors is not None:
        return Floors.load(path)
    if gate.needs_floors:
        raise FileNotFoundError(
            f"--floors: no floors file for model {model_slug(run.model)!r} on "
            f"{machine_class(run.device)!r} (looked for {path}); write one (see "
            "benchmarks/floors/) or pass --floors FILE")
    return Floors(None, {})


async def _measure(gate_name: str, server: ManagedServer, cfg: Any,
                   progress: TextIO | None) -> GateOutcome:
    async with new_client(64) as client:
        models = (await client.get(server.url + "/v1/models", timeout=30)).json()["data"]
        ctx = GateContext(gate_name, Target(server.url, SERVED_NAME), client,
                          models[0].get("max_model_len"), progress, server.model)
        return await GATES[gate_name].run(ctx, cfg)


def _kv_blocks_after(server: ManagedServer, wait_s: float = 15.0) -> float | None:
    """KV blocks still held once the gate's requests are done (polls briefly: finished
    requests free their blocks on the engine thread's next step)."""
    deadline = time.monotonic() + wait_s
    used = server.metric("met_kv_blocks_used")
    while used and time.monotonic() < deadline:
        time.sleep(0.2)
        used = server.metric("met_kv_blocks_used")
    return used


def run_gate(run: GateRun, progress: TextIO | None = None) -> tuple[Path, dict[str, Any]]:
    """Run one gate end to end; returns the record's path and contents. Bad floors or a
    server that does not start raise before any record is written; a failure while
    measuring becomes a FAIL record that says what went wrong."""
    if run.gate not in GATES:
        raise ValueError(f"GATE: unknown gate {run.gate!r}; `met bench list` shows "
                         f"{', '.join(GATES)}")
    floors = _floors_for(run)
    cfg = GATES[run.gate].configure(floors.section(run.gate), floors.path)
    settings = floors.serve(run.gate)
    if run.device != "cpu":
        settings["device"] = run.device
    with contextlib.ExitStack() as stack:
        env = {}
        if GATES[run.gate].fresh_kernels:
            env["TORCH_EXTENSIONS_DIR"] = stack.enter_context(
                tempfile.TemporaryDirectory(prefix="met-bench-kernels-"))
        server = stack.enter_context(ManagedServer(run.model, settings, env=env))
        try:
            outcome = asyncio.run(_measure(run.gate, server, cfg, progress))
        except (httpx.HTTPError, RuntimeError, ValueError, KeyError) as e:
            outcome = GateOutcome(metrics={"error": f"{type(e).__name__}: {e}"},
                                  checks=[Check.of("gate completed", False, "==", True)])
        used = _kv_blocks_after(server)
        outcome.checks.append(Check.of("kv_blocks_used_after_run", used, "==", 0))
        outcome.metrics["server_ready_s"] = server.ready_seconds
        serve = {"settings": settings, "argv": server.argv[1:], "served_model": SERVED_NAME,
                 "env": env}
    record = Record(gate=run.gate, model=run.model or "embedded:SmolLM2-135M-Instruct",
                    command=command_line(), serve=serve, metrics=outcome.metrics,
                    checks=outcome.checks,
                    floors_file=str(floors.path) if floors.path else None)
    path, data = write_record(record, run.records_dir)
    if run.sign:
        sign_file(path)
    return path, data
