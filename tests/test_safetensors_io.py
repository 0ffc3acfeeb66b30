"""safetensors files -> one region -> the same files, and hostile headers."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorxfer import Manifest, TensorRegion
from tensorxfer.safetensors_io import (
    FILES_KEY,
    FileFormatError,
    check_name,
    load_files,
    parse_header,
    read_header,
    write_files,
)

safetensors_numpy = pytest.importorskip("safetensors.numpy", reason="cross-check needs the safetensors package")


def sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def write_raw(path: Path, header: dict | bytes, data: bytes = b"") -> Path:
    head = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(head)) + head + data)
    return path


def make_model(d: Path, shards: int = 2) -> list[Path]:
    rng = np.random.default_rng(1)
    paths, weight_map = [], {}
    for s in range(shards):
        tensors = {f"s{s}.w{i}": rng.standard_normal((17 + i, 3)).astype(np.float32) for i in range(5)}
        tensors[f"s{s}.half"] = np.arange(11, dtype=np.float16)
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        safetensors_numpy.save_file(tensors, str(d / name), metadata={"format": "np", "shard": str(s)})
        paths.append(d / name)
        weight_map.update(dict.fromkeys(tensors, name))
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return paths


def test_roundtrip_is_byte_identical(tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    make_model(src)
    with load_files([src]) as region:
        files = json.loads(region.manifest.metadata[FILES_KEY])
        assert [f["name"] for f in files][-1] == "model.safetensors.index.json"
        written = write_files(region, out)
    assert sorted(p.name for p in written) == sorted(p.name for p in src.iterdir())
    for p in src.iterdir():
        assert sha(p) == sha(out / p.name)
    assert not [p for p in out.iterdir() if p.name.startswith(".tensorxfer-")]


def test_region_holds_the_real_tensors(tmp_path):
    paths = make_model(tmp_path, shards=1)
    ref = safetensors_numpy.load_file(str(paths[0]))
    with load_files(paths) as region:
        views = region.tensors()
        for k, v in ref.items():
            assert np.array_equal(views[k], v)
        del views


def test_unknown_dtype_travels_as_raw_bytes(tmp_path):
    p = write_raw(tmp_path / "x.safetensors",
                  {"q": {"dtype": "F4", "shape": [4], "data_offsets": [0, 2]},
                   "__metadata__": {"a": "b"}}, b"\x12\x34")
    with load_files([p]) as region:
        assert region.manifest["q"].dtype == "U8"
        write_files(region, tmp_path / "out")
    assert sha(p) == sha(tmp_path / "out" / "x.safetensors")


def test_header_with_padding_and_odd_order_is_kept_verbatim(tmp_path):
    head = b'{"b":{"dtype":"U8","shape":[2],"data_offsets":[3,5]},  "a":{"dtype":"U8","shape":[3],' \
           b'"data_offsets":[0,3]}}' + b"    "
    p = write_raw(tmp_path / "odd.safetensors", head, b"abcde")
    with load_files([p]) as region:
        assert region.manifest.names == ("a", "b")
        write_files(region, tmp_path / "out")
    assert (tmp_path / "out" / "odd.safetensors").read_bytes() == p.read_bytes()


HOSTILE = [
    (b"\xff" * 8, b""),                                                   # absurd length
    (struct.pack("<Q", 100), b"{}"),                                     # length beyond the file
    (struct.pack("<Q", 2), b"[]"),                                       # not an object
    (None, {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}),          # size mismatch
    (None, {"a": {"dtype": "U8", "shape": [2], "data_offsets": [1, 3]}}),           # hole at 0
    (None, {"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},
            "b": {"dtype": "U8", "shape": [2], "data_offsets": [1, 3]}}),           # overlap
    (None, {"a": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 0]}}),          # negative dim
    (None, {"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1], "x": 1}}),   # extra key
    (None, {"a": {"dtype": "../x", "shape": [1], "data_offsets": [0, 1]}}),         # bad dtype
    (None, {"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 99]}}),          # beyond data
]


@pytest.mark.parametrize("case", range(len(HOSTILE)))
def test_hostile_headers_are_refused(tmp_path, case):
    prefix, body = HOSTILE[case]
    p = tmp_path / "bad.safetensors"
    if prefix is not None:
        p.write_bytes(prefix + body)
    else:
        write_raw(p, body, b"\0\0\0")
    with pytest.raises(FileFormatError):
        load_files([p])


def test_duplicate_json_keys_are_refused(tmp_path):
    head = b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}'
    with pytest.raises(FileFormatError, match="duplicate"):
        read_header(write_raw(tmp_path / "d.safetensors", head, b"x"))


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200), st.integers(0, 64))
def test_fuzzed_headers_only_raise_file_format_error(text, data_bytes):
    try:
        parse_header(text, data_bytes, "fuzz")
    except FileFormatError:
        pass


@pytest.mark.parametrize("name", ["../x", "/etc/passwd", "a/b", "a\\b", "x\0y", ".", "..", "", " x", "x" * 300])
def test_unsafe_names_are_refused(name):
    with pytest.raises(FileFormatError, match="unsafe"):
        check_name(name)


def received(files: list[dict], chunks: dict[str, str], tensors=()) -> TensorRegion:
    meta = {FILES_KEY: json.dumps(files), **chunks}
    return TensorRegion.from_manifest(Manifest.layout(list(tensors), metadata=meta))


@pytest.mark.parametrize("name", ["../escape.safetensors", "/tmp/abs.safetensors", "sub/x.safetensors"])
def test_received_names_never_escape_out(tmp_path, name):
    header = '{"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}'
    with received([{"name": name, "kind": "safetensors", "tensors": 1, "chunks": 1}],
                  {"tensorxfer.file.0.0": header}, [("w", "U8", (1,))]) as region:
        with pytest.raises(FileFormatError, match="unsafe"):
            write_files(region, tmp_path / "out")
    assert not any(tmp_path.rglob("*.safetensors"))
    assert not os.path.exists("/tmp/abs.safetensors")


def test_symlink_at_target_is_replaced_not_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    out = tmp_path / "out"
    out.mkdir()
    (out / "m.safetensors").symlink_to(victim)
    header = '{"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}'
    with received([{"name": "m.safetensors", "kind": "safetensors", "tensors": 1, "chunks": 1}],
                  {"tensorxfer.file.0.0": header}, [("w", "U8", (1,))]) as region:
        write_files(region, out)
    assert victim.read_text() == "keep me"
    assert not (out / "m.safetensors").is_symlink()


def test_header_that_does_not_match_the_tensors_is_refused(tmp_path):
    header = '{"w":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}'
    with received([{"name": "m.safetensors", "kind": "safetensors", "tensors": 1, "chunks": 1}],
                  {"tensorxfer.file.0.0": header}, [("w", "U8", (1,))]) as region:
        with pytest.raises(FileFormatError):
            write_files(region, tmp_path / "out")
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())


def test_region_without_file_layout_writes_nothing(tmp_path):
    with TensorRegion.from_tensors({"x": np.zeros(3)}) as region, pytest.raises(FileFormatError, match="no file"):
        write_files(region, tmp_path / "out")


def test_large_headers_are_chunked(tmp_path):
    tensors = {f"t{i:05d}" + "x" * 40: np.full(2, i, np.int32) for i in range(1500)}
    safetensors_numpy.save_file(tensors, str(tmp_path / "big.safetensors"))
    with load_files([tmp_path / "big.safetensors"]) as region:
        assert json.loads(region.manifest.metadata[FILES_KEY])[0]["chunks"] > 1
        region2 = TensorRegion.from_manifest(Manifest.unpack(region.manifest.pack()))
        memoryview(region2.region)[:region.nbytes] = memoryview(region.region)[:region.nbytes]
        with region2:
            write_files(region2, tmp_path / "out")
    assert sha(tmp_path / "big.safetensors") == sha(tmp_path / "out" / "big.safetensors")


def test_duplicate_tensor_names_across_files_are_refused(tmp_path):
    for n in ("a", "b"):
        safetensors_numpy.save_file({"w": np.zeros(2, np.float32)}, str(tmp_path / f"{n}.safetensors"))
    with pytest.raises(FileFormatError, match="both"):
        load_files([tmp_path / "a.safetensors", tmp_path / "b.safetensors"])
