"""met.loader.gguf_hf_cache: transformers' config and tokenizer of a GGUF file, converted
once and read back from disk, must behave exactly like a fresh conversion; a changed file,
a damaged entry or a cache that cannot be written must never give a wrong or no model."""

from __future__ import annotations

import copy
import logging
import os
from pathlib import Path

import pytest
import transformers

from met.loader import gguf_hf_cache
from met.loader.gguf_hf_cache import cache_root, entry_key, load_config_and_tokenizer
from met.loader.resolve import default_model_path

MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Ünïcode, emoji 🚀 and <|im_end|> in text?"}]
TEXTS = ["Hello world", "  leading spaces\nand\ttabs", "<|im_start|>user\nhi<|im_end|>",
         MESSAGES[1]["content"], "数字 12345 and code: def f(x): return x**2"]


@pytest.fixture(scope="module")
def smollm2() -> str:
    return str(default_model_path())


@pytest.fixture(scope="module")
def converted(smollm2):
    """A fresh conversion of the embedded model's file by transformers, no cache."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MET_CACHE_DIR", "off")
        return load_config_and_tokenizer(smollm2)


class _CountingAuto:
    """Stands in for AutoConfig / AutoTokenizer: a conversion from the GGUF file (gguf_file
    given) is counted and answered with a copy of `converted`'s; reading a saved entry is
    passed through to transformers."""

    def __init__(self, real, result):
        self.real, self.result, self.conversions = real, result, 0

    def from_pretrained(self, directory, gguf_file=None, **kwargs):
        if gguf_file is None:
            return self.real.from_pretrained(directory, **kwargs)
        self.conversions += 1
        return copy.deepcopy(self.result)


@pytest.fixture
def conversions(monkeypatch, converted):
    config, tokenizer = converted
    fake_config = _CountingAuto(transformers.AutoConfig, config)
    fake_tokenizer = _CountingAuto(transformers.AutoTokenizer, tokenizer)
    monkeypatch.setattr(gguf_hf_cache, "AutoConfig", fake_config)
    monkeypatch.setattr(gguf_hf_cache, "AutoTokenizer", fake_tokenizer)
    return lambda: (fake_config.conversions, fake_tokenizer.conversions)


def _assert_same(got, expected) -> None:
    (config, tokenizer), (config0, tokenizer0) = got, expected
    assert config.to_dict() == config0.to_dict()
    assert type(tokenizer) is type(tokenizer0) and len(tokenizer) == len(tokenizer0)
    assert tokenizer.name_or_path == tokenizer0.name_or_path
    assert tokenizer.all_special_tokens == tokenizer0.all_special_tokens
    assert (tokenizer.eos_token_id, tokenizer.bos_token_id, tokenizer.pad_token_id) == (
        tokenizer0.eos_token_id, tokenizer0.bos_token_id, tokenizer0.pad_token_id)
    for text in TEXTS:
        ids = tokenizer(text)["input_ids"]
        assert ids == tokenizer0(text)["input_ids"], text
        assert tokenizer.decode(ids) == tokenizer0.decode(ids) == text
    assert tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) \
        == tokenizer0.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)


def test_second_load_reads_the_entry_and_behaves_like_a_conversion(
        smollm2, converted, tmp_path, monkeypatch):
    monkeypatch.setenv("MET_CACHE_DIR", str(tmp_path))
    first = load_config_and_tokenizer(smollm2)  # transformers' own conversion, then saved
    entry = tmp_path / "gguf-hf" / entry_key(smollm2)
    assert (entry / "met-complete").is_file() and (entry / "tokenizer.json").is_file()
    _assert_same(first, converted)
    calls = []
    real = gguf_hf_cache._load_saved
    monkeypatch.setattr(gguf_hf_cache, "_load_saved", lambda e: calls.append(e) or real(e))
    second = load_config_and_tokenizer(smollm2)
    assert calls == [entry]
    _assert_same(second, converted)
    assert second[0]._name_or_path == os.path.dirname(smollm2)  # not the cache's directory


def test_the_key_follows_the_file_and_transformers(tmp_path, monkeypatch):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF" + bytes(60))
    key = entry_key(str(path))
    os.utime(path, ns=(1_000_000_000, 1_000_000_000))
    touched = entry_key(str(path))
    path.write_bytes(b"GGUF" + bytes(61))
    os.utime(path, ns=(1_000_000_000, 1_000_000_000))
    grown = entry_key(str(path))
    monkeypatch.setattr(transformers, "__version__", "0.0.1")
    other_transformers = entry_key(str(path))
    assert len({key, touched, grown, other_transformers}) == 4


def test_entry_is_written_once_then_read(smollm2, converted, conversions, tmp_path,
                                         monkeypatch):
    monkeypatch.setenv("MET_CACHE_DIR", str(tmp_path))
    _assert_same(load_config_and_tokenizer(smollm2), converted)
    _assert_same(load_config_and_tokenizer(smollm2), converted)
    assert conversions() == (1, 1)
    assert [p.name for p in (tmp_path / "gguf-hf").iterdir()] == [entry_key(smollm2)]


def test_a_directory_without_the_marker_is_replaced(smollm2, converted, conversions,
                                                    tmp_path, monkeypatch):
    monkeypatch.setenv("MET_CACHE_DIR", str(tmp_path))
    entry = tmp_path / "gguf-hf" / entry_key(smollm2)
    entry.mkdir(parents=True)
    (entry / "config.json").write_text("{ not json")
    _assert_same(load_config_and_tokenizer(smollm2), converted)
    assert (entry / "met-complete").is_file()
    _assert_same(load_config_and_tokenizer(smollm2), converted)
    assert conversions() == (1, 1)


def test_a_damaged_entry_is_converted_again_and_rewritten(smollm2, converted, conversions,
                                                          tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("MET_CACHE_DIR", str(tmp_path))
    load_config_and_tokenizer(smollm2)
    entry = tmp_path / "gguf-hf" / entry_key(smollm2)
    (entry / "config.json").write_text("{ not json")
    with caplog.at_level(logging.WARNING, logger="met.loader.gguf_hf_cache"):
        _assert_same(load_config_and_tokenizer(smollm2), converted)
    assert "unreadable" in caplog.text and str(entry) in caplog.text
    _assert_same(load_config_and_tokenizer(smollm2), converted)
    assert conversions() == (2, 2)


def test_a_cache_that_cannot_be_written_still_loads(smollm2, converted, conversions, tmp_path,
                                                    monkeypatch, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("MET_CACHE_DIR", str(blocker))  # mkdir under a file fails
    with caplog.at_level(logging.WARNING, logger="met.loader.gguf_hf_cache"):
        _assert_same(load_config_and_tokenizer(smollm2), converted)
    assert "cannot write the GGUF config cache" in caplog.text and "MET_CACHE_DIR" in caplog.text
    assert conversions() == (1, 1)


def test_off_converts_every_time_and_writes_nothing(smollm2, converted, conversions, tmp_path,
                                                    monkeypatch):
    monkeypatch.setenv("MET_CACHE_DIR", "off")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_root() is None
    _assert_same(load_config_and_tokenizer(smollm2), converted)
    _assert_same(load_config_and_tokenizer(smollm2), converted)
    assert conversions() == (2, 2) and list(tmp_path.iterdir()) == []


def test_default_location(monkeypatch, tmp_path):
    monkeypatch.delenv("MET_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_root() == Path(tmp_path) / "met" / "gguf-hf"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_root() == Path.home() / ".cache" / "met" / "gguf-hf"
