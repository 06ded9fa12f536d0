"""Which kernel runs each kind of layer: the linear-method and attention-backend registries.

Each entry says whether it can run a (weight format, quantization, dtype, device) on this
machine's `Capability` and, if not, why. Entries are tried in the order listed here (fastest
first, the plain-PyTorch reference last); the first that can run wins, unless the user forces
one by name (``--linear-backend``, ``--attention-backend``): then it must be able to run, or
the error says why not. The result, a `KernelPlan`, is decided once per engine, logged in
one line and exported in /metrics; the layers receive it as a value.

To add a kernel: add its csrc files to `native.EXTENSIONS`, its entry here (with its
``why_not``), and the weight class or attention function that runs it; the plan test
(tests/kernels/test_registry.py) then runs it against the reference on every model.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from met.kernels import native
from met.kernels.capability import Capability, probe


@dataclass(frozen=True)
class LinearSpec:
    """What a model's projections are: the quantization they run under (None: the
    checkpoint's float weights), the activation dtype and the device."""

    quantization: str | None
    dtype: torch.dtype
    device: str


def _loads(key: str) -> str | None:
    return None if native.load_native_ops(key) is not None else \
        f"the native extension {key} did not build (see the warning logged above)"


def _cpu(spec: LinearSpec) -> str | None:
    return None if spec.device == "cpu" else f"CPU only (device is {spec.device})"


def _needs(cap: Capability, ok: bool, what: str) -> str | None:
    return None if ok else f"this CPU has no {what} (ISA {cap.isa})"


def _runs(why_not: str | None, kernel: str | None) -> str | None:
    """An entry's own reason, else whether its native extension (if any) loads."""
    if why_not is None and kernel is not None:
        return _loads(kernel)
    return why_not


@dataclass(frozen=True)
class LinearMethod:
    """One way to run a model's linear layers."""

    name: str
    quantization: str | None  # the weight form it runs (what --quantization names)
    kernel: str | None  # the native extension it calls (None: PyTorch ops only)
    why_not: Callable[[LinearSpec, Capability], str | None]
    note: str

    def reason(self, spec: LinearSpec, cap: Capability, forced: bool = False) -> str | None:
        """None when this method runs ``spec`` here, else why not."""
        if spec.quantization != self.quantization:
            return (f"runs quantization {self.quantization or 'none'}, the model is "
                    f"{spec.quantization or 'none'}")
        return _runs(self.why_not(spec, cap), self.kernel)


