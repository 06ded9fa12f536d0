"""Which models a `met serve --models-dir DIR` serves, and under which names.

As llama.cpp's router mode: every checkpoint directory in DIR (it has config.json, or exactly
one .gguf file) is served under the directory's name, every .gguf file under its file name
without ``.gguf``. ``--models`` adds paths or HF-cache ids beside the dir (an id keeps its
own name, a path the name its directory or file gives). Names are checked once, at startup:
two models under one name is an error that names both.
"""

from __future__ import annotations

import os
from pathlib import Path

from met.loader.resolve import resolve_model


def model_name_of(arg: str) -> str:
    """The name a ``--models`` entry is served under: a path's directory or file stem, an
    HF-cache id as it was given."""
    path = Path(arg).expanduser()
    if path.exists():
        named = Path(os.path.abspath(path))  # "." and "x/" get a name; links keep theirs
        return named.stem if named.is_file() else named.name
    return arg


def models_in_dir(models_dir: str) -> dict[str, str]:
    """name → path of each model directly in ``models_dir`` (hidden entries skipped)."""
    root = Path(models_dir).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(f"--models-dir: {models_dir!r} is not a directory")
    found: dict[str, str] = {}
    for entry in sorted(root.iterdir()):
        if entry.name.startswith("."):
            continue
        if entry.is_file() and entry.suffix == ".gguf":
            name = entry.stem
        elif entry.is_dir() and ((entry / "config.json").is_file()
                                 or len(list(entry.glob("*.gguf"))) == 1):
            name = entry.name
        else:
            continue
        _add(found, name, str(entry), "--models-dir")
    return found


def collect_models(models_dir: str | None, extra: list[str], cache_dir: str | None
                   ) -> dict[str, str]:
    """Every model the router serves: ``models_dir``'s and ``extra``'s (each resolved now,
    so a typo fails at startup, not at the first request). name → what the loader gets."""
    found = models_in_dir(models_dir) if models_dir else {}
    for arg in extra:
        resolve_model(arg, cache_dir)  # raises FileNotFoundError saying where it looked
        _add(found, model_name_of(arg), arg, "--models")
    if not found:
        raise FileNotFoundError(f"--models-dir: no model in {models_dir!r} (a directory with "
                                "config.json or one .gguf file, or a .gguf file)")
    return found


def _add(found: dict[str, str], name: str, path: str, flag: str) -> None:
    if name in found:
        raise ValueError(f"{flag}: two models would be served as {name!r}: {found[name]} and "
                         f"{path}; rename one")
    found[name] = path
