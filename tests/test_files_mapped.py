"""Model files as the region: the sender's layout mirrors its files, the receiver lands bytes in its own."""

from __future__ import annotations

import errno
import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest

from tensorxfer import Manifest, TensorSpec
from tensorxfer.files import ModelWriter, OutputError, plan_files, plan_load
from tensorxfer.files.format import TEMP_PREFIX
from tensorxfer.files.mapped import FILE_ALIGN, file_bases, map_sources, mirror
from tensorxfer.memory import page_size

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


def test_file_bases_come_only_from_a_layout_that_mirrors_the_files(tmp_path):
    src = model_dir(tmp_path / "src", shards=2, rows=100)
    plan = plan_load([src])
    laid, bases = mirror(plan)
    plans = plan_files(laid.manifest)
    got = file_bases(laid.manifest, plans)
    assert [b for b in got if b is not None] == bases and got[-1] is None     # the index is a side file
    assert file_bases(plan.manifest, plan_files(plan.manifest)) is None       # the packed layout is not files

    def moved(by: int, only_last: bool) -> Manifest:
        """The mirrored manifest with the second file's tensors (or its last one) moved ``by`` bytes."""
        specs = list(laid.manifest.tensors)
        fp = plans[1]
        last = fp.first_tensor + len(fp.header.entries) - 1
        for k in range(last if only_last else fp.first_tensor, last + 1):
            specs[k] = specs[k]._replace(offset=specs[k].offset + by)
        return Manifest(specs, alignment=8, metadata=laid.manifest.metadata)

    page = page_size()
    assert file_bases(moved(page, only_last=True), plans) is None           # one file's tensors at two bases
    assert file_bases(moved(8, only_last=False), plans) is None             # a base off the pages
    assert file_bases(moved(FILE_ALIGN, only_last=False), plans) is not None


def test_file_bases_refuse_files_whose_pages_would_overlap(tmp_path):
    # file a ends 100 bytes into its second page; b's only tensor starts 128 bytes into b: placed one page
    # down, b's tensor clears a's, but b's first page would be a's last (mapping one would unmap the other)
    page = page_size()
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    _safetensors(a, [("x", "U8", [page - 28], bytes(page - 28))], pad_to=128)
    _safetensors(b, [("y", "U8", [64], bytes(64))], pad_to=128)
    laid, bases = mirror(plan_load([a, b]))
    plans = plan_files(laid.manifest)
    assert file_bases(laid.manifest, plans) == bases and plans[0].size % page == 100
    y = laid.manifest.tensors[1]
    assert y.offset == bases[1] + 128
    overlapping = Manifest([laid.manifest.tensors[0], y._replace(offset=page + 128)], alignment=8,
                           metadata=laid.manifest.metadata)                  # a valid manifest: no tensor overlaps
    assert file_bases(overlapping, plans) is None


def _landed_files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in out.iterdir()}


def test_a_writer_lands_the_bytes_in_its_files_and_writes_its_own_headers(tmp_path):
    src = model_dir(tmp_path / "src", shards=2, rows=300)
    laid, bases = mirror(plan_load([src]))
    out = tmp_path / "out"
    out.mkdir()
    writer = ModelWriter(laid.manifest, out)
    region = writer.landing_region()
    assert region is not None and region.manifest.same_layout(laid.manifest)
    with map_sources(laid, bases) as sent:
        view, data = _region_bytes(region), _region_bytes(sent)
        view[:laid.manifest.nbytes] = data[:laid.manifest.nbytes]     # what a transport does, in two pieces
        for b in bases:
            view[b:b + 16] = 0xEE                                       # a sender's bytes over the headers
        half = laid.manifest.nbytes // 2
        writer.land(region, 0, half)
        writer.land(region, half, laid.manifest.nbytes - half)
        del view, data
    paths = writer.finish(region)
    assert region.closed and writer.landed_in_files
    assert writer.written_while_landing == sum(s.nbytes for s in laid.manifest.tensors)
    assert sorted(p.name for p in paths) == sorted(os.listdir(src))
    assert _landed_files(out) == _landed_files(src)                    # byte-identical, headers too


