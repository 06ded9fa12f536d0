"""Building and loading met's C++ CPU kernels (met/layers/csrc) on first use.

Each source file is compiled with ``torch.utils.cpp_extension.load_inline`` into a plain
shared library that registers its ops with the dispatcher (``torch.ops.<name>.*``); torch
caches the build on disk keyed on the source, so later processes only load it. No ``-march``
flags: the sources pick their ISA at load time (``target_clones``), so one build runs on any
x86-64. Without a working compiler the loader logs one warning and returns None, and the
callers fall back to plain PyTorch.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"


@functools.cache
def load_native_ops(name: str, source: str) -> object | None:
    """``torch.ops.<name>`` after compiling (first call in this process) and loading
    ``csrc/<source>``; None when that fails. The source registers its ops under the
    namespace macro ``MET_OP_NAMESPACE``, set to ``name`` (bump the name's version suffix
    when two versions of a source could meet in one process)."""
    from torch.utils.cpp_extension import load_inline

    start = time.perf_counter()
    try:
        _put_pip_ninja_on_path()
        lib_path = load_inline(
            name=name,
            cpp_sources=[(CSRC / source).read_text()],
            extra_include_paths=[str(CSRC)],  # met_simd.h, shared by the kernels
            # The sources include the few ATen headers they need; the implicit
            # <torch/extension.h> (pybind11 and all of torch's C++ API) doubles compile time.
            no_implicit_headers=True,
            is_python_module=False,
            # -fopenmp: at::parallel_for's OpenMP backend is header code, compiled into us.
            # No -ffast-math: fixed summation orders make results reproducible.
            extra_cflags=["-O3", "-fopenmp", "-Wno-psabi", f"-DMET_OP_NAMESPACE={name}"],
            extra_ldflags=["-fopenmp"],
        )
        torch.ops.load_library(lib_path)
        ops = getattr(torch.ops, name)
    except Exception as exc:  # no compiler, no ninja, broken toolchain: all mean "fall back"
        log.warning("native CPU kernels %s unavailable, using plain PyTorch (%s: %.2000s)",
                    source, type(exc).__name__, exc)
        return None
    log.info("native CPU kernels %s ready in %.1f s", source, time.perf_counter() - start)
    return ops


def _put_pip_ninja_on_path() -> None:
    """torch runs `ninja` from PATH; the pip package's binary is missing from it when the
    environment's python is run without activating the environment."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja
    except ImportError:
        return  # load_inline will say that ninja is missing
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


@functools.cache
def native_op(name: str, source: str, op: str):
    """``torch.ops.<name>.<op>.default`` (see `load_native_ops`), or None when the build
    failed. Calling the overload directly skips the packet's per-call overload lookup, which
    cost more than some of the kernels themselves at decode sizes (~120 calls per step)."""
    ops = load_native_ops(name, source)
    return None if ops is None else getattr(ops, op).default
