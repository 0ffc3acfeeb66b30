"""A sender's files over ipc (issue 38): what ``auto`` picks for files and for memory, and what arrives.

On one host ``tensorxfer-send`` passes its model files themselves (chunk table kind ``files``) and
``tensorxfer-recv`` copies them into its output with ``copy_file_range``, as ``cp`` does; a library
receiver reads them into its region with ``pread``; an in-memory region still goes as memory handles.
Nothing maps the passed files on the receiving side, so a file cut short is a typed error.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import numpy as np
import pytest

from tensorxfer import Receiver, Sender, TensorRegion
from tensorxfer.errors import ProtocolError, TransferError, TransportUnavailable
from tensorxfer.files import ModelWriter, plan_load
from tensorxfer.files.format import TEMP_PREFIX
from tensorxfer.files.mapped import map_sources, mirror
from tensorxfer.transport.ipc import messages
from tensorxfer.transport.ipc.sourcefiles import fill_from_files

from .helpers import Background
from .test_cli import cli, finish, model_dir, sha, start_recv


def _files_region(src: Path) -> TensorRegion:
    mirrored = mirror(plan_load([src]))
    assert mirrored is not None
    return map_sources(*mirrored, keep_files=True)


def _open_fds_to(d: Path) -> list[str]:
    out = []
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith(str(d)):
            out.append(target)
    return out


def test_cli_default_on_one_host_passes_the_files_and_the_output_is_byte_identical(tmp_path):
    src = model_dir(tmp_path / "src", shards=3, rows=2000)
    out = tmp_path / "out"
    recv, where = start_recv(out, "--once")
    rc_s, out_s, err_s = finish(cli("send", str(src), "--to", where, "--json"), 60)     # no --transport
    rc_r, out_r, err_r = finish(recv, 60)
    assert rc_s == 0 and rc_r == 0, (err_s, err_r)
    sent, got = json.loads(out_s), json.loads(out_r.splitlines()[-1])
    assert sent["transport"] == "ipc" and sent["read"] == "passed"
    # the choice is said, with why: auto's pick, then how the files travel
    assert "chose 'ipc'" in err_s and "passed the files themselves" in err_s and "copy_file_range" in err_s
    assert got["written_while_landing"] == plan_load([src]).nbytes      # every tensor byte copied from the files
    assert {p.name: sha(p) for p in out.iterdir()} == {p.name: sha(p) for p in src.iterdir()}
    assert not [p for p in os.listdir(out) if p.startswith(TEMP_PREFIX)]


def test_auto_sends_an_in_memory_region_as_memory_handles_and_files_as_files(tmp_path):
    """The same Sender, auto: a region of memory goes as memfds (copied from memory), a region that is files
    goes as the files (read by the receiver with pread); both arrive byte for byte."""
    src = model_dir(tmp_path / "src", shards=2, rows=500)
    kinds: list[str] = []
    real = messages.parse_header

    def spy(data: bytes):
        parsed = real(data)
        kinds.append(parsed[0])
        return parsed

    memory = {"a": np.arange(100_000, dtype=np.float32), "b": np.arange(7, dtype=np.int8)}
    with Receiver() as rx, pytest.MonkeyPatch.context() as mp:
        mp.setattr("tensorxfer.transport.ipc.receiving.parse_header", spy)
        with Sender("{}:{}".format(*rx.address)) as s:
            assert s.transport == "ipc" and s.peer_caps.get("files") is True
            with TensorRegion.from_tensors(memory) as region:
                job = Background(rx.receive, timeout=30)
                s.send(region)
                got = job.result()
                assert all(np.array_equal(got.tensors()[k], v) for k, v in memory.items())
            with _files_region(src) as region:
                assert region.source_files is not None
                want = {k: v.tobytes() for k, v in region.tensors().items()}
                job = Background(rx.receive, timeout=30)
                s.send(region, verify=True)         # checksums over what the receiver read into its region
                got = job.result()
                assert {k: v.tobytes() for k, v in got.tensors().items()} == want
    assert kinds == ["host", "files"]
    assert _open_fds_to(src) == []          # the region's fds and the passed duplicates are all closed


def test_a_files_region_owns_its_fds(tmp_path):
    src = model_dir(tmp_path / "src", shards=2, rows=10)
    region = _files_region(src)
    assert len(_open_fds_to(src)) == 2
    region.close()
    region.close()                          # idempotent
    assert _open_fds_to(src) == [] and region.source_files is None
    laid, bases = mirror(plan_load([src]))
    with map_sources(laid, bases) as plain:   # tcp's: no fds kept
        assert plain.source_files is None and _open_fds_to(src) == []


def test_a_sharing_receiver_is_not_offered_files(tmp_path):
    src = model_dir(tmp_path / "src", shards=1, rows=10)
    with Receiver(share=True) as rx:
        with Sender("{}:{}".format(*rx.address)) as s:
            assert s.transport == "ipc" and "files" not in s.peer_caps
            with _files_region(src) as region:
                job = Background(rx.receive, timeout=30)
                with pytest.raises(TransportUnavailable, match="only memory handles"):
                    s.send(region)
                with pytest.raises(TransferError):     # the sender left: the receiver reports it, typed
                    job.result()


def test_on_files_cannot_land_in_a_module():
    with Receiver() as rx, pytest.raises(ValueError, match="into="):
        rx.receive(timeout=1, on_files=lambda files, report: None, into=object())


def _writer_and_sources(tmp_path: Path, shrink: int = 0):
    src = model_dir(tmp_path / "src", shards=2, rows=300)
    laid, bases = mirror(plan_load([src]))
    if shrink:
        path = Path(laid.jobs[1][0])
        os.truncate(path, path.stat().st_size - shrink)
    fds = [os.open(p, os.O_RDONLY) for p, _ in laid.jobs]
    files = [(b, n, fd) for b, n, fd in zip(bases, laid.sizes, fds, strict=True)]
    return src, laid, files, fds


def test_model_writer_copies_the_files_in_the_kernel_then_commits(tmp_path):
    src, laid, files, fds = _writer_and_sources(tmp_path)
    out = tmp_path / "out"
    reported: list[int] = []
    try:
        writer = ModelWriter(laid.manifest, out)
        writer.copy_files(files, reported.append)
        assert sum(reported) == writer.written_while_landing == laid.manifest.nbytes - _gaps(laid)
        with TensorRegion.from_manifest(laid.manifest) as untouched:     # finish writes nothing from it
            writer.finish(untouched)
    finally:
        for fd in fds:
            os.close(fd)
    assert {p.name: sha(p) for p in out.iterdir()} == {p.name: sha(p) for p in src.iterdir()}


def _gaps(laid) -> int:
    """Region bytes that are no tensor's (headers and the alignment between files)."""
    return laid.manifest.nbytes - sum(t.nbytes for t in laid.manifest.tensors)


