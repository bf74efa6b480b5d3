"""moerun.gguf.reader against gguf.GGUFReader as the oracle, and every kind of broken file."""

from __future__ import annotations

import mmap
import pickle
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType as V

from moerun.gguf.reader import GGUFError, GGUFFile, TensorInfo, tensor_nbytes

H = 64  # row length: a multiple of every block size used here
SCALARS = {
    "meta.uint8": (200, V.UINT8),
    "meta.int8": (-100, V.INT8),
    "meta.uint16": (60000, V.UINT16),
    "meta.int16": (-30000, V.INT16),
    "meta.uint32": (4_000_000_000, V.UINT32),
    "meta.int32": (-2_000_000_000, V.INT32),
    "meta.float32": (0.1, V.FLOAT32),
    "meta.uint64": (2**63 + 5, V.UINT64),
    "meta.int64": (-(2**62), V.INT64),
    "meta.float64": (0.1, V.FLOAT64),
    "meta.bool": (True, V.BOOL),
    "meta.text": ("héllo wörld ✓", V.STRING),
}
NUMERIC_ARRAYS = {
    f"meta.array_{t.name.lower()}": ([1, 0, 1, 1, 0] if t == V.BOOL else [1, 2, 3, 100, 7], t)
    for t in (V.UINT8, V.INT8, V.UINT16, V.INT16, V.UINT32, V.INT32, V.FLOAT32, V.BOOL, V.UINT64, V.INT64, V.FLOAT64)
}
STRINGS = ["a", "", "ü", "tok en", "日本語", "Ġthe"]
NESTED_INTS = [[1, 2, 3], [4, 5]]
NESTED_STRINGS = [["x", "yz"], ["ö"]]
QUANTIZED = (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1)
EXPERTS, FFN = 4, 8
LAST_TENSOR = "blk.0.attn_q.weight"


def write_model(path: Path, alignment: int | None = None) -> dict[str, np.ndarray]:
    """Write the test model; return each tensor's float32 source values."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(path, "test")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    for key, (value, value_type) in SCALARS.items():
        writer.add_key_value(key, value, value_type)
    for key, (values, element_type) in NUMERIC_ARRAYS.items():
        writer.add_key_value(key, values, V.ARRAY, sub_type=element_type)
    writer.add_array("meta.strings", STRINGS)
    writer.add_array("meta.nested_ints", NESTED_INTS)
    writer.add_array("meta.nested_strings", NESTED_STRINGS)

    sources: dict[str, np.ndarray] = {}

    def add(name: str, values: np.ndarray, ggml_type: T) -> None:
        sources[name] = values
        if ggml_type == T.F32:
            writer.add_tensor(name, values)
        elif ggml_type == T.F16:
            writer.add_tensor(name, values.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(values, ggml_type), raw_dtype=ggml_type)

    add("test.f32", rng.standard_normal((4, H), dtype=np.float32), T.F32)
    add("test.f16", rng.standard_normal((4, H), dtype=np.float32), T.F16)
    add("test.bf16", rng.standard_normal((4, H), dtype=np.float32), T.BF16)
    for ggml_type in QUANTIZED:
        add(f"test.{ggml_type.name.lower()}", rng.standard_normal((3, H), dtype=np.float32), ggml_type)
    add("token_embd.weight", rng.standard_normal((16, H), dtype=np.float32), T.Q4_0)
    add("blk.0.ffn_gate_exps.weight", rng.standard_normal((EXPERTS, FFN, H), dtype=np.float32), T.Q8_0)
    add(LAST_TENSOR, rng.standard_normal((H, H), dtype=np.float32), T.F16)
    finish(writer)
    return sources


def finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> tuple[Path, dict[str, np.ndarray]]:
    path = tmp_path_factory.mktemp("model") / "model.gguf"
    return path, write_model(path)


@pytest.fixture(scope="module")
def model_path(model) -> Path:
    return model[0]


@pytest.fixture(scope="module")
def model_bytes(model_path) -> bytes:
    return model_path.read_bytes()


@pytest.fixture(scope="module")
def data_end(model_path) -> int:
    """Where the last tensor's bytes end; every shorter file is truncated."""
    oracle = gguf.GGUFReader(model_path)
    return max(t.data_offset + t.n_bytes for t in oracle.tensors)


