"""Shared pytest fixtures.

``tiny_checkpoint(arch) -> Path``: a session-scoped factory that builds (once per session
per arch) a tiny random Hugging Face checkpoint + tokenizer of ``arch`` (see
tests/tiny_models.py for the archs and how they are made decisive) and returns its directory.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# tiny_models lives next to this file; make it importable however pytest imports tests/
# (rootdir-relative packages, importlib mode, or a tests/__init__.py added later).
_TESTS_DIR = str(Path(__file__).resolve().parent)
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)

from tiny_models import ARCHS, build_tiny_checkpoint  # noqa: E402  (needs the path above)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """Factory fixture: ``tiny_checkpoint("qwen3") -> Path`` of a built checkpoint dir."""
    built: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in ARCHS:
            raise ValueError(f"unknown tiny arch {arch!r}; expected one of {ARCHS}")
        if arch not in built:
            built[arch] = build_tiny_checkpoint(arch, tmp_path_factory.mktemp(f"tiny-{arch}"))
        return built[arch]

    return get
