"""`met bench tables`: the benchmark tables of docs/benchmarks.md and README.md, generated
from the records in ``.benchmarks/``.

A document marks each generated table with a pair of comments::

    <!-- bench:served -->
    ...generated, do not edit...
    <!-- /bench:served -->

and `update` rewrites what lies between them from the records (``--check``: only says
whether a file is out of date, so a test can hold the committed docs to the records).

Two kinds of records feed the tables:

- peer runs, ``.benchmarks/peers/<run>/<engine>.json``: one `met bench sweep --out` file per
  engine, written by ``benchmarks/compare_peers.sh`` (``OUT=.benchmarks/peers/<run>``);
- gate records, ``.benchmarks/<gate>/<date>-<sha10>.json`` (`met bench run`, see
  met/bench/records.py), which carry their own git sha and hardware.

A sweep file does not say which machine or commit it ran on, so the `Ladder` specs below
name them, with the command that wrote the run (taken from the notes of the session that
ran it); the numbers always come from the files.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The machines the peer runs ran on (2 vCPUs each, the peer engines in the same run).
XEON = ("Intel Xeon, 2 cores (AVX-512, AVX512-BF16, AVX512-VNNI, AMX), 24 GiB, "
        "torch 2.13.0 CPU")
EPYC_ZEN4 = "AMD EPYC Zen 4, 2 cores (AVX-512, AVX512-BF16, AVX512-VNNI; no AMX)"
EPYC_ZEN3 = "AMD EPYC Zen 3, 2 cores (AVX2, FMA, F16C; no AVX-512, no native bfloat16)"

_PEER_LABELS = {"llama-server": "llama.cpp", "vllm": "vLLM-CPU"}


def run_machine(run: str) -> str:
    """The machine of a peer run, from the naming its folders follow."""
    if "zen3" in run:
        return EPYC_ZEN3
    if "amd" in run:
        return EPYC_ZEN4
    if run[:10] <= "2026-12-03":  # every run before the AMD sessions was on the Xeon
        return XEON
    return "not recorded"


# ---- reading records ----------------------------------------------------------------------

@dataclass(frozen=True)
class Sweep:
    """One engine's sweep file of a peer run."""

    engine: str  # the file's stem: met-w4a8, llama-server, vllm, ...
    created_at: str
    settings: dict[str, Any]
    rungs: dict[int, dict[str, Any]]  # concurrency -> the rung's statistics

    @property
    def is_met(self) -> bool:
        return self.engine == "met" or self.engine.startswith("met-")

    def tok_s(self, c: int) -> float | None:
        rung = self.rungs.get(c)
        return None if rung is None or rung.get("errors") else rung.get("output_tok_s")

    def stat(self, c: int, key: str) -> float | None:
        rung = self.rungs.get(c)
        return None if rung is None else rung.get(key)


def load_run(records_dir: Path, run: str) -> dict[str, Sweep]:
    """``{engine: Sweep}`` for ``<records_dir>/peers/<run>``."""
    folder = records_dir / "peers" / run
    if not folder.is_dir():
        raise FileNotFoundError(f"no peer run {folder} (a table names it in met/bench/tables.py)")
    out = {}
    for path in sorted(folder.glob("*.json")):
        data = json.loads(path.read_text())
        if data.get("kind") != "met-bench-sweep":
            continue
        out[path.stem] = Sweep(path.stem, data.get("created_at", ""), data.get("settings", {}),
                               {r["concurrency"]: r for r in data.get("rungs", [])})
    if not out:
        raise FileNotFoundError(f"{folder} holds no `met bench sweep` files")
    return out


def peer_runs(records_dir: Path) -> list[str]:
    folder = records_dir / "peers"
    return sorted(p.name for p in folder.iterdir() if p.is_dir()) if folder.is_dir() else []


def gate_records(records_dir: Path) -> list[tuple[Path, dict[str, Any]]]:
    """Every gate record, by gate then file name."""
    out = []
    if not records_dir.is_dir():
        return out
    for gate_dir in sorted(p for p in records_dir.iterdir() if p.is_dir() and p.name != "peers"):
        for path in sorted(gate_dir.glob("*.json")):
            data = json.loads(path.read_text())
            if data.get("kind") == "met-bench-record":
                out.append((path, data))
    return out


