"""transformers' config and tokenizer of a GGUF file, converted once and kept on disk.

transformers builds both from the GGUF metadata with gguf-py, which reads every vocabulary
entry through a numpy view: ~3.5 s for the config and as much again for the tokenizer of the
embedded SmolLM2 (49,152 tokens), every time a model is loaded. Saved with
``save_pretrained`` and read back, they load in ~0.15 s.

An entry is keyed on the file's absolute path, size and modification time and on the
transformers version, so a changed file or a new transformers converts afresh. It lives in
``$MET_CACHE_DIR/gguf-hf/<key>`` (default ``$XDG_CACHE_HOME/met``, else ``~/.cache/met``);
``MET_CACHE_DIR=off`` turns the cache off. An entry is written to a temporary directory and
renamed into place when complete, so a reader never sees half of one; a cache that cannot
be written is logged and skipped.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

import transformers
from transformers import (
    AutoConfig,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

log = logging.getLogger(__name__)

_FORMAT = 1  # bump when what an entry holds changes
_COMPLETE = "met-complete"  # written last: an entry without it is ignored


def cache_root() -> Path | None:
    """Where entries live, or None when ``MET_CACHE_DIR=off``."""
    configured = os.environ.get("MET_CACHE_DIR")
    if configured == "off":
        return None
    if configured:
        return Path(configured) / "gguf-hf"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "met" / "gguf-hf"


def entry_key(path: str) -> str:
    """The file's identity: absolute path, size, mtime, transformers version, format."""
    stat = os.stat(path)
    ident = "\0".join([os.path.abspath(path), str(stat.st_size), str(stat.st_mtime_ns),
                       transformers.__version__, str(_FORMAT)])
    return hashlib.sha256(ident.encode()).hexdigest()[:32]


def load_config_and_tokenizer(path: str, config: PretrainedConfig | None = None
                              ) -> tuple[PretrainedConfig, PreTrainedTokenizerBase]:
    """transformers' config and tokenizer for the GGUF file at ``path``: from the cache when
    it holds this file's entry, else converted from the file (and the entry written).
    ``config``: met's own, for an architecture transformers' GGUF reader does not know
    (its tokenizer is then built without one)."""
    directory, name = os.path.split(os.path.abspath(path))
    root = cache_root()
    entry = None if root is None else root / entry_key(path)
    if entry is not None and (entry / _COMPLETE).is_file():
        try:
            return _named(*_load_saved(entry), directory)
        except Exception as exc:  # an entry damaged after it was written: convert again
            log.warning("GGUF config cache entry %s unreadable (%s); converting the file",
                        entry, exc)
            shutil.rmtree(entry, ignore_errors=True)
    if config is None:
        config = AutoConfig.from_pretrained(directory, gguf_file=name)
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    else:  # AutoTokenizer would read the config (and refuse the architecture) first
        tokenizer = PreTrainedTokenizerFast.from_pretrained(directory, gguf_file=name)
    if entry is not None:
        _save(entry, config, tokenizer)
    return config, tokenizer


def _load_saved(entry: Path) -> tuple[PretrainedConfig, PreTrainedTokenizerBase]:
    return AutoConfig.from_pretrained(entry), AutoTokenizer.from_pretrained(entry)


def _named(config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase, directory: str
           ) -> tuple[PretrainedConfig, PreTrainedTokenizerBase]:
    """The names a conversion from the file gives them (its directory), not the cache's."""
    config._name_or_path = directory
    tokenizer.name_or_path = directory
    return config, tokenizer


def _save(entry: Path, config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase) -> None:
    staging = None
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".partial-", dir=entry.parent))
        config.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / _COMPLETE).write_text("")
        if entry.is_dir() and not (entry / _COMPLETE).is_file():
            shutil.rmtree(entry)  # not one of ours (renames are atomic): replace it
        os.rename(staging, entry)  # atomic; fails if another process got there first
        staging = None
    except OSError as exc:
        if not (entry / _COMPLETE).is_file():
            log.warning("cannot write the GGUF config cache at %s (%s); the next load "
                        "converts the file again (MET_CACHE_DIR moves the cache)", entry, exc)
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
