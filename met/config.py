"""Engine configuration: one frozen, validated dataclass shared by every layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def resolve_dtype(name: str, device: str) -> torch.dtype:
    """Map a dtype name ('auto', 'float32', 'bfloat16', 'float16') to a torch dtype."""
    if name == "auto":
        # float32 is the exact reference on CPU; bfloat16 is the fast path on CUDA.
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"dtype: {name!r} is not one of auto, {', '.join(_DTYPES)}")
    if name == "float16" and not device.startswith("cuda"):
        raise ValueError("dtype: float16 is only supported on CUDA; use float32 or bfloat16 on CPU")
    return _DTYPES[name]


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to know, fixed at start-up.

    kv_cache_memory is in bytes; None sizes the pool to hold max_num_seqs full-length
    sequences (capped at 2 GiB) so a default engine never over-commits a small machine.
    """

    model: str | None = None
    dtype: str = "auto"
    device: str = "cpu"
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    kv_cache_memory: int | None = None
    enable_prefix_caching: bool = True
    cache_dir: str | None = None
    seed: int = 0
    quantization: str | None = None  # "int8" / "int4": weight-only quantized linear layers

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size: must be a positive power of two, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs: must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.block_size:
            raise ValueError(
                f"max_num_batched_tokens: must be >= block_size ({self.block_size}), "
                f"got {self.max_num_batched_tokens}"
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len: must be >= 2, got {self.max_model_len}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory: must be > 0 bytes, got {self.kv_cache_memory}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device: expected 'cpu' or 'cuda[:N]', got {self.device!r}")
        resolve_dtype(self.dtype, self.device)
        if self.quantization not in (None, "int8", "int4"):
            raise ValueError(f"quantization: must be 'int8', 'int4' or None, got "
                             f"{self.quantization!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto" and self.quantization is not None:
            return torch.bfloat16  # the quantized kernels take bfloat16 activations
        return resolve_dtype(self.dtype, self.device)