def _bf16_onednn(spec: LinearSpec, cap: Capability) -> str | None:
    if spec.dtype != torch.bfloat16:
        return f"bfloat16 activations only (dtype is {spec.dtype})"
    if not (torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return "oneDNN has no bfloat16 kernels on this CPU"
    return None


LINEAR_METHODS: tuple[LinearMethod, ...] = (
    LinearMethod("w4a8-vnni", "w4a8", "w4a8",
                 lambda s, c: _cpu(s) or _needs(c, c.avx512_vnni, "AVX512-VNNI"),
                 "4-bit blocks x int8 activations, VPDPBUSD (AMX-INT8 tiles from 32 rows)"),
    LinearMethod("w4a8-avx2", "w4a8", "w4a8_avx2",
                 lambda s, c: _cpu(s) or _needs(c, c.avx2, "AVX2/FMA/F16C"),
                 "4-bit blocks x int8 activations, VPMADDUBSW (same bits as w4a8-vnni)"),
    LinearMethod("w4a8-torch", "w4a8", None, lambda s, c: None,
                 "the w4a8 formula in PyTorch ops (reference)"),
    LinearMethod("w8a8-vnni", "w8a8", "w8a8",
                 lambda s, c: _cpu(s) or _needs(c, c.avx512_vnni, "AVX512-VNNI"),
                 "int8 weights x int8 activations GEMV (oneDNN for many rows)"),
    LinearMethod("w8a8-torch", "w8a8", None, lambda s, c: None,
                 "int8 x int8 in PyTorch ops (reference)"),
    LinearMethod("int8-torch", "int8", None, lambda s, c: None,
                 "int8 weight-only: torch's int8 GEMV for few rows, bfloat16 for many"),
    LinearMethod("int4-gemv", "int4", "int4_gemv",
                 lambda s, c: _cpu(s) or _needs(c, c.avx512_bf16, "AVX512-BF16"),
                 "int4 weight-only GEMV for few rows, bfloat16 for many"),
    LinearMethod("int4-torch", "int4", None, lambda s, c: None,
                 "int4 weights dequantized to bfloat16"),
    LinearMethod("gguf-native", "gguf", "gguf_blocks",
                 lambda s, c: _cpu(s) or _needs(c, c.avx2, "AVX2/FMA/F16C"),
                 "the GGUF file's blocks (Q4_K, Q6_K, Q8_0, ...) decoded in cache, float32 "
                 "sums (AVX-512 or AVX2)"),
    LinearMethod("gguf-torch", "gguf", None, lambda s, c: None,
                 "the GGUF file's blocks dequantized by gguf-py on every call (reference)"),
    LinearMethod("bf16-onednn", None, None, lambda s, c: _cpu(s) or _bf16_onednn(s, c),
                 "bfloat16 weights in oneDNN's pre-packed layout"),
    LinearMethod("torch", None, None, lambda s, c: None, "F.linear (reference)"),
)


@dataclass(frozen=True)
class AttentionBackend:
    """One way to run attention over the paged KV cache."""

    name: str
    kernel: str | None
    why_not: Callable[[str, Capability, bool], str | None]  # (device, capability, forced)
    note: str

    def reason(self, device: str, cap: Capability, forced: bool = False) -> str | None:
        """None when this backend runs on ``device`` here (``forced``: by name), else why
        not."""
        return _runs(self.why_not(device, cap, forced), self.kernel)


def _triton(device: str, cap: Capability, forced: bool) -> str | None:
    interpreted = forced and os.environ.get("TRITON_INTERPRET") == "1"
    if not (device.startswith("cuda") or interpreted):
        return (f"CUDA only (device is {device}; with TRITON_INTERPRET=1, "
                "--attention-backend triton runs it on CPU in Triton's interpreter, for tests)")
    if importlib.util.find_spec("triton") is None:
        return "the triton package is not installed (pip install triton)"
    return None


ATTENTION_BACKENDS: tuple[AttentionBackend, ...] = (
    AttentionBackend("cpu-native", "decode_attention",
                     lambda d, c, f: (None if d == "cpu" else f"CPU only (device is {d})")
                     or _needs(c, c.avx2, "AVX2/FMA"),
                     "paged decode attention in C++ (prompt rows on AMX-BF16 tiles where "
                     "the CPU has them)"),
    AttentionBackend("triton", None, _triton,
                     "paged varlen attention in Triton: prefill and decode rows in one "
                     "kernel, int8 / fp8 caches read directly"),
    AttentionBackend("torch", None, lambda d, c, f: None,
                     "gather + scaled_dot_product_attention (reference)"),
)


LORA_BACKENDS: tuple[AttentionBackend, ...] = (
    AttentionBackend("cpu-native", "lora",
                     lambda d, c, f: (None if d == "cpu" else f"CPU only (device is {d})")
                     or _needs(c, c.avx2, "AVX2/FMA"),
                     "each row with its own adapter slot in C++, batch-invariant"),
    AttentionBackend("torch", None, lambda d, c, f: None,
                     "one shrink and one expand matmul per adapter in the step (reference)"),
)


def lora_backend_names() -> list[str]:
    return [b.name for b in LORA_BACKENDS]


def lora_backend(device: str, forced: str = "auto",
                 cap: Capability | None = None) -> AttentionBackend:
    """The LoRA delta's backend (`LORA_BACKENDS`; entries share the attention backends'
    shape: a name, a native extension and why it cannot run)."""
    entry, _ = _choose(LORA_BACKENDS, (device, cap or probe()), forced, "--lora-backend",
                       f"LoRA on {device}")
    return entry


@dataclass(frozen=True)
class KernelPlan:
    """The entries chosen for this engine, plus what each rejected entry lacked."""

    linear: LinearMethod
    attention: AttentionBackend
    rejected: tuple[tuple[str, str], ...] = ()

    @property
    def native_attention(self) -> bool:
        return self.attention.kernel is not None

    def describe(self) -> str:
        return (f"kernels: linear {self.linear.name} ({self.linear.note}); attention "
                f"{self.attention.name} ({self.attention.note}); CPU {probe().isa}")

    def labels(self) -> dict[str, str]:
        """For the /metrics info gauge."""
        return {"linear": self.linear.name, "attention": self.attention.name,
                "cpu_isa": probe().isa}


def linear_method_names() -> list[str]:
    return [m.name for m in LINEAR_METHODS]


def attention_backend_names() -> list[str]:
    return [b.name for b in ATTENTION_BACKENDS]


def forced_quantization(name: str) -> str | None:
    """The quantization a forced linear method runs (for --quantization auto)."""
    return _by_name(LINEAR_METHODS, name, "--linear-backend").quantization


def _by_name(entries, name, flag):
    for entry in entries:
        if entry.name == name:
            return entry
    raise ValueError(f"{flag}: unknown {name!r}; one of auto, "
                     f"{', '.join(e.name for e in entries)}")


def _choose(entries, args, forced: str, flag: str, what: str):
    rejected = []
    if forced != "auto":
        entry = _by_name(entries, forced, flag)
        why = entry.reason(*args, forced=True)
        if why is not None:
            raise ValueError(f"{flag} {forced}: cannot run {what} here: {why}")
        return entry, rejected
    for entry in entries:
        why = entry.reason(*args)
        if why is None:
            return entry, rejected
        rejected.append((entry.name, why))
    raise AssertionError(f"no {what} entry runs; the reference entry should")  # unreachable


def plan(spec: LinearSpec, linear: str = "auto", attention: str = "auto",
         cap: Capability | None = None) -> KernelPlan:
    """The first entry of each registry that runs ``spec`` here (or the forced ones)."""
    cap = cap or probe()
    lin, rej1 = _choose(LINEAR_METHODS, (spec, cap), linear, "--linear-backend",
                        f"quantization {spec.quantization or 'none'} in "
                        f"{str(spec.dtype).removeprefix('torch.')} on {spec.device}")
    att, rej2 = _choose(ATTENTION_BACKENDS, (spec.device, cap), attention,
                        "--attention-backend", f"attention on {spec.device}")
    rejected = tuple((n, w) for n, w in rej1 + rej2 if not w.startswith("runs quantization"))
    return KernelPlan(lin, att, rejected)
