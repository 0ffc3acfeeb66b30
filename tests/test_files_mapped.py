"""Model files as the sender's region: a layout that mirrors the files, mapped read-only, sent over tcp."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest

from tensorxfer import Manifest, TensorSpec
from tensorxfer.files import plan_load
from tensorxfer.files.format import TEMP_PREFIX
from tensorxfer.files.mapped import FILE_ALIGN, map_sources, mirror

from .test_cli import cli, finish, model_dir, sha, start_recv


def _region_bytes(region) -> np.ndarray:
    return np.frombuffer(region.region, dtype=np.uint8)


def test_mirror_places_every_tensor_where_its_file_holds_it(tmp_path):
    src = model_dir(tmp_path / "src", shards=3, rows=333)      # odd sizes: every file ends mid-page
    plan = plan_load([src])
    mirrored = mirror(plan)
    assert mirrored is not None
    laid, bases = mirrored
    assert bases[0] == 0 and all(b % FILE_ALIGN == 0 for b in bases)
    assert all(b + s <= nb for b, s, nb in zip(bases, plan.sizes, bases[1:], strict=False))
    assert laid.manifest.alignment >= 4 and laid.manifest.metadata == plan.manifest.metadata     # F32 tensors
    assert [(s.name, s.dtype, s.shape) for s in laid.manifest.tensors] == \
        [(s.name, s.dtype, s.shape) for s in plan.manifest.tensors]
    with map_sources(laid, bases) as region:
        view = _region_bytes(region)
        for (path, _), base, size in zip(plan.jobs, bases, plan.sizes, strict=True):
            assert view[base:base + size].tobytes() == Path(path).read_bytes()     # the region is the files
        for name, tensor in region.tensors().items():                           # and its tensors theirs
            assert tensor.tobytes() == region.tensors()[name].tobytes()
        del view
    # the loader fills a region of the mirrored layout at the same places (what an ipc sender sends)
    from tensorxfer import TensorRegion

    with TensorRegion.from_safetensors(laid) as read, map_sources(laid, bases) as mapped:
        for name, tensor in read.tensors().items():
            assert tensor.tobytes() == mapped.tensors()[name].tobytes()


def _safetensors(path: Path, tensors: list[tuple[str, str, list[int], bytes]], pad_to: int = 8) -> None:
    header, pos = {}, 0
    for name, dtype, shape, data in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [pos, pos + len(data)]}
        pos += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-(8 + len(text)) % pad_to)
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(t[3] for t in tensors))


def test_mirror_refuses_files_that_place_a_tensor_less_aligned_than_its_elements(tmp_path):
    f = tmp_path / "odd.safetensors"
    _safetensors(f, [("a", "U8", [3], b"abc"), ("b", "F32", [2], bytes(8))])     # b at data byte 3
    assert mirror(plan_load([f])) is None
    _safetensors(f, [("a", "U8", [8], bytes(8)), ("b", "F32", [2], bytes(8))])   # b at data byte 8: fine
    assert mirror(plan_load([f])) is not None
    _safetensors(f, [("a", "U8", [4], bytes(4)), ("b", "F32", [2], bytes(8))])   # b at data byte 4: fine
    assert mirror(plan_load([f]))[0].manifest.alignment == 4
    _safetensors(f, [("a", "F32", [2], bytes(8))], pad_to=1)                     # header left unpadded
    head = 8 + struct.unpack("<Q", f.read_bytes()[:8])[0]
    assert (mirror(plan_load([f])) is None) == (head % 4 != 0)


@pytest.mark.parametrize("transport, read", [("tcp", "mapped"), ("ipc", "passed"),
                                             ("tcp --verify", "while sending"), ("ipc --verify", "while sending")])
@pytest.mark.slow
def test_the_cli_sends_from_its_files_over_tcp_and_reads_them_otherwise(tmp_path, transport, read):
    """Over tcp the sender's region is its files; over ipc the receiver is passed the files and copies them
    into its output; with --verify the sender reads every byte itself to hash it (and over ipc the receiver
    copies the sender's memory, and checks it)."""
    src = model_dir(tmp_path / "src", shards=3, rows=20_000)
    out = tmp_path / "out"
    recv, where = start_recv(out, "--once")
    rc_s, out_s, err_s = finish(cli("send", str(src), "--to", where, "--json", "--transport", *transport.split()), 60)
    rc_r, out_r, err_r = finish(recv, 60)
    assert rc_s == 0 and rc_r == 0, (err_s, err_r)
    sent, got = json.loads(out_s), json.loads(out_r.splitlines()[-1])
    assert sent["read"] == read and got["written_while_landing"] == plan_load([src]).nbytes
    assert {p.name: sha(p) for p in out.iterdir()} == {p.name: sha(p) for p in src.iterdir()}
    assert not [p for p in os.listdir(out) if p.startswith(TEMP_PREFIX)]


@pytest.mark.slow
def test_the_cli_sends_a_model_its_files_cannot_mirror_by_reading_it(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    _safetensors(src / "model.safetensors", [("a", "U8", [3], b"abc"), ("b", "F32", [2], bytes(8))])
    out = tmp_path / "out"
    recv, where = start_recv(out, "--once")
    rc_s, out_s, err_s = finish(cli("send", str(src), "--to", where, "--json", "--transport", "tcp"), 60)
    rc_r, _, err_r = finish(recv, 60)
    assert rc_s == 0 and rc_r == 0, (err_s, err_r)
    assert json.loads(out_s)["read"] == "while sending"
    assert (out / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()


def test_a_plan_without_file_sizes_is_not_mirrored(tmp_path):
    from tensorxfer.files import LoadPlan

    plan = plan_load([model_dir(tmp_path / "src", shards=1, rows=10)])
    assert mirror(plan) is not None and mirror(LoadPlan(plan.manifest, plan.jobs)) is None


def test_tensor_specs_of_a_mirrored_manifest_are_what_was_sent(tmp_path):
    # the manifest travels: a mirrored one is an ordinary manifest, with an alignment of its own
    src = model_dir(tmp_path / "src", shards=1, rows=10)
    laid, _ = mirror(plan_load([src]))
    again = Manifest.unpack(laid.manifest.pack())
    assert again == laid.manifest and again.alignment == laid.manifest.alignment
    assert all(isinstance(s, TensorSpec) for s in again.tensors)