def find_once(data: bytes, needle: bytes) -> int:
    assert data.count(needle) == 1, needle
    return data.index(needle)


def patched(tmp_path: Path, data: bytes, at: int, new: bytes) -> Path:
    path = tmp_path / "patched.gguf"
    path.write_bytes(data[:at] + new + data[at + len(new) :])
    return path


def tensor_entry(data: bytes, name: str) -> dict[str, int]:
    """Byte positions of the fields of a tensor's index entry."""
    end_of_name = find_once(data, name.encode()) + len(name)
    n_dims = struct.unpack_from("<I", data, end_of_name)[0]
    dims = end_of_name + 4
    return {"n_dims": end_of_name, "dims": dims, "type": dims + 8 * n_dims, "offset": dims + 8 * n_dims + 4}


def value_position(data: bytes, key: str) -> int:
    """Where a metadata entry's value type sits (its value follows)."""
    return find_once(data, key.encode()) + len(key)


def expect_error(path: Path, *phrases: str) -> None:
    with pytest.raises(GGUFError) as caught:
        GGUFFile(path)
    message = str(caught.value)
    assert message.startswith(f"{path}: ")
    assert "\n" not in message
    assert caught.value.path == path and caught.value.problem in message
    for phrase in phrases:
        assert phrase in message, message


def is_view_of_mapping(array: np.ndarray) -> bool:
    base = array
    while isinstance(base, np.ndarray):
        assert not base.flags.owndata
        base = base.base
    return isinstance(base, memoryview) and isinstance(base.obj, mmap.mmap)


# --- agreement with gguf.GGUFReader ---------------------------------------------------


def assert_matches_oracle(ours: GGUFFile, path: Path) -> None:
    oracle = gguf.GGUFReader(path)
    fields = {name: field for name, field in oracle.fields.items() if not name.startswith("GGUF.")}
    assert list(ours.metadata) == list(fields)
    for key, field in fields.items():
        value = ours.metadata[key]
        if field.types[0] == V.ARRAY and len(field.types) > 2:
            continue  # nested arrays: the oracle flattens them; checked against the written values
        if isinstance(value, np.ndarray):
            assert value.dtype == field.parts[field.data[0]].dtype.newbyteorder("<")
            assert value.tolist() == field.contents(), key
        else:
            assert value == field.contents(), key
            assert type(value) is type(field.contents()), key
    assert list(ours.tensors) == [t.name for t in oracle.tensors]
    for expected in oracle.tensors:
        info = ours.tensor(expected.name)
        assert info.shape == tuple(reversed(expected.shape.tolist()))
        assert info.ggml_type == expected.tensor_type
        assert info.offset == expected.data_offset
        assert info.nbytes == expected.n_bytes == tensor_nbytes(info.ggml_type, info.shape)
        assert ours.raw(expected.name).tobytes() == expected.data.tobytes()
        reference = gguf.quants.dequantize(expected.data, expected.tensor_type)
        np.testing.assert_array_equal(ours.dequantize(expected.name), reference)


def test_matches_gguf_reader(model_path):
    with GGUFFile(model_path) as ours:
        assert ours.version == 3 and ours.alignment == 32
        assert_matches_oracle(ours, model_path)


def test_metadata_values_as_written(model_path):
    with GGUFFile(model_path) as f:
        assert f.metadata["general.architecture"] == "test"
        for key, (value, value_type) in SCALARS.items():
            expected = struct.unpack("<f", struct.pack("<f", value))[0] if value_type == V.FLOAT32 else value
            assert f.metadata[key] == expected and type(f.metadata[key]) is type(expected), key
        for key, (values, _) in NUMERIC_ARRAYS.items():
            assert f.metadata[key].tolist() == values, key
        assert f.metadata["meta.strings"] == STRINGS
        assert [a.tolist() for a in f.metadata["meta.nested_ints"]] == NESTED_INTS
        assert f.metadata["meta.nested_strings"] == NESTED_STRINGS


