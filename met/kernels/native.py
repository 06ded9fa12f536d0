"""met's C++ CPU kernels (met/kernels/csrc): the list of extensions, building and loading.

Each extension is one or more csrc files compiled with torch's extension loader into a plain
shared library that registers its ops with the dispatcher (``torch.ops.<namespace>.*``). The
namespace is ``met_<key>_<hash>``, the hash taken over the extension's sources, every header
in csrc and the compiler flags: an edited source gets a new namespace (two versions can
never meet in one process under one name), and torch's on-disk build cache is keyed on it.

Builds happen ahead of use: `met kernels build` (run by the install script) and
`prepare()`, which the engine calls before the server reports ready. No ``-march`` flags:
the sources pick their ISA per function (``target`` attributes), so one build runs on any
x86-64, and `capability.probe()` decides which ops run. Without a working compiler a load
logs one warning and returns None, and the callers use plain PyTorch; `met kernels check`
(and CI) fails when that happens on a machine where a kernel should run.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from met.kernels.capability import Capability, probe

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
# -fopenmp: at::parallel_for's OpenMP backend is header code, compiled into us.
# No -ffast-math: fixed summation orders make results reproducible.
_CFLAGS = ("-O3", "-fopenmp", "-Wno-psabi")
_LDFLAGS = ("-fopenmp",)


@dataclass(frozen=True)
class Extension:
    """One native library: its csrc files and the machines its ops run on."""

    key: str
    sources: tuple[str, ...]
    runs_on: Callable[[Capability], bool]
    what: str  # one line for `met doctor` / `met kernels`


EXTENSIONS: dict[str, Extension] = {e.key: e for e in (
    Extension("fused_ops", ("fused_ops.cpp",), lambda c: c.avx2,
              "layer ops: RMSNorm, rope + KV write, SiLU·up, residual adds"),
    Extension("sampler_ops", ("sampler_ops.cpp",), lambda c: c.avx2,
              "sampler ops: greedy argmax, top-p threshold and cut"),
    Extension("decode_attention",
              ("decode_attention.cpp", "decode_attention_tile.cpp",
               "decode_attention_blocked.cpp", "decode_attention_int8_avx2.cpp"),
              lambda c: c.avx2,
              "paged decode attention (bf16 / float32 / int8 cache)"),
    Extension("prompt_attention", ("prompt_attention.cpp",), lambda c: c.amx_bf16,
              "causal prompt attention on AMX-BF16 tiles"),
    Extension("w4a8", ("w4a8.cpp",), lambda c: c.avx512_vnni,
              "4-bit weights x int8 activations, AVX512-VNNI (+ AMX tiles)"),
    Extension("w4a8_avx2", ("w4a8_avx2.cpp",), lambda c: c.avx2,
              "4-bit weights x int8 activations, AVX2"),
    Extension("w8a8", ("w8a8.cpp",), lambda c: c.avx512_vnni,
              "int8 weights x int8 activations GEMV, AVX512-VNNI"),
    Extension("int4_gemv", ("int4_gemv.cpp",), lambda c: c.avx512_bf16,
              "int4 weight-only GEMV, AVX512-BF16"),
    Extension("layer_stack", ("layer_stack.cpp",), lambda c: c.avx2,
              "a decode step's layers in one native call"),
    Extension("gguf_blocks", ("gguf_blocks.cpp",), lambda c: c.avx2,
              "GGUF blocks (Q4_0..Q8_0, Q4_K, Q5_K, Q6_K) x float32 rows, AVX2 / AVX-512"),
    Extension("lora", ("lora.cpp",), lambda c: c.avx2,
              "LoRA adapter deltas, each row with its own adapter slot"),
)}


def register(ext: Extension) -> None:
    """Add an extension (a new kernel's csrc files) to the table `prepare` builds."""
    EXTENSIONS[ext.key] = ext


@functools.cache
def namespace(key: str) -> str:
    """``met_<key>_<hash of sources, headers, flags and their place>``: the ops' namespace
    and the build's name."""
    ext = EXTENSIONS[key]
    digest = hashlib.sha256()
    # The sources' location too: an editable checkout and an installed copy get separate
    # builds instead of rebuilding one another's (torch's build files hold the paths).
    digest.update(str(CSRC.resolve()).encode())
    for path in [CSRC / s for s in ext.sources] + sorted(CSRC.glob("*.h")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    digest.update(" ".join(_CFLAGS + _LDFLAGS).encode())
    digest.update(torch.__version__.encode())
    return f"met_{key}_{digest.hexdigest()[:12]}"


def _missing_files(ext: Extension) -> list[str]:
    return [s for s in ext.sources if not (CSRC / s).is_file()]


_STALE_LOCK_S = 600  # the slowest build takes under a minute


def _clear_stale_lock(name: str) -> None:
    """torch waits forever on the lock file of a build that was killed midway (its
    process gone, the file left): one older than any build could be is removed."""
    lock = _build_root() / name / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > _STALE_LOCK_S:
        log.warning("native CPU kernels %s: removing a build lock left %.0f s ago by a "
                    "build that did not finish (%s)", name, age, lock)
        lock.unlink(missing_ok=True)


@functools.cache
def load_native_ops(key: str) -> object | None:
    """``torch.ops.<namespace(key)>`` after building (if not built yet) and loading the
    extension; None when that fails (logged once)."""
    ext = EXTENSIONS[key]
    from torch.utils.cpp_extension import load

    start = time.perf_counter()
    try:
        missing = _missing_files(ext)
        if missing:
            raise FileNotFoundError(f"{', '.join(missing)} not in {CSRC} (an incomplete "
                                    f"install: the package must ship csrc/*.cpp and *.h)")
        _put_pip_ninja_on_path()
        name = namespace(key)
        _clear_stale_lock(name)
        lib_path = load(
            name=name,
            sources=[str(CSRC / s) for s in ext.sources],
            extra_include_paths=[str(CSRC)],
            extra_cflags=[*_CFLAGS, f"-DMET_OP_NAMESPACE={name}"],
            extra_ldflags=list(_LDFLAGS),
            is_python_module=False,
        )
        torch.ops.load_library(lib_path)
        ops = getattr(torch.ops, name)
    except Exception as exc:  # no compiler, no ninja, broken toolchain: all mean "fall back"
        log.warning("native CPU kernels %s unavailable, using plain PyTorch (%s: %.2000s)",
                    key, type(exc).__name__, exc)
        return None
    took = time.perf_counter() - start
    if took > 1.0:
        log.info("native CPU kernels %s built in %.1f s", key, took)
    return ops


@functools.cache
def native_op(key: str, op: str):
    """``torch.ops.<namespace>.<op>.default``, or None when the extension failed to load.
    Calling the overload directly skips the packet's per-call overload lookup, which cost
    more than some of the kernels themselves at decode sizes (~120 calls per step)."""
    ops = load_native_ops(key)
    return None if ops is None else getattr(ops, op).default


def qualified(key: str, op: str) -> str:
    """``"<namespace>::<op>"``: how one native op names another (csrc/layer_stack.cpp)."""
    return f"{namespace(key)}::{op}"


def runnable(cap: Capability | None = None) -> list[Extension]:
    """The extensions whose ops run on this machine (`Extension.runs_on`)."""
    cap = cap or probe()
    return [e for e in EXTENSIONS.values() if e.runs_on(cap)]


def prepare(progress: Callable[[str], None] | None = None,
            exts: list[Extension] | None = None) -> dict[str, bool]:
    """Build (where not built yet) and load every extension that runs here, so that no
    request ever waits for a compiler; ``{key: loaded}``. ``progress`` gets one line per
    extension that has to be compiled."""
    exts = runnable() if exts is None else exts
    todo = [e for e in exts if not _built(e)]
    if todo and progress is not None:
        progress(f"compiling {len(todo)} native kernel libraries "
                 f"({', '.join(e.key for e in todo)}); later starts load them from "
                 f"{_build_root()}")
    result = {}
    began = time.perf_counter()
    for ext in exts:
        start = time.perf_counter()
        result[ext.key] = load_native_ops(ext.key) is not None
        if ext in todo and progress is not None:
            state = "ok" if result[ext.key] else "FAILED (plain PyTorch instead)"
            progress(f"  {ext.key}: {state} in {time.perf_counter() - start:.1f} s")
    if progress is not None and not todo:
        progress(f"native CPU kernels: {sum(result.values())} of {len(exts)} libraries "
                 f"loaded in {time.perf_counter() - began:.1f} s")
    return result


def _build_root() -> Path:
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory("x", verbose=False)).parent


def _built(ext: Extension) -> bool:
    """Whether torch's build cache holds this extension's library."""
    try:
        return (_build_root() / namespace(ext.key) / f"{namespace(ext.key)}.so").exists()
    except Exception:
        return False


def _put_pip_ninja_on_path() -> None:
    """torch runs `ninja` from PATH; the pip package's binary is missing from it when the
    environment's python is run without activating the environment."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja
    except ImportError:
        return  # load will say that ninja is missing
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