def test_a_file_cut_short_fails_the_copy_and_nothing_is_left(tmp_path):
    _, laid, files, fds = _writer_and_sources(tmp_path, shrink=1000)
    out = tmp_path / "out"
    try:
        writer = ModelWriter(laid.manifest, out)
        with pytest.raises(TransferError, match="shrank while being sent"):
            writer.copy_files(files, lambda n: None)
        writer.abort()
        view = memoryview(bytearray(laid.manifest.nbytes))
        with pytest.raises(TransferError, match="shrank while being sent"):
            fill_from_files(view, files, 0, laid.manifest.nbytes)
    finally:
        for fd in fds:
            os.close(fd)
    assert os.listdir(out) == []


def test_placements_that_do_not_hold_the_manifest_are_refused(tmp_path):
    _, laid, files, fds = _writer_and_sources(tmp_path)
    try:
        writer = ModelWriter(laid.manifest, tmp_path / "out")
        with pytest.raises(ProtocolError, match="do not hold the bytes"):
            writer.copy_files(files[:1], lambda n: None)       # the second file's tensors are in no file
        writer.abort()
    finally:
        for fd in fds:
            os.close(fd)


@pytest.mark.parametrize("raw", [[[0, 10], [5, 10]],      # overlapping
                                 [[0, 10], [100, 1]],     # starts past the payload
                                 [[0, 0]],                # empty
                                 [[-1, 5]],               # before the region
                                 [[0, "10"]], []])
def test_hostile_file_placements_are_protocol_errors(raw):
    with pytest.raises(ProtocolError):
        messages.add_files([], raw, 100)


def test_a_passed_fd_that_is_not_a_regular_file_is_refused():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    r, w = os.pipe()
    fds: list[int] = []
    try:
        messages.send_handles(a, [(0, 10, r)])
        with pytest.raises(ProtocolError, match="not a regular file"):
            messages.receive_files(b, 1, 100, fds, 5)
    finally:
        messages.close_fds(fds)
        for fd in (r, w):
            os.close(fd)
        a.close()
        b.close()


def test_a_files_chunk_table_is_never_cached():
    import msgpack

    table = {"kind": "files", "device": 0, "nbytes": 10, "token": bytes(16), "count": 0, "cached": True,
             "seq": 1}
    with pytest.raises(ProtocolError):
        messages.parse_header(msgpack.packb(table))
    table.update(count=1, cached=False)
    assert messages.parse_header(msgpack.packb(table))[0] == "files"