# ---- formatting ---------------------------------------------------------------------------

def _num(x: float | None, digits: int = 1) -> str:
    return "–" if x is None else f"{x:,.{digits}f}"


def _ms(x: float | None) -> str:
    if x is None:
        return "–"
    return f"{x:,.0f} ms" if x >= 1000 else f"{x:.1f} ms"


def _ratio(a: float | None, b: float | None) -> str:
    return "–" if a is None or not b else f"{a / b:.2f}×"


def _markdown(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _bold_max(cells: list[str], values: list[float | None]) -> list[str]:
    known = [v for v in values if v is not None]
    if len(known) < 2:
        return cells
    best = max(known)
    return [f"**{c}**" if v == best else c for c, v in zip(cells, values, strict=True)]


def _streams(c: int) -> str:
    return "1 stream" if c == 1 else f"{c} streams"


def describe_settings(s: dict[str, Any]) -> str:
    """What every request of a sweep was: prompt and output length, sampling."""
    temp = s.get("temperature") or 0.0
    if temp == 0:
        sampling = "greedy"
    else:
        sampling = f"temperature {temp:g}"
        if s.get("top_p", 1.0) < 1:
            sampling += f", top_p {s['top_p']:g}"
        if s.get("top_k", 0) > 0:
            sampling += f", top_k {s['top_k']}"
    reps = s.get("reps", 1)
    return (f"≈{s.get('isl')}-token prompts, {s.get('osl')} output tokens, {reps} request"
            f"{'s' if reps != 1 else ''} per client per rung, {sampling}")


# ---- the tables ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Ladder:
    """The served concurrency ladder of one peer run: output tok/s of each engine per rung,
    met's first column against the best peer, and TTFT / TPOT rows."""

    run: str
    machine: str
    commit: str
    command: str
    columns: tuple[tuple[str, str], ...]  # (engine file stem, column header); met's first
    ratio_header: str = "met default / best peer"

    def render(self, records_dir: Path) -> str:
        sweeps = load_run(records_dir, self.run)
        missing = [e for e, _ in self.columns if e not in sweeps]
        if missing:
            raise FileNotFoundError(f"peer run {self.run} has no {', '.join(missing)}")
        cols = [sweeps[e] for e, _ in self.columns]
        main, peers = cols[0], [s for s in cols if not s.is_met]
        rungs = sorted(main.rungs)
        headers = ["output tok/s", *(h for _, h in self.columns), self.ratio_header]
        rows = []
        for c in rungs:
            vals = [s.tok_s(c) for s in cols]
            best_peer = max((v for v in (p.tok_s(c) for p in peers) if v is not None),
                            default=None)
            rows.append([_streams(c), *_bold_max([_num(v) for v in vals], vals),
                         _ratio(vals[0], best_peer)])
        for c in (rungs[0], rungs[-1]):
            vals = [s.stat(c, "ttft_p50_ms") for s in cols]
            neg = [None if v is None else -v for v in vals]  # lowest latency in bold
            rows.append([f"TTFT p50, {_streams(c)}", *_bold_max([_ms(v) for v in vals], neg),
                         ""])
        vals = [s.stat(rungs[0], "tpot_p50_ms") for s in cols]
        cells = ["–" if v is None else f"{v:.2f} ms" for v in vals]
        rows.append([f"TPOT p50, {_streams(rungs[0])}",
                     *_bold_max(cells, [None if v is None else -v for v in vals]), ""])
        tail = (f"Record `.benchmarks/peers/{self.run}` ({main.created_at[:10]}, met at "
                f"`{self.commit}`): `{self.command}`; {describe_settings(main.settings)}. "
                f"Machine: {self.machine}.")
        return _markdown(headers, rows) + "\n\n" + tail


def _best_peer(peers: Sequence[Sweep], c: int) -> tuple[float | None, str]:
    """The fastest peer's tok/s at concurrency ``c`` and its engine name."""
    known = [(p.tok_s(c), p.engine) for p in peers if p.tok_s(c) is not None]
    return max(known) if known else (None, "")


def runs_table(records_dir: Path) -> str:
    """Every peer run: each met engine at its lowest and highest rung against the best peer
    of the same run."""
    rows = []
    for run in peer_runs(records_dir):
        try:
            sweeps = load_run(records_dir, run)
        except FileNotFoundError:
            continue
        peers = [s for s in sweeps.values() if not s.is_met]
        for met in (s for s in sweeps.values() if s.is_met):
            rungs = sorted(met.rungs)
            lo, hi = rungs[0], rungs[-1]
            (b_lo, n_lo), (b_hi, n_hi) = _best_peer(peers, lo), _best_peer(peers, hi)
            peer = " / ".join(dict.fromkeys(_PEER_LABELS.get(n, n) for n in (n_lo, n_hi) if n))
            rows.append([f"`{run}`", run_machine(run).split(",")[0], met.engine,
                         f"{lo}–{hi}" if lo != hi else str(lo),
                         f"{_num(met.tok_s(lo))} / {_num(met.tok_s(hi))}",
                         f"{_num(b_lo)} / {_num(b_hi)}" + (f" ({peer})" if peer else ""),
                         f"{_ratio(met.tok_s(lo), b_lo)} / {_ratio(met.tok_s(hi), b_hi)}"])
    headers = ["run", "machine", "met engine", "streams", "met tok/s, fewest / most streams",
               "best peer tok/s", "met / best peer"]
    return _markdown(headers, rows)


_OPS = {">=": "≥", "<=": "≤", "==": "="}


def _value(x: Any) -> str:
    if isinstance(x, float):  # a ratio keeps its third digit: 0.693 must not read as 0.7
        return f"{x:,.1f}" if abs(x) >= 10 or x == int(x) else f"{x:.3g}"
    return str(x)


def gates_table(records_dir: Path) -> str:
    """Every gate record: where it ran, with what, and each floor it was held to."""
    rows = []
    for path, d in gate_records(records_dir):
        git = d.get("git", {})
        sha = (git.get("sha") or "nogit")[:7] + (" (dirty)" if git.get("dirty_paths") else "")
        hw = d.get("hardware", {})
        machine = f"{hw.get('cpu_model', '?')}, {hw.get('cpu_cores', '?')} cores"
        settings = d.get("serve", {}).get("settings", {})
        floors = "; ".join(f"{c['name']} {_value(c['measured'])} {_OPS.get(c['op'], c['op'])} "
                           f"{_value(c['floor'])}" for c in d.get("checks", [])
                           if c.get("op") in (">=", "<="))
        equal = sum(1 for c in d.get("checks", []) if c.get("op") == "==" and c.get("ok"))
        if equal:
            floors = (floors + "; " if floors else "") + (
                "1 equality check holds" if equal == 1 else f"{equal} equality checks hold")
        rows.append([f"`{d.get('gate')}`", f"`{path.name}`", f"`{sha}`", machine,
                     f"`--dtype {settings.get('dtype', '?')}`", d.get("verdict", "?"), floors])
    headers = ["gate", "record", "commit", "machine", "served with", "verdict",
               "measured (floor)"]
    return _markdown(headers, rows)


@dataclass(frozen=True)
class Table:
    name: str
    render: Callable[[Path], str]
    about: str = ""


_LADDERS = {
    "served": Ladder(
        run="2026-12-03-session5", machine=XEON, commit="31e6016",
        command='ENGINES="met-w4a8 met llama-server vllm" bash benchmarks/compare_peers.sh',
        columns=(("met-w4a8", "met default (w4a8)"), ("met", "met bf16 weights"),
                 ("llama-server", "llama.cpp"), ("vllm", "vLLM-CPU 0.32"))),
    "served-zen4": Ladder(
        run="2026-12-04-amd-b", machine=EPYC_ZEN4, commit="7f355e2",
        command='ENGINES="met-w4a8 llama-server vllm" OUT=.benchmarks/peers/2026-12-04-amd-b '
                'bash benchmarks/compare_peers.sh',
        columns=(("met-w4a8", "met default (w4a8)"), ("llama-server", "llama.cpp"),
                 ("vllm", "vLLM-CPU 0.32"))),
    "served-zen3": Ladder(
        run="2026-12-05-zen3-i", machine=EPYC_ZEN3, commit="3800555",
        command='ENGINES="met-auto llama-server" CONCURRENCY=1,4,16,32,64 '
                'OUT=.benchmarks/peers/2026-12-05-zen3-i bash benchmarks/compare_peers.sh',
        columns=(("met-auto", "met default (float32 + w4a8, int8 KV)"),
                 ("llama-server", "llama.cpp (native build)"))),
    "served-zen3-vllm": Ladder(
        run="2026-12-05-zen3-c", machine=EPYC_ZEN3, commit="3604aa5",
        command='ENGINES="met-auto llama-server vllm" CONCURRENCY=1,4,16,32,64 '
                'OUT=.benchmarks/peers/2026-12-05-zen3-c bash benchmarks/compare_peers.sh',
        columns=(("met-auto", "met default (float32 + w4a8, int8 KV)"),
                 ("llama-server", "llama.cpp (native build)"), ("vllm", "vLLM-CPU 0.32"))),
    "served-zen3-sampled": Ladder(
        run="2026-12-05-zen3-sampled", machine=EPYC_ZEN3, commit="d160461",
        command='TEMPERATURE=0.8 TOP_P=0.95 TOP_K=40 ENGINES="met-auto llama-server" '
                'OUT=.benchmarks/peers/2026-12-05-zen3-sampled bash benchmarks/compare_peers.sh',
        columns=(("met-auto", "met default (float32 + w4a8, int8 KV)"),
                 ("llama-server", "llama.cpp (native build)"))),
    "gemma-q4km": Ladder(
        run="2026-12-06-gemma-q4km", machine=EPYC_ZEN4, commit="f4d721e",
        command='GGUF=gemma-3-270m-q4_k_m.gguf ENGINES="met-auto met llama-server" '
                'CONCURRENCY=1,32 OSL=64 OUT=.benchmarks/peers/2026-12-06-gemma-q4km '
                'bash benchmarks/compare_peers.sh',
        columns=(("met-auto", "met gguf blocks, bf16 rows"), ("met", "met bf16 weights"),
                 ("llama-server", "llama.cpp"))),
}

TABLES: dict[str, Table] = {
    **{name: Table(name, spec.render, f"served ladder, {spec.run}")
       for name, spec in _LADDERS.items()},
    "runs": Table("runs", runs_table, "every peer run, fewest and most streams"),
    "gates": Table("gates", gates_table, "every gate record"),
}

_MARK = re.compile(r"(<!-- bench:(?P<name>[\w.-]+) -->\n)(?P<body>.*?)(<!-- /bench:(?P=name) -->)",
                   re.DOTALL)


@dataclass
class Result:
    path: Path
    tables: list[str] = field(default_factory=list)
    changed: bool = False


def refresh(text: str, records_dir: Path, tables: dict[str, Table] | None = None,
            ) -> tuple[str, list[str]]:
    """``text`` with every marked table regenerated, and the names of the tables."""
    tables = TABLES if tables is None else tables
    names: list[str] = []

    def sub(m: re.Match) -> str:
        name = m.group("name")
        if name not in tables:
            raise KeyError(f"<!-- bench:{name} -->: no such table (one of {', '.join(tables)})")
        names.append(name)
        return f"{m.group(1)}{tables[name].render(records_dir).rstrip()}\n{m.group(4)}"

    return _MARK.sub(sub, text), names


def update(paths: Sequence[Path], records_dir: Path, check: bool = False,
           tables: dict[str, Table] | None = None) -> list[Result]:
    """Regenerate the marked tables of each file (only compare with ``check``)."""
    results = []
    for path in paths:
        old = path.read_text()
        new, names = refresh(old, records_dir, tables)
        res = Result(path, names, new != old)
        if res.changed and not check:
            path.write_text(new)
        results.append(res)
    return results