def test_numeric_arrays_are_read_only_views(model_path):
    with GGUFFile(model_path) as f:
        for key in NUMERIC_ARRAYS:
            array = f.metadata[key]
            assert not array.flags.writeable
            assert is_view_of_mapping(array), key


def test_dequantize_close_to_source_values(model):
    path, sources = model
    with GGUFFile(path) as f:
        for name, values in sources.items():
            result = f.dequantize(name)
            assert result.dtype == np.float32 and result.shape == values.shape
            tolerance = 0.02 if f.tensor(name).ggml_type in (T.F16, T.BF16, T.Q8_0) else 0.4
            np.testing.assert_allclose(result, values, atol=tolerance * np.abs(values).max(), err_msg=name)


def test_bf16_decodes_exactly(tmp_path):
    values = np.array([[1.0, -2.5, 3.140625, 0.0] * 8], dtype=np.float32)  # all exact in BF16
    path = tmp_path / "bf16.gguf"
    writer = gguf.GGUFWriter(path, "test")
    writer.add_tensor("w", gguf.quants.quantize(values, T.BF16), raw_dtype=T.BF16)
    finish(writer)
    with GGUFFile(path) as f:
        assert f.raw("w").dtype == np.uint16
        np.testing.assert_array_equal(f.dequantize("w"), values)


