"""Read a Hugging Face checkpoint directory: config, tokenizer and *.safetensors weights."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open


def iter_safetensors(directory: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) from every *.safetensors shard, one tensor at a time."""
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory} has no *.safetensors files")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118  (safe_open is not a dict)
                yield name, f.get_tensor(name)


def generation_eos_ids(directory: Path) -> list[int]:
    """EOS ids from generation_config.json (models often list several there)."""
    path = directory / "generation_config.json"
    if not path.is_file():
        return []
    return _as_id_list(json.loads(path.read_text()).get("eos_token_id"))


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def config_eos_ids(config: Any) -> list[int]:
    return _as_id_list(getattr(config, "eos_token_id", None))