def test_a_writer_whose_update_failed_unmaps_and_removes_its_files(tmp_path):
    src = model_dir(tmp_path / "src", shards=2, rows=50)
    laid, _ = mirror(plan_load([src]))
    out = tmp_path / "out"
    out.mkdir()
    writer = ModelWriter(laid.manifest, out)
    region = writer.landing_region()
    assert writer.landing_region() is region                    # asked again: the same one
    writer.abort()
    writer.abort()
    assert region.closed and os.listdir(out) == []


def test_a_writer_of_a_layout_that_is_not_its_files_writes_them_as_before(tmp_path):
    src = model_dir(tmp_path / "src", shards=2, rows=50)
    from tensorxfer import TensorRegion

    with TensorRegion.from_safetensors(src) as region:           # the packed layout
        out = tmp_path / "out"
        out.mkdir()
        writer = ModelWriter(region.manifest, out)
        assert writer.landing_region() is None
        writer.finish(region)
        assert not writer.landed_in_files
    assert _landed_files(out) == _landed_files(src)


def test_a_disk_without_room_for_the_mapped_files_is_refused_before_mapping(tmp_path):
    from tests.helpers import small_filesystem

    src = model_dir(tmp_path / "src", shards=2, rows=20_000)    # ~10 MB
    laid, _ = mirror(plan_load([src]))
    with small_filesystem(tmp_path / "small", 4 << 20) as small:
        writer = ModelWriter(laid.manifest, small)              # no check_space: fallocate is what refuses
        with pytest.raises(OutputError) as e:
            writer.landing_region()
        assert e.value.errno == errno.ENOSPC and "model-0000" in str(e.value) and "bytes free" in str(e.value)
        writer.abort()
        assert not [p for p in os.listdir(small) if p.startswith(TEMP_PREFIX)]


@pytest.mark.parametrize("transport,read", [("tcp", "mapped"), ("ipc", "while sending")])
def test_the_cli_lands_a_model_in_its_files(tmp_path, transport, read):
    """Over tcp the sender's region is its files and the receiver's is its files; over ipc the sender reads
    into memory laid out as its files, and the receiver's copy lands in its files."""
    src = model_dir(tmp_path / "src", shards=3, rows=20_000)
    out = tmp_path / "out"
    recv, where = start_recv(out, "--once")
    rc_s, out_s, err_s = finish(cli("send", str(src), "--to", where, "--json", "--transport", transport), 60)
    rc_r, out_r, err_r = finish(recv, 60)
    assert rc_s == 0 and rc_r == 0, (err_s, err_r)
    sent, got = json.loads(out_s), json.loads(out_r.splitlines()[-1])
    assert sent["read"] == read and sent["transport"] == transport
    assert got["landed_in_files"] is True and got["written_while_landing"] == plan_load([src]).nbytes
    assert {p.name: sha(p) for p in out.iterdir()} == {p.name: sha(p) for p in src.iterdir()}
    assert not [p for p in os.listdir(out) if p.startswith(TEMP_PREFIX)]


def test_the_cli_sends_a_model_its_files_cannot_mirror_by_reading_it(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    _safetensors(src / "model.safetensors", [("a", "U8", [3], b"abc"), ("b", "F32", [2], bytes(8))])
    out = tmp_path / "out"
    recv, where = start_recv(out, "--once")
    rc_s, out_s, err_s = finish(cli("send", str(src), "--to", where, "--json", "--transport", "tcp"), 60)
    rc_r, out_r, err_r = finish(recv, 60)
    assert rc_s == 0 and rc_r == 0, (err_s, err_r)
    assert json.loads(out_s)["read"] == "while sending"
    assert json.loads(out_r.splitlines()[-1])["landed_in_files"] is False
    assert (out / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()


def test_tensor_specs_of_a_mirrored_manifest_are_what_was_sent(tmp_path):
    # the manifest travels: a mirrored one is an ordinary manifest, with an alignment of its own
    src = model_dir(tmp_path / "src", shards=1, rows=10)
    laid, _ = mirror(plan_load([src]))
    again = Manifest.unpack(laid.manifest.pack())
    assert again == laid.manifest and again.alignment == laid.manifest.alignment
    assert all(isinstance(s, TensorSpec) for s in again.tensors)
