"""safetensors files -> one region -> the same files, and hostile headers."""

from __future__ import annotations

import errno
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
from tensorxfer.files import (
    FILES_KEY,
    FileFormatError,
    OutputError,
    check_name,
    check_output_dir,
    clean_leftovers,
    discover,
    parse_header,
    read_header,
    write_files,
)
from tensorxfer.files import layout as layout_mod
from tensorxfer.files import sources as sources_mod
from tensorxfer.files import write as write_mod
from tests.helpers import small_filesystem

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
    with TensorRegion.from_safetensors([src]) as region:
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
    with TensorRegion.from_safetensors(paths) as region:
        views = region.tensors()
        for k, v in ref.items():
            assert np.array_equal(views[k], v)
        del views


def test_unknown_dtype_travels_as_raw_bytes(tmp_path):
    p = write_raw(tmp_path / "x.safetensors",
                  {"q": {"dtype": "F4", "shape": [4], "data_offsets": [0, 2]},
                   "__metadata__": {"a": "b"}}, b"\x12\x34")
    with TensorRegion.from_safetensors([p]) as region:
        assert region.manifest["q"].dtype == "U8"
        write_files(region, tmp_path / "out")
    assert sha(p) == sha(tmp_path / "out" / "x.safetensors")


def test_header_with_padding_and_odd_order_is_kept_verbatim(tmp_path):
    head = b'{"b":{"dtype":"U8","shape":[2],"data_offsets":[3,5]},  "a":{"dtype":"U8","shape":[3],' \
           b'"data_offsets":[0,3]}}' + b"    "
    p = write_raw(tmp_path / "odd.safetensors", head, b"abcde")
    with TensorRegion.from_safetensors([p]) as region:
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
        TensorRegion.from_safetensors([p])


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
    with TensorRegion.from_safetensors([tmp_path / "big.safetensors"]) as region:
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
        TensorRegion.from_safetensors([tmp_path / "a.safetensors", tmp_path / "b.safetensors"])


# ---------------------------------------------------------------- names, nesting
@pytest.mark.parametrize("name", ["a\nb.safetensors", "a\rb", "tab\there", "del\x7f", "c1\x85x",
                                  "evil\u202egnp.safetensors", "iso\u2066x", "mark\u200fx", "\udcffbytes.json",
                                  "lone\ud800", ".tensorxfer-x.part"])
def test_names_that_hide_what_they_are_are_refused(name):
    with pytest.raises(FileFormatError, match="unsafe"):
        check_name(name)


def test_plain_unicode_names_are_fine():
    assert check_name("modèle-00001.safetensors") == "modèle-00001.safetensors"


