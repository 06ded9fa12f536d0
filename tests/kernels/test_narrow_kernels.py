"""The 8-lane (AVX2) variants of the decode-attention and fused-op kernels, on any CPU.

A CPU without AVX-512 runs them and the kernel tests cover them there; a CPU with AVX-512
runs the wide variants instead. Here the kernel tests run once more in a process with
MET_NARROW_KERNELS=1, which makes every CPU take the narrow variants: each must match the
per-request SDPA / ATen references and stay batch-invariant like the wide ones.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent


def test_narrow_variants_pass_the_kernel_tests():
    env = dict(os.environ, MET_NARROW_KERNELS="1")
    tests = [str(HERE / "test_decode_attention.py"), str(HERE / "test_fused_ops.py")]
    # The fallback test builds a broken extension on purpose: nothing narrow to see there.
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "-k", "not falls_back", *tests],
                         env=env, capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "failed" not in run.stdout, run.stdout[-2000:]

