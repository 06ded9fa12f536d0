"""met.loader.gguf_file: the one-pass GGUF reader gives what gguf-py's GGUFReader gives, on the
embedded model's file and on a synthetic file with every metadata type, and refuses broken
files naming them."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from met.loader.gguf_file import read_gguf
from met.loader.resolve import default_model_path


def _smollm2_path() -> str:
    return str(default_model_path())


def _assert_same_as_gguf_py(path: str) -> None:
    reader = gguf.GGUFReader(path)
    ours = read_gguf(path)
    keys = [k for k in reader.fields if not k.startswith("GGUF.")]  # gguf-py's header fields
    assert list(ours.fields) == keys
    for key in keys:
        want, got = reader.fields[key].contents(), ours.fields[key]
        got = got.tolist() if isinstance(got, np.ndarray) else got
        assert got == pytest.approx(want) if isinstance(want, float) else got == want, key
    assert [t.name for t in ours.tensors] == [t.name for t in reader.tensors]
    for want, got in zip(reader.tensors, ours.tensors, strict=True):
        assert got.tensor_type == want.tensor_type and got.shape == tuple(want.shape.tolist())
        assert got.data.dtype == want.data.dtype and got.data.shape == want.data.shape
        assert np.array_equal(got.data.view(np.uint8), np.asarray(want.data).view(np.uint8))


def test_embedded_model_file_reads_as_gguf_py_reads_it():
    _assert_same_as_gguf_py(_smollm2_path())
    vocab = read_gguf(_smollm2_path()).get("tokenizer.ggml.tokens")
    assert len(vocab) == 49152 and vocab[2] == "<|im_end|>"


def test_every_metadata_type_and_tensor_layout(tmp_path):
    path = str(tmp_path / "all.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -5)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -300)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -70000)
    writer.add_float32("t.f32", 0.25)
    writer.add_uint64("t.u64", 1 << 40)
    writer.add_int64("t.i64", -(1 << 40))
    writer.add_float64("t.f64", 1e-300)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo")
    writer.add_string("t.empty", "")
    writer.add_array("t.ints", [1, 2, 3])
    writer.add_array("t.floats", [0.5, -1.5])
    writer.add_array("t.strs", ["a", "", "ü€"])
    rng = np.random.default_rng(0)
    writer.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((2, 4)).astype(np.float16))
    q8 = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32),
                              gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("q8", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    _assert_same_as_gguf_py(path)
    file = read_gguf(path)
    assert file.get("t.u32") == 4_000_000_000 and file.get("t.i64") == -(1 << 40)
    assert file.get("t.str") == "héllo" and file.get("t.strs") == ["a", "", "ü€"]
    assert file.get("t.missing", 7) == 7
    q8_tensor = file.tensors[2]
    assert q8_tensor.shape == (64, 4) and q8_tensor.data.shape == (4, 68)  # 2 blocks of 34 B
    assert np.array_equal(gguf.quants.dequantize(q8_tensor.data, q8_tensor.tensor_type),
                          gguf.quants.dequantize(q8, gguf.GGMLQuantizationType.Q8_0))


def test_broken_files_are_refused_naming_the_file(tmp_path):
    not_gguf = tmp_path / "model.bin"
    not_gguf.write_bytes(b"PK\x03\x04" + bytes(60))
    with pytest.raises(ValueError, match=r"model\.bin: not a GGUF file"):
        read_gguf(not_gguf)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(open(_smollm2_path(), "rb").read(100_000))  # ends inside the vocabulary
    with pytest.raises(ValueError, match=r"cut\.gguf: truncated GGUF file"):
        read_gguf(cut)
    future = tmp_path / "v9.gguf"
    future.write_bytes(b"GGUF" + (9).to_bytes(4, "little") + bytes(16))
    with pytest.raises(ValueError, match="GGUF version 9 is not supported"):
        read_gguf(future)
