"""Engine configuration: one frozen, validated dataclass shared by every layer."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields

import torch

_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

# Quantized linear layers: int8 / int4 weight-only (bfloat16 activations), w8a8 int8 weights
# and int8 activations per row (met/layers/w8a8.py), w4a8 Q4_1-form weights and int8
# activations per 32-value block (met/layers/w4a8.py), gguf the GGUF file's own blocks (Q4_K,
# Q6_K, Q8_0, ...) kept as they are, float32 sums (met/kernels/gguf_blocks.py).
QUANTIZATIONS = ("int8", "int4", "w8a8", "w4a8", "gguf")
# What --quantization / EngineConfig.quantization accept; "none" (or None) turns it off and
# "auto" lets the loader decide from the model file (met/loader/auto_quant.py).
QUANTIZATION_CHOICES = ("auto", "none", *QUANTIZATIONS)
# What --kv-cache-dtype / EngineConfig.kv_cache_dtype accept: "model" stores the KV cache in the
# model's dtype, "bf16" in bfloat16 (a bfloat16 model's), "int8" / "fp8" as int8 / float8 e4m3
# rows with a float32 scale each (met/kernels/kv_cache.py), "auto" the model's dtype except
# int8 under an auto-chosen float32 + w4a8 (EngineCore decides).
KV_CACHE_DTYPES = ("auto", "model", "bf16", "int8", "fp8")
POOLING_TYPES = ("last", "mean")  # how an embedding pools its prompt (met.sampling.pooling)


def resolve_device(name: str) -> str:
    """--device as it runs: auto is cuda where torch sees a GPU, else cpu. A CUDA device that
    cannot run is an error, never a silent fall back to the CPU."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return name
    if not (name == "cuda" or (name.startswith("cuda:") and name[5:].isdigit())):
        raise ValueError(f"device: expected auto, cpu, cuda or cuda:N, got {name!r}")
    if not torch.cuda.is_available():
        built = (f"built for CUDA {torch.version.cuda}" if torch.version.cuda
                 else "a CPU-only build")
        raise ValueError(f"device: {name} asked for, but torch ({torch.__version__}, {built}) "
                         "sees no CUDA device; use --device cpu (or auto)")
    index = int(name[5:]) if ":" in name else 0
    if index >= torch.cuda.device_count():
        raise ValueError(f"device: {name} asked for, but torch sees "
                         f"{torch.cuda.device_count()} CUDA device(s)")
    return name


def cpu_has_native_bf16() -> bool:
    """True when this CPU multiplies bfloat16 matrices in hardware (AMX-BF16 or AVX512-BF16),
    where bfloat16 is faster than float32; without them torch emulates it and it is slower."""
    caps = torch.cpu.get_capabilities()
    return bool(caps.get("amx_bf16") or caps.get("avx512_bf16"))


def resolve_dtype(name: str, device: str) -> torch.dtype:
    """Map a dtype name ('auto', 'float32', 'bfloat16', 'float16') to a torch dtype.

    auto is the fastest correct choice for the device: bfloat16 on CUDA and on CPUs with
    native bfloat16 matrix units, float32 (the exact reference) on other CPUs.
    """
    if name == "auto":
        if device.startswith("cuda") or cpu_has_native_bf16():
            return torch.bfloat16
        return torch.float32
    if name not in _DTYPES:
        raise ValueError(f"dtype: {name!r} is not one of auto, {', '.join(_DTYPES)}")
    if name == "float16" and not device.startswith("cuda"):
        raise ValueError("dtype: float16 is only supported on CUDA; use float32 or bfloat16 on CPU")
    return _DTYPES[name]


SPEC_METHODS = ("ngram", "suffix", "draft_model", "self")