def test_raw_views_are_zero_copy_with_documented_dtypes(model_path):
    with GGUFFile(model_path) as f:
        assert f.raw("test.f32").dtype == np.float32 and f.raw("test.f32").shape == (4, H)
        assert f.raw("test.f16").dtype == np.float16
        assert f.raw("test.bf16").dtype == np.uint16
        assert f.raw("test.q4_0").dtype == np.uint8 and f.raw("test.q4_0").shape == (3, H // 32 * 18)
        for name in f.tensors:
            raw = f.raw(name)
            assert not raw.flags.writeable and is_view_of_mapping(raw), name


def test_expert_tensor(model_path):
    name = "blk.0.ffn_gate_exps.weight"
    with GGUFFile(model_path) as f:
        assert f.tensor(name).shape == (EXPERTS, FFN, H)
        full_raw, full = f.raw(name), f.dequantize(name)
        for expert in range(EXPERTS):
            raw = f.raw_expert(name, expert)
            assert is_view_of_mapping(raw)
            assert raw.__array_interface__["data"][0] == full_raw[expert].__array_interface__["data"][0]
            np.testing.assert_array_equal(f.dequantize_expert(name, expert), full[expert])
        with pytest.raises(IndexError):
            f.raw_expert(name, EXPERTS)
        with pytest.raises(IndexError):
            f.dequantize_expert(name, -1)


def test_row_table_lookups(model_path):
    with GGUFFile(model_path) as f:
        rows = [3, 0, 15, 3]
        full = f.dequantize("token_embd.weight")
        np.testing.assert_array_equal(f.row_table("token_embd.weight").lookup(rows), full[rows])
        np.testing.assert_array_equal(f.row_table("test.bf16").lookup(np.array([1])), f.dequantize("test.bf16")[[1]])
        assert f.row_table("token_embd.weight").lookup([]).shape == (0, H)
        with pytest.raises(IndexError):
            f.row_table("token_embd.weight").lookup([16])
        with pytest.raises(IndexError):
            f.row_table("token_embd.weight").lookup([-1])
        with pytest.raises(GGUFError, match="row lookup needs 2 dimensions"):
            f.row_table("blk.0.ffn_gate_exps.weight")


@pytest.mark.parametrize("alignment", [8, 64, 256])
def test_custom_alignment(tmp_path, alignment):
    path = tmp_path / "aligned.gguf"
    write_model(path, alignment=alignment)
    with GGUFFile(path) as f:
        assert f.alignment == alignment
        assert all(info.offset % alignment == 0 for info in f.tensors.values())
        assert_matches_oracle(f, path)


def test_version_2(tmp_path, model_bytes):
    path = patched(tmp_path, model_bytes, 4, struct.pack("<I", 2))
    with GGUFFile(path) as f:
        assert f.version == 2
        assert f.metadata["meta.strings"] == STRINGS
        assert f.tensor(LAST_TENSOR).shape == (H, H)


def test_lookups(model_path):
    with GGUFFile(str(model_path)) as f:
        assert f.path == model_path
        assert f.get("meta.uint8") == 200 and f.get("nope") is None and f.get("nope", 7) == 7
        assert f.require("general.architecture") == "test"
        assert isinstance(f.tensor("test.f32"), TensorInfo)
        assert f.has_tensor("test.f32") and not f.has_tensor("nope")
        with pytest.raises(GGUFError, match=r"missing metadata key 'nope'$"):
            f.require("nope")
        with pytest.raises(GGUFError, match=r"missing tensor 'nope'$"):
            f.tensor("nope")
        with pytest.raises(GGUFError, match="missing tensor 'nope'"):
            f.raw("nope")


def test_views_outlive_close(model_path):
    with GGUFFile(model_path) as f:
        raw = f.raw("test.f32")
        expected = raw.copy()
        array = f.metadata["meta.array_int32"]
    np.testing.assert_array_equal(raw, expected)
    assert array.tolist() == NUMERIC_ARRAYS["meta.array_int32"][0]
    with pytest.raises(GGUFError, match="file is closed"):
        f.raw("test.f32")


def test_invalid_utf8_in_a_value_is_replaced(tmp_path, model_bytes):
    text_start = value_position(model_bytes, "meta.text") + 4 + 8
    with GGUFFile(patched(tmp_path, model_bytes, text_start, b"\xff")) as f:
        assert f.metadata["meta.text"] == "\ufffd" + SCALARS["meta.text"][0][1:]


def test_error_survives_pickling():
    error = pickle.loads(pickle.dumps(GGUFError(Path("m.gguf"), "missing tensor 'x'")))
    assert str(error) == "m.gguf: missing tensor 'x'" and error.problem == "missing tensor 'x'"


def test_tensor_nbytes():
    assert tensor_nbytes(T.F32, (3, 5)) == 60
    assert tensor_nbytes(T.Q4_0, (EXPERTS, FFN, H)) == EXPERTS * FFN * 2 * 18
    with pytest.raises(ValueError, match="block size 32"):
        tensor_nbytes(T.Q8_0, (2, 48))


def test_type_without_dequantizer(tmp_path):
    path = tmp_path / "q8k.gguf"
    writer = gguf.GGUFWriter(path, "test")
    writer.add_tensor("w", np.zeros((2, 292), np.uint8), raw_dtype=T.Q8_K)
    finish(writer)
    with GGUFFile(path) as f:
        assert f.tensor("w").shape == (2, 256)
        with pytest.raises(GGUFError, match="Q8_K, which cannot be dequantized"):
            f.dequantize("w")


# --- broken files ----------------------------------------------------------------------


def test_missing_file(tmp_path):
    expect_error(tmp_path / "nope.gguf", "does not exist")


def test_directory(tmp_path):
    expect_error(tmp_path, "not a regular file")


def test_empty_file(tmp_path):
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    expect_error(path, "empty")


@pytest.mark.parametrize("start", [b"GGML", b"\x7fELF", b"{\"a\": 1}"])
def test_not_gguf(tmp_path, model_bytes, start):
    expect_error(patched(tmp_path, model_bytes, 0, start), "not a GGUF file")


def test_version_1(tmp_path, model_bytes):
    expect_error(patched(tmp_path, model_bytes, 4, struct.pack("<I", 1)), "version 1 is not supported")


@pytest.mark.parametrize("version", [0, 4, 0xFFFF])
def test_unknown_version(tmp_path, model_bytes, version):
    expect_error(patched(tmp_path, model_bytes, 4, struct.pack("<I", version)), f"unsupported GGUF version {version}")


def test_big_endian(tmp_path, model_bytes):
    expect_error(patched(tmp_path, model_bytes, 4, struct.pack(">I", 3)), "big-endian")


@pytest.mark.parametrize(
    ("cut", "phrase"),
    [
        (2, "shorter than the GGUF magic"),
        (6, "version"),
        (12, "tensor count"),
        (20, "metadata count"),
        (24, "cannot fit in the 0 bytes that follow"),
    ],
)
def test_truncated_header(tmp_path, model_bytes, cut, phrase):
    path = tmp_path / "cut.gguf"
    path.write_bytes(model_bytes[:cut])
    expect_error(path, "truncated", phrase)


def test_truncated_in_string_array(tmp_path, model_bytes):
    first_string = value_position(model_bytes, "meta.strings") + 4 + 4 + 8
    last = len(STRINGS) - 1
    cut = first_string + sum(8 + len(s.encode()) for s in STRINGS[:last]) + 8 + 2
    path = tmp_path / "cut.gguf"
    path.write_bytes(model_bytes[:cut])
    expect_error(path, "truncated", f"string #{last} of metadata key 'meta.strings'")


def test_truncated_in_tensor_index(tmp_path, model_bytes):
    cut = tensor_entry(model_bytes, "test.q5_0")["dims"] + 3
    path = tmp_path / "cut.gguf"
    path.write_bytes(model_bytes[:cut])
    expect_error(path, "truncated", "dimension list of tensor 'test.q5_0'")


def test_tensor_data_past_end(tmp_path, model_bytes, data_end):
    path = tmp_path / "cut.gguf"
    path.write_bytes(model_bytes[: data_end - 10])
    expect_error(path, f"tensor '{LAST_TENSOR}' ends at byte {data_end} but the file has {data_end - 10} bytes")


def test_unknown_value_type(tmp_path, model_bytes):
    path = patched(tmp_path, model_bytes, value_position(model_bytes, "meta.uint16"), struct.pack("<I", 42))
    expect_error(path, "metadata key 'meta.uint16' has unknown value type 42")


def test_unknown_array_element_type(tmp_path, model_bytes):
    path = patched(tmp_path, model_bytes, value_position(model_bytes, "meta.strings") + 4, struct.pack("<I", 77))
    expect_error(path, "metadata key 'meta.strings' has an array of unknown value type 77")


def test_unknown_ggml_type(tmp_path, model_bytes):
    path = patched(tmp_path, model_bytes, tensor_entry(model_bytes, "test.f32")["type"], struct.pack("<I", 99))
    expect_error(path, "tensor 'test.f32' has unknown ggml type 99")


def test_absurd_string_length(tmp_path, model_bytes):
    path = patched(tmp_path, model_bytes, value_position(model_bytes, "meta.text") + 4, struct.pack("<Q", 2**62))
    expect_error(path, "truncated", "string of metadata key 'meta.text'")


def test_absurd_length_inside_string_array(tmp_path, model_bytes):
    first = value_position(model_bytes, "meta.strings") + 4 + 4 + 8
    path = patched(tmp_path, model_bytes, first, struct.pack("<Q", 2**63))
    expect_error(path, "truncated", "string #0 of metadata key 'meta.strings'")


def test_absurd_array_count(tmp_path, model_bytes):
    path = patched(tmp_path, model_bytes, value_position(model_bytes, "meta.array_int64") + 8, struct.pack("<Q", 2**60))
    expect_error(path, "truncated or corrupt", f"metadata key 'meta.array_int64' has an array of {2**60} elements")


@pytest.mark.parametrize(("at", "phrase"), [(8, f"{2**64 - 1} tensors"), (16, f"{2**64 - 1} metadata entries")])
def test_absurd_header_counts(tmp_path, model_bytes, at, phrase):
    expect_error(patched(tmp_path, model_bytes, at, struct.pack("<Q", 2**64 - 1)), phrase, "cannot fit")


def test_duplicate_tensor_name(tmp_path, model_bytes):
    path = patched(tmp_path, model_bytes, find_once(model_bytes, b"test.q4_1"), b"test.q4_0")
    expect_error(path, "duplicate tensor 'test.q4_0'")


def test_duplicate_metadata_key(tmp_path, model_bytes):
    path = patched(tmp_path, model_bytes, find_once(model_bytes, b"meta.uint32"), b"meta.uint16")
    expect_error(path, "metadata key 'meta.uint16' appears twice")


def test_misaligned_tensor_offset(tmp_path, model_bytes):
    at = tensor_entry(model_bytes, "test.f16")["offset"]
    offset = struct.unpack_from("<Q", model_bytes, at)[0]
    path = patched(tmp_path, model_bytes, at, struct.pack("<Q", offset + 4))
    expect_error(path, f"tensor 'test.f16' offset {offset + 4} is not a multiple of the alignment 32")


def test_overlapping_tensors(tmp_path, model_bytes):
    at = tensor_entry(model_bytes, "test.f16")["offset"]
    expect_error(patched(tmp_path, model_bytes, at, struct.pack("<Q", 0)), "overlap")


@pytest.mark.parametrize("n_dims", [0, 5, 2**32 - 1])
def test_bad_dimension_count(tmp_path, model_bytes, n_dims):
    path = patched(tmp_path, model_bytes, tensor_entry(model_bytes, "test.f32")["n_dims"], struct.pack("<I", n_dims))
    expect_error(path, f"tensor 'test.f32' has {n_dims} dimensions")


def test_row_not_whole_blocks(tmp_path, model_bytes):
    path = patched(tmp_path, model_bytes, tensor_entry(model_bytes, "test.q4_0")["dims"], struct.pack("<Q", 48))
    expect_error(path, "tensor 'test.q4_0'", "not a multiple of the Q4_0 block size 32")


def test_impossible_dimension(tmp_path, model_bytes):
    at = tensor_entry(model_bytes, "test.f32")["dims"] + 8
    expect_error(patched(tmp_path, model_bytes, at, struct.pack("<Q", 2**64 - 1)), "impossible dimension")


def test_tensor_name_not_utf8(tmp_path, model_bytes):
    path = patched(tmp_path, model_bytes, find_once(model_bytes, b"test.f32"), b"\xfftest.f")
    expect_error(path, "tensor #0 has a name that is not valid UTF-8")


@pytest.mark.parametrize(("alignment", "phrase"), [(48, "power of two"), (0, "power of two"), ("32", "integer")])
def test_bad_alignment_value(tmp_path, alignment, phrase):
    path = tmp_path / "align.gguf"
    writer = gguf.GGUFWriter(path, "test")
    writer.add_key_value("general.alignment", alignment, V.STRING if isinstance(alignment, str) else V.UINT32)
    finish(writer)
    expect_error(path, "general.alignment", phrase)


def test_arrays_nested_too_deep(tmp_path):
    path = tmp_path / "deep.gguf"
    nested: list = [1]
    for _ in range(9):
        nested = [nested]
    writer = gguf.GGUFWriter(path, "test")
    writer.add_array("deep", nested)
    finish(writer)
    expect_error(path, "metadata key 'deep' has arrays nested more than 8 deep")


@pytest.mark.parametrize("fraction", [i / 40 for i in range(40)])
def test_truncation_sweep(tmp_path, model_bytes, data_end, fraction):
    cut = int(fraction * data_end)
    path = tmp_path / "cut.gguf"
    path.write_bytes(model_bytes[:cut])
    expect_error(path)


def test_every_cut_before_the_data_fails_cleanly(tmp_path, model_path, model_bytes, data_end):
    with GGUFFile(model_path) as f:
        data_offset = f.data_offset
    path = tmp_path / "cut.gguf"
    cuts = [*range(data_offset + 1), *range(data_offset + 1, data_end, 7)]
    for cut in cuts:
        path.write_bytes(model_bytes[:cut])
        with pytest.raises(GGUFError):
            GGUFFile(path)
    path.write_bytes(model_bytes[:data_end])
    GGUFFile(path).close()  # only the trailing padding is gone: still complete


def test_random_corruption_fails_cleanly(tmp_path, model_path, model_bytes):
    rng = np.random.default_rng(1)
    with GGUFFile(model_path) as f:
        data_offset = f.data_offset
    path = tmp_path / "corrupt.gguf"
    for _ in range(300):
        data = bytearray(model_bytes)
        for position in rng.integers(0, data_offset, size=rng.integers(1, 4)):
            data[position] = rng.integers(0, 256)
        path.write_bytes(bytes(data))
        try:
            with GGUFFile(path) as f:
                for name in f.tensors:
                    f.raw(name)
        except GGUFError:
            pass