@pytest.mark.parametrize("name", ["a\nb.json", "x\u202ey.json", "\ud800.json"])
def test_received_control_and_bidi_names_write_nothing(tmp_path, name):
    files = [{"name": "ok.json", "kind": "text", "tensors": 0, "chunks": 1},
             {"name": name, "kind": "text", "tensors": 0, "chunks": 1}]
    with received(files, {"tensorxfer.file.0.0": "{}", "tensorxfer.file.1.0": "{}"}) as region:
        with pytest.raises(FileFormatError, match="unsafe"):
            write_files(region, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_sender_refuses_a_file_name_that_is_not_utf8(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    safetensors_numpy.save_file({"w": np.zeros(2, np.float32)}, str(d / "model.safetensors"))
    (d / os.fsdecode(b"bad\xff.json")).write_text("{}")
    with pytest.raises(FileFormatError, match="surrogate"):
        TensorRegion.from_safetensors([d])


@pytest.mark.parametrize("layout", ["[" * 50000, '{"a":' * 50000, '"' + '\\"' * 200_000 + "[" * 40])
def test_deeply_nested_layout_is_a_typed_error(tmp_path, layout):
    with received([], {}) as region:
        region.manifest.metadata[FILES_KEY] = layout
        with pytest.raises(FileFormatError, match="levels deep"):
            write_files(region, tmp_path / "out")


def test_deeply_nested_header_is_a_typed_error(tmp_path):
    p = write_raw(tmp_path / "deep.safetensors", b"[" * 50000)
    with pytest.raises(FileFormatError, match="levels deep"):
        TensorRegion.from_safetensors([p])


def test_deeply_nested_index_is_a_typed_error(tmp_path):
    safetensors_numpy.save_file({"w": np.zeros(2, np.float32)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": ' + "[" * 50000 + "]" * 50000 + "}")
    with pytest.raises(FileFormatError, match="levels deep"):
        TensorRegion.from_safetensors([tmp_path])


# ---------------------------------------------------------------- side files
def hf_like_dir(d: Path) -> Path:
    d.mkdir()
    make_model(d)
    (d / "config.json").write_text(json.dumps({"model_type": "x", "n": 1}, indent=2) + "\n")
    (d / "tokenizer.json").write_text('{"vocab": {"é": 1}}')
    (d / "tokenizer.model").write_bytes(bytes(range(256)) * 3)      # binary: travels as base64
    (d / "run.sh").write_text("#!/bin/sh\n")
    os.chmod(d / "run.sh", 0o750)
    os.chmod(d / "config.json", 0o640)
    (d / "pytorch_model.bin").write_bytes(b"\0" * 100)
    (d / ".gitattributes").write_text("*")
    (d / "sub").mkdir()
    return d


def test_side_files_travel_byte_identical_with_their_modes(tmp_path):
    src, out = hf_like_dir(tmp_path / "src"), tmp_path / "out"
    found = discover([src])
    assert sorted(s.name for s in found.files if s.kind == "side") == [
        "config.json", "model.safetensors.index.json", "run.sh", "tokenizer.json", "tokenizer.model"]
    assert {n for n, _ in found.skipped} == {"pytorch_model.bin", ".gitattributes", "sub/"}
    with TensorRegion.from_safetensors(found) as region:
        kinds = {f["name"]: f["kind"] for f in json.loads(region.manifest.metadata[FILES_KEY])}
        assert kinds["tokenizer.model"] == "base64" and kinds["config.json"] == "text"
        region2 = TensorRegion.from_manifest(Manifest.unpack(region.manifest.pack()))   # as the receiver sees it
        memoryview(region2.region)[:region.nbytes] = memoryview(region.region)[:region.nbytes]
        with region2:
            write_files(region2, out)
    umask = os.umask(0)
    os.umask(umask)
    for s in found.files:
        assert sha(s.path) == sha(out / s.name), s.name
        assert (out / s.name).stat().st_mode & 0o7777 == s.path.stat().st_mode & 0o777 & ~umask, s.name
    assert sorted(os.listdir(out)) == sorted(s.name for s in found.files)


def test_received_mode_never_sets_special_bits(tmp_path):
    files = [{"name": "x.sh", "kind": "text", "tensors": 0, "chunks": 1, "mode": 0o7777}]
    with received(files, {"tensorxfer.file.0.0": "hi"}) as region:
        (path,) = write_files(region, tmp_path / "out")
    assert path.stat().st_mode & 0o7000 == 0


@pytest.mark.parametrize("mode", [-1, 0o10000, "0644", True, 1.5])
def test_received_bad_mode_is_refused(tmp_path, mode):
    files = [{"name": "x", "kind": "text", "tensors": 0, "chunks": 1, "mode": mode}]
    with received(files, {"tensorxfer.file.0.0": "hi"}) as region, pytest.raises(FileFormatError, match="malformed"):
        write_files(region, tmp_path / "out")


def test_received_bad_base64_is_refused(tmp_path):
    files = [{"name": "x", "kind": "base64", "tensors": 0, "chunks": 1}]
    with received(files, {"tensorxfer.file.0.0": "not base64!"}) as region, pytest.raises(FileFormatError):
        write_files(region, tmp_path / "out")


def test_side_file_caps_are_clear_errors(tmp_path, monkeypatch):
    src = hf_like_dir(tmp_path / "src")
    monkeypatch.setattr(sources_mod, "MAX_SIDE_FILE_BYTES", 700)
    with pytest.raises(FileFormatError, match=r"tokenizer.model: 768 bytes, over the 700-byte limit"):
        discover([src])
    monkeypatch.setattr(sources_mod, "MAX_SIDE_FILE_BYTES", 1000)
    monkeypatch.setattr(sources_mod, "MAX_SIDE_TOTAL_BYTES", 800)
    with pytest.raises(FileFormatError, match="side files add up to"):
        discover([src])


def test_symlink_escaping_the_directory_is_refused(tmp_path):
    src = hf_like_dir(tmp_path / "src")
    secret = tmp_path / "id_rsa"
    secret.write_text("PRIVATE")
    (src / "notes.txt").symlink_to(secret)
    with pytest.raises(FileFormatError, match="outside"):
        discover([src])
    (src / "notes.txt").unlink()
    (src / "notes.txt").symlink_to(src / "config.json")       # inside: followed
    assert "notes.txt" in [s.name for s in discover([src]).files]


def test_hub_snapshot_links_into_blobs_are_followed(tmp_path):
    repo = tmp_path / "models--org--m"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    safetensors_numpy.save_file({"w": np.ones(3, np.float32)}, str(repo / "blobs" / "b1"))
    (repo / "blobs" / "b2").write_text("{}")
    (snap / "model.safetensors").symlink_to("../../blobs/b1")
    (snap / "config.json").symlink_to("../../blobs/b2")
    assert sorted(s.name for s in discover([snap]).files) == ["config.json", "model.safetensors"]


def test_fifo_in_the_directory_is_skipped_not_read(tmp_path):
    src = hf_like_dir(tmp_path / "src")
    os.mkfifo(src / "pipe")
    found = discover([src])
    assert ("pipe", "not a regular file") in found.skipped


# ---------------------------------------------------------------- all or nothing
def two_files(text_a: str = "new a", text_b: str = "new b") -> TensorRegion:
    files = [{"name": "a.json", "kind": "text", "tensors": 0, "chunks": 1},
             {"name": "b.json", "kind": "text", "tensors": 0, "chunks": 1}]
    return received(files, {"tensorxfer.file.0.0": text_a, "tensorxfer.file.1.0": text_b})


def test_a_directory_at_a_later_target_writes_nothing(tmp_path):
    out = tmp_path / "out"
    (out / "b.json").mkdir(parents=True)
    with two_files() as region, pytest.raises(OutputError, match="is a directory"):
        write_files(region, out)
    assert os.listdir(out) == ["b.json"]


@pytest.mark.parametrize("exists", [True, False])
def test_a_failed_rename_in_an_empty_out_removes_the_new_files(tmp_path, monkeypatch, exists):
    """The first receive, the usual case: nothing to restore, but a.json, already renamed into place when
    b.json's rename fails, is brand new and must go too."""
    out = tmp_path / "out"
    if exists:
        out.mkdir()
    real_replace, renamed = os.replace, []

    def replace(src, dst):
        if str(dst).endswith("b.json"):
            raise OSError(28, "No space left on device")
        real_replace(src, dst)
        renamed.append(Path(dst).name)

    monkeypatch.setattr(write_mod.os, "replace", replace)
    with two_files() as region, pytest.raises(OSError, match="No space"):
        write_files(region, out)
    monkeypatch.undo()
    assert renamed == ["a.json"]                          # a.json was in place when b.json failed
    assert os.listdir(out) == []                          # and is gone, with every temporary file


def test_a_failed_rename_rolls_back_the_earlier_ones(tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "a.json").write_text("old a")
    real_replace, calls = os.replace, []

    def replace(src, dst):
        calls.append(dst)
        if str(dst).endswith("b.json"):
            raise OSError(28, "No space left on device")
        return real_replace(src, dst)

    monkeypatch.setattr(write_mod.os, "replace", replace)
    with two_files() as region, pytest.raises(OSError, match="No space"):
        write_files(region, out)
    monkeypatch.undo()
    assert (out / "a.json").read_text() == "old a"        # restored, not the new one
    assert sorted(os.listdir(out)) == ["a.json"]          # no b.json, no temporary or backup files
    assert len(calls) >= 2


def test_disk_full_while_writing_names_the_file_and_leaves_nothing(tmp_path):
    """A late ENOSPC (the disk filled after the offer was accepted) names the file being written."""
    files = [{"name": "a.json", "kind": "text", "tensors": 0, "chunks": 1},
             {"name": "b.safetensors", "kind": "safetensors", "tensors": 1, "chunks": 1}]
    header = '{"w":{"dtype":"U8","shape":[400000],"data_offsets":[0,400000]}}'
    with small_filesystem(tmp_path / "fs", 256 << 10) as fs:
        with received(files, {"tensorxfer.file.0.0": "{}", "tensorxfer.file.1.0": header},
                      [("w", "U8", (400_000,))]) as region:
            with pytest.raises(OutputError, match=r"b\.safetensors.*No space left") as info:
                write_files(region, fs / "out")
        left = os.listdir(fs / "out")
    assert info.value.errno == errno.ENOSPC and str(fs / "out") in str(info.value)
    assert left == []                                     # all or nothing: the temporary files are gone too


def test_replacing_existing_files_leaves_no_backups(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "a.json").write_text("old a")
    with two_files() as region:
        write_files(region, out)
    assert sorted(os.listdir(out)) == ["a.json", "b.json"]
    assert (out / "a.json").read_text() == "new a"


# ---------------------------------------------------------------- another model in --out
def one_model(shard: str = "model.safetensors", config: str = '{"model_type": "new"}') -> TensorRegion:
    """What the receiver gets for a directory with one shard and a config.json."""
    files = [{"name": shard, "kind": "safetensors", "tensors": 1, "chunks": 1},
             {"name": "config.json", "kind": "text", "tensors": 0, "chunks": 1}]
    header = '{"w":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}}'
    region = received(files, {"tensorxfer.file.0.0": header, "tensorxfer.file.1.0": config}, [("w", "U8", (4,))])
    memoryview(region.region)[:4] = b"NEW!"
    return region


def old_model(out: Path) -> dict[str, bytes]:
    """An earlier model in ``out`` (two shards, an index, a config, a tokenizer) plus a file of the user's;
    returns every file's bytes."""
    out.mkdir()
    for n in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        safetensors_numpy.save_file({n: np.ones(3, np.float32)}, str(out / n))
    (out / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    (out / "config.json").write_text('{"model_type": "old"}')
    (out / "tokenizer.json").write_text("{}")
    (out / "NOTES.txt").write_text("mine")
    return {p.name: p.read_bytes() for p in out.iterdir()}


def test_out_holding_another_models_files_is_refused(tmp_path):
    out = tmp_path / "out"
    before = old_model(out)
    with one_model() as region, pytest.raises(OutputError, match="another model") as info:
        write_files(region, out)
    for n in ("model-00001-of-00002.safetensors", "model.safetensors.index.json", "tokenizer.json"):
        assert n in str(info.value)
    assert "--overwrite" in str(info.value) and "NOTES.txt" not in str(info.value)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before       # untouched


def test_the_same_models_files_are_replaced_without_overwrite(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"old")
    (out / "config.json").write_text("{}")
    with one_model() as region:
        write_files(region, out)
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]


def test_overwrite_removes_what_the_new_model_does_not_have(tmp_path):
    out = tmp_path / "out"
    old_model(out)
    with one_model() as region:
        write_files(region, out, overwrite=True)
    assert sorted(os.listdir(out)) == ["NOTES.txt", "config.json", "model.safetensors"]   # the user's file stays
    assert (out / "config.json").read_text() == '{"model_type": "new"}'
    assert (out / "model.safetensors").read_bytes().endswith(b"NEW!")


@pytest.mark.parametrize("fail_at", ["removing", "renaming"])
def test_overwrite_failing_midway_restores_everything(tmp_path, monkeypatch, fail_at):
    """All or nothing with --overwrite too: a failure while removing the old model's second file, or while
    renaming the new files in place, leaves the directory as it was: every removed or replaced file back,
    no new file, no temporary or backup file."""
    out = tmp_path / "out"
    before = old_model(out)
    real_rename, real_replace, seen = os.rename, os.replace, []

    def rename(src, dst):
        if fail_at == "removing" and str(dst).endswith(".bak") and not Path(src).name.startswith("config"):
            seen.append(src)
            if len(seen) == 2:
                raise OSError(5, "Input/output error")
        return real_rename(src, dst)

    def replace(src, dst):
        if fail_at == "renaming" and str(dst).endswith("config.json"):      # model.safetensors is in place
            raise OSError(5, "Input/output error")
        return real_replace(src, dst)

    monkeypatch.setattr(write_mod.os, "rename", rename)
    monkeypatch.setattr(write_mod.os, "replace", replace)
    with one_model() as region, pytest.raises(OSError, match="Input/output"):
        write_files(region, out, overwrite=True)
    monkeypatch.undo()
    assert fail_at == "renaming" or len(seen) == 2
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_out_that_is_a_file_is_an_output_error(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(OutputError, match="not a directory"):
        check_output_dir(tmp_path / "f")


def test_clean_leftovers_removes_only_our_temporaries(tmp_path):
    for n in (".tensorxfer-abc.part", ".tensorxfer-def.bak", "keep.part", ".tensorxfer-notes"):
        (tmp_path / n).write_text("x")
    (tmp_path / ".tensorxfer-dir.part").mkdir()
    removed, backups = clean_leftovers(tmp_path)
    assert [p.name for p in removed] == [".tensorxfer-abc.part"]
    assert [p.name for p in backups] == [".tensorxfer-def.bak"]          # possibly the only copy: kept
    assert sorted(os.listdir(tmp_path)) == [".tensorxfer-def.bak", ".tensorxfer-dir.part", ".tensorxfer-notes",
                                            "keep.part"]


def test_aside_mode_rollback_without_hard_links(tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "a.json").write_text("old a")
    (out / "b.json").write_text("old b")
    real_replace = os.replace

    def no_link(*a, **k):
        raise OSError(1, "Operation not permitted")

    def replace(src, dst):
        if str(dst).endswith("b.json") and str(src).endswith(".part"):
            raise OSError(5, "Input/output error")
        return real_replace(src, dst)

    monkeypatch.setattr(write_mod.os, "link", no_link)
    monkeypatch.setattr(write_mod.os, "replace", replace)
    with two_files() as region, pytest.raises(OSError, match="Input/output"):
        write_files(region, out)
    monkeypatch.undo()
    assert (out / "a.json").read_text() == "old a" and (out / "b.json").read_text() == "old b"
    assert sorted(os.listdir(out)) == ["a.json", "b.json"]


def test_a_failed_rollback_keeps_the_backup_and_says_where(tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "a.json").write_text("old a")
    real_replace = os.replace

    def replace(src, dst):
        if str(dst).endswith("b.json") or str(src).endswith(".bak"):
            raise OSError(5, "Input/output error")
        return real_replace(src, dst)

    monkeypatch.setattr(write_mod.os, "replace", replace)
    with two_files() as region, pytest.raises(OutputError, match=r"previous contents are kept in .*a.json <- "):
        write_files(region, out)
    monkeypatch.undo()
    (bak,) = [p for p in out.iterdir() if p.name.endswith(".bak")]
    assert bak.read_text() == "old a"


@pytest.mark.slow
def test_a_large_side_file_survives_the_manifest_limits(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    safetensors_numpy.save_file({"w": np.ones(4, np.float32)}, str(src / "model.safetensors"))
    # 12 MB of JSON with 1-, 2-, 3- and 4-byte UTF-8 characters, so chunk boundaries fall inside characters
    vocab = {f"tok{i}-é中😀": i for i in range(400_000)}
    (src / "tokenizer.json").write_text(json.dumps({"model": {"vocab": vocab}}, ensure_ascii=False))
    (src / "blob.bin.model").write_bytes(np.random.default_rng(0).integers(0, 256, 3 << 20, np.uint8).tobytes())
    with TensorRegion.from_safetensors([src]) as region, \
            TensorRegion.from_manifest(Manifest.unpack(region.manifest.pack())) as region2:
        memoryview(region2.region)[:region.nbytes] = memoryview(region.region)[:region.nbytes]
        write_files(region2, tmp_path / "out")
    for p in src.iterdir():
        assert sha(p) == sha(tmp_path / "out" / p.name), p.name


def test_side_files_that_overflow_the_metadata_are_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(layout_mod, "CHUNK_BYTES", 100)
    src = hf_like_dir(tmp_path / "src")
    (src / "big.txt").write_text("x" * 200_000)
    with pytest.raises(FileFormatError, match="send fewer files at once"):
        TensorRegion.from_safetensors([src])
