"""The native extension table (met.kernels.native): what a user's install needs to build."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

from met.kernels import native
from met.kernels.capability import probe

ROOT = Path(__file__).resolve().parents[2]


def test_every_source_and_included_header_ships_with_the_package():
    """A non-editable install holds only the package data: every csrc file an extension
    compiles, and every header those include, must match its globs (the missing *.h once
    made an installed met fall back to plain PyTorch)."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    globs = data["tool"]["setuptools"]["package-data"]["met.kernels"]
    shipped = {p.name for g in globs for p in native.CSRC.glob(g.removeprefix("csrc/"))}
    needed = set()
    for ext in native.EXTENSIONS.values():
        for source in ext.sources:
            needed.add(source)
            text = (native.CSRC / source).read_text()
            needed.update(re.findall(r'#include "([^"]+)"', text))
    for header in native.CSRC.glob("*.h"):
        needed.update(re.findall(r'#include "([^"]+)"', header.read_text()))
    assert needed <= shipped, f"not shipped: {sorted(needed - shipped)}"


def test_namespace_follows_the_sources(tmp_path, monkeypatch):
    """An edited source gets a new namespace (so two versions never meet under one name),
    an unchanged one keeps it."""
    copy = tmp_path / "csrc"
    copy.mkdir()
    for f in native.CSRC.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    monkeypatch.setattr(native, "CSRC", copy)
    native.namespace.cache_clear()
    try:
        before = native.namespace("sampler_ops")
        assert before == native.namespace("sampler_ops")
        assert re.fullmatch(r"met_sampler_ops_[0-9a-f]{12}", before)
        native.namespace.cache_clear()
        (copy / "sampler_ops.cpp").write_text((copy / "sampler_ops.cpp").read_text() + "\n//\n")
        assert native.namespace("sampler_ops") != before
    finally:
        native.namespace.cache_clear()


def test_python_m_met_lists_the_kernels():
    """`python -m met` is the `met` command; `met kernels list` names this machine's ISA and
    every extension."""
    out = subprocess.run([sys.executable, "-m", "met", "kernels", "list"], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    assert f"ISA {probe().isa}" in out
    for key in native.EXTENSIONS:
        assert key in out


def test_prepare_loads_what_runs_here():
    """The engine's pre-ready build: every extension that runs on this CPU loads (this
    checkout has a compiler; a failure here is what users would see as a slow fallback)."""
    loaded = native.prepare()
    assert loaded and all(loaded.values()), loaded
    assert set(loaded) == {e.key for e in native.runnable()}


def test_a_build_lock_left_by_a_killed_build_is_cleared(tmp_path, monkeypatch):
    """torch waits forever on a lock file whose build died; an old one is removed, a fresh
    one (a build running now in another process) is left alone."""
    import os
    import time

    from met.kernels import native

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    for name, age, kept in (("met_stale_0", native._STALE_LOCK_S + 60, False),
                            ("met_fresh_0", 5, True)):
        (tmp_path / name).mkdir()
        lock = tmp_path / name / "lock"
        lock.touch()
        then = time.time() - age
        os.utime(lock, (then, then))
        native._clear_stale_lock(name)
        assert lock.exists() == kept, name