@dataclass(frozen=True)
class SpeculativeConfig:
    """--speculative-config: vLLM's JSON keys where they exist.

    - method: "ngram" (prompt lookup: the longest suffix of prompt + output, of
      prompt_lookup_min..prompt_lookup_max tokens, seen before in this request), "suffix"
      (the same match over this request and the last ``suffix_cache_requests`` finished
      ones), "draft_model" (``model``, a smaller checkpoint with the same tokenizer, drafts
      greedily), "self" (the target's own first ``num_draft_layers`` layers and LM head
      draft: no second model). Left out: draft_model when ``model`` is set, else ngram.
    - num_speculative_tokens: drafted tokens per step at most (1..16).
    - gate: measure delivered tok/s with and without speculation per batch-width bucket and
      speculate only where it pays (off: always speculate).
    """

    method: str | None = None
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 16
    suffix_cache_requests: int = 64
    model: str | None = None
    num_draft_layers: int | None = None  # "self": None is a quarter of the layers
    gate: bool = True

    def __post_init__(self) -> None:
        if self.method is None:
            object.__setattr__(self, "method", "draft_model" if self.model else "ngram")
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative_config.method: must be one of "
                             f"{', '.join(SPEC_METHODS)}, got {self.method!r}")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("speculative_config.model: a draft checkpoint is needed by "
                             "method draft_model and taken by no other method")
        if self.num_draft_layers is not None and self.method != "self":
            raise ValueError("speculative_config.num_draft_layers: only for method self")
        if self.num_draft_layers is not None and self.num_draft_layers < 1:
            raise ValueError(f"speculative_config.num_draft_layers: must be >= 1, got "
                             f"{self.num_draft_layers}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"speculative_config.num_speculative_tokens: must be in [1, 16], "
                             f"got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min/max: need 1 <= min <= max, "
                             f"got {self.prompt_lookup_min}, {self.prompt_lookup_max}")
        if self.suffix_cache_requests < 0:
            raise ValueError(f"speculative_config.suffix_cache_requests: must be >= 0, got "
                             f"{self.suffix_cache_requests}")

    @classmethod
    def parse(cls, value: str | Mapping | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """From --speculative-config's JSON (or a mapping); None or "" is off."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            if not value.strip():
                return None
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config: not valid JSON ({e})") from None
        if not isinstance(value, Mapping):
            raise ValueError("speculative_config: must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown}; known: "
                             f"{', '.join(sorted(known))}")
        for key, v in value.items():
            want = bool if key == "gate" else str if key in ("method", "model") else int
            if v is not None and (not isinstance(v, want) or (want is int
                                                                and isinstance(v, bool))):
                raise ValueError(f"speculative_config.{key}: must be {want.__name__}, got "
                                 f"{v!r}")
        return cls(**value)


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to know, fixed at start-up.

    kv_cache_memory is in bytes; None sizes the pool to hold max_num_seqs full-length
    sequences (capped at 2 GiB) so a default engine never over-commits a small machine.
    """

    model: str | None = None
    dtype: str = "auto"
    # "auto": CUDA when torch sees a GPU, else the CPU (resolved here, once)
    device: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    kv_cache_memory: int | None = None
    enable_prefix_caching: bool = True
    cache_dir: str | None = None
    seed: int = 0
    # "int8" / "int4": weight-only quantized linear layers; "w8a8" / "w4a8": int8 / 4-bit
    # weights and int8 activations; "none" or None: off; "auto": the loader picks w4a8 for a
    # Q4_0/Q4_1 GGUF on a CPU with AVX512-VNNI or AVX2 (in float32 where --dtype auto chose
    # it), int4 without them when serving at most 16 sequences in bfloat16, else none (see
    # met/loader/auto_quant)
    quantization: str | None = "auto"
    # "auto": the KV cache in the model's dtype; "int8": int8 rows with a float32 scale each
    # (met/layers/kv_cache.py), about half the bytes per token
    kv_cache_dtype: str = "auto"
    # Kernel entries forced by name (met/kernels/registry.py); "auto": the first that runs.
    linear_backend: str = "auto"
    attention_backend: str = "auto"
    # Speculative decoding (SpeculativeConfig, or its JSON); None: off.
    speculative_config: SpeculativeConfig | None = None
    # LoRA adapters (met/lora): name -> PEFT directory or GGUF LoRA file, served beside the
    # base model; max_loras of them resident at once (slots), each of rank <= max_lora_rank.
    # Giving lora_modules turns enable_lora on.
    enable_lora: bool = False
    lora_modules: Mapping[str, str] | None = None
    max_loras: int = 4
    max_lora_rank: int = 16
    # Adapters kept in memory (LRU; the others read from their path again when asked for);
    # None: all of them. The LoRA delta's kernel (registry.LORA_BACKENDS); "auto": the first
    # that runs.
    max_cpu_loras: int | None = None
    lora_backend: str = "auto"
    # Embeddings (/v1/embeddings, LLM.embed) when a request does not say: "last" token or
    # "mean" over the prompt's final-norm hidden states, and whether to L2-normalize.
    pooling: str = "last"
    normalize_embeddings: bool = True
    # Hybrid state-space models: how many prefix-cache snapshots of the recurrent state (one
    # per cached block boundary, LRU) to keep; None: 4 x max_num_seqs (0 without prefix
    # caching). Each takes one request's state of every mixer layer.
    state_snapshots: int | None = None

    def __post_init__(self) -> None:
        if self.lora_modules:
            object.__setattr__(self, "lora_modules", dict(self.lora_modules))
            object.__setattr__(self, "enable_lora", True)
        if self.max_loras < 1:
            raise ValueError(f"max_loras: must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank: must be >= 1, got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras: must be >= max_loras ({self.max_loras}), got "
                             f"{self.max_cpu_loras}")
        object.__setattr__(self, "speculative_config",
                           SpeculativeConfig.parse(self.speculative_config))
        if self.pooling not in POOLING_TYPES:
            raise ValueError(f"pooling: must be one of {', '.join(POOLING_TYPES)}, got "
                             f"{self.pooling!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size: must be a positive power of two, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs: must be >= 1, got {self.max_num_seqs}")
        if self.state_snapshots is not None and self.state_snapshots < 0:
            raise ValueError(f"state_snapshots: must be >= 0, got {self.state_snapshots}")
        if self.max_num_batched_tokens < self.block_size:
            raise ValueError(
                f"max_num_batched_tokens: must be >= block_size ({self.block_size}), "
                f"got {self.max_num_batched_tokens}"
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len: must be >= 2, got {self.max_model_len}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory: must be > 0 bytes, got {self.kv_cache_memory}")
        object.__setattr__(self, "device", resolve_device(self.device))
        resolve_dtype(self.dtype, self.device)
        if self.quantization is not None and self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(f"quantization: must be one of {', '.join(QUANTIZATION_CHOICES)} "
                             f"(or None), got {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype: must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.quantization == "none":
            object.__setattr__(self, "quantization", None)  # one spelling of "off" downstream
        from met.kernels import registry  # torch-only module; kept out of config's import

        for flag, value, names in (
                ("linear_backend", self.linear_backend, registry.linear_method_names()),
                ("attention_backend", self.attention_backend,
                 registry.attention_backend_names()),
                ("lora_backend", self.lora_backend, registry.lora_backend_names())):
            if value != "auto" and value not in names:
                raise ValueError(f"{flag}: must be auto or one of {', '.join(names)}, "
                                 f"got {value!r}")
        if self.linear_backend != "auto":
            forced = registry.forced_quantization(self.linear_backend)
            if self.quantization == "auto":
                object.__setattr__(self, "quantization", forced)
            elif self.quantization != forced:
                raise ValueError(f"linear_backend: {self.linear_backend} runs quantization "
                                 f"{forced or 'none'}, but quantization is "
                                 f"{self.quantization or 'none'}")

    @property
    def torch_dtype(self) -> torch.dtype:
        # The weight-only and w8a8 kernels take bfloat16 activations; w4a8's take float32
        # too, and gguf's sum in float32 either way, so for those auto stays the machine's
        # choice (float32 where bfloat16 is emulated).
        if (self.dtype == "auto" and self.quantization in QUANTIZATIONS
                and self.quantization not in ("w4a8", "gguf")):
            return torch.bfloat16
        return resolve_dtype(self.dtype, self.device)
