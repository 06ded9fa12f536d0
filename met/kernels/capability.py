"""What this machine can run: probed once, returned as one frozen value.

Every choice of kernel path reads this value (`probe()`); nothing else in met's Python asks
the CPU what it has. The C++ side has one header of checks (`csrc/met_cpu.h`): the guards
that refuse to run an op on a CPU without its instructions (a wrong choice fails loudly
instead of faulting) and the lane width the clones take.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

# The flags met's kernels care about, by their /proc/cpuinfo names.
KNOWN_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq", "avx512vl",
               "avx512_vnni",
               "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")


@dataclass(frozen=True)
class Capability:
    """The machine's instruction sets, cores and devices."""

    arch: str  # platform.machine(): x86_64, aarch64, ...
    cpu_model: str
    flags: frozenset[str]  # a subset of KNOWN_FLAGS; AMX only where the OS granted its tiles
    cores: int  # CPUs this process may run on
    torch_cpu: str  # torch's own dispatch level (DEFAULT, AVX2, AVX512, ...)
    cuda_devices: tuple[str, ...]  # names of the CUDA devices torch sees

    def has(self, *flags: str) -> bool:
        return all(f in self.flags for f in flags)

    @property
    def avx2(self) -> bool:
        return self.has("avx2", "fma", "f16c")

    @property
    def avx512_vnni(self) -> bool:
        """AVX-512 (F, BW, DQ, VL) with VNNI: the wide integer kernels."""
        return self.has("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni")

    @property
    def avx512_bf16(self) -> bool:
        return self.has("avx512f", "avx512bw", "avx512_bf16")

    @property
    def amx_int8(self) -> bool:
        return self.avx512_vnni and self.has("amx_tile", "amx_int8")

    @property
    def amx_bf16(self) -> bool:
        return self.amx_int8 and self.avx512_bf16 and self.has("amx_bf16")

    @property
    def isa(self) -> str:
        """The widest ISA level met's CPU kernels use here, for logs and `met doctor`."""
        if self.amx_bf16:
            return "amx"
        if self.avx512_vnni:
            return "avx512-vnni"
        if self.avx2:
            return "avx2"
        return "none"

    def describe(self) -> str:
        cuda = ", ".join(self.cuda_devices) or "none"
        return (f"{self.cpu_model or self.arch}, {self.cores} cores, ISA {self.isa} "
                f"({' '.join(sorted(self.flags)) or 'no SIMD flags met uses'}); torch CPU "
                f"level {self.torch_cpu}; CUDA: {cuda}")


def _cpuinfo() -> tuple[str, set[str]]:
    path = Path("/proc/cpuinfo")
    if not path.exists():
        return "", set()
    model, flags = "", set()
    for line in path.read_text(errors="replace").splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    return model, flags


def _torch_flags(level: str) -> set[str]:
    """Without /proc/cpuinfo (not Linux): what torch's dispatch level implies."""
    if level.startswith("AVX512"):
        return {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq", "avx512vl"}
    if level == "AVX2":
        return {"avx2", "fma", "f16c"}
    return set()


@functools.cache
def probe() -> Capability:
    """This machine's `Capability` (computed on the first call of the process)."""
    level = torch.backends.cpu.get_cpu_capability()
    model, flags = _cpuinfo()
    if not flags:
        flags = _torch_flags(level)
    flags &= set(KNOWN_FLAGS)
    # AMX tiles need the kernel's permission per process (arch_prctl); torch asks for it.
    if "amx_tile" in flags and not _amx_granted():
        flags -= {"amx_tile", "amx_int8", "amx_bf16"}
    if os.environ.get("MET_NARROW_KERNELS") == "1":  # csrc/met_simd.h reads it too
        flags -= {f for f in flags if f.startswith(("avx512", "amx"))}
    if os.environ.get("MET_CPU_FLAGS_OFF"):  # pretend a smaller CPU (comma-separated flags)
        flags -= set(os.environ["MET_CPU_FLAGS_OFF"].split(","))
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    cuda = tuple(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())) \
        if torch.cuda.is_available() else ()
    return Capability(platform.machine(), model, frozenset(flags), cores, level, cuda)


def _amx_granted() -> bool:
    try:
        return bool(torch._C._cpu._init_amx())
    except (AttributeError, RuntimeError):
        return False
