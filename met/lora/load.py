"""Which reader an adapter path takes: a ``.gguf`` file is llama.cpp's GGUF LoRA, anything
else a PEFT directory (both give a `LoRAAdapter`)."""

from __future__ import annotations

from pathlib import Path

from met.lora.adapter import LoRAAdapter, load_peft
from met.lora.gguf_adapter import load_gguf_lora


def load_adapter(name: str, path: str, shapes: dict[tuple[int, str], tuple[int, int]],
                 max_rank: int, *, head_dim: int | None = None,
                 model_type: str | None = None) -> LoRAAdapter:
    """The adapter at ``path``, checked against the base's ``shapes`` and ``max_rank``;
    ``head_dim`` and ``model_type`` describe the base to a GGUF file (see load_gguf_lora)."""
    if path.endswith(".gguf") and not Path(path).is_dir():
        return load_gguf_lora(name, path, shapes, max_rank, head_dim=head_dim,
                              model_type=model_type)
    return load_peft(name, path, shapes, max_rank)
