"""RDMA transport over a real verbs device (Soft-RoCE inside the VM in CI).

Skipped, with the reason, where no RDMA device or no verbs module exists.
Sizes stay at a few MB: the VM emulates the CPU, so ~20–50 MB/s is normal.
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

from tensorxfer import HostRegion, TensorRegion, synthetic
from tensorxfer.errors import (
    CudaError,
    PeerLost,
    ProtocolError,
    TransferError,
    TransferTimeout,
    TransportUnavailable,
    VerbsError,
)
from tensorxfer.transport import rdma
from tensorxfer.transport.rdma import RdmaReceiverEndpoint, RdmaSenderEndpoint, rdma_available

OK, REASON = rdma_available()
pytestmark = [pytest.mark.rdma, pytest.mark.skipif(not OK, reason=f"no usable RDMA device: {REASON}")]

HERE = Path(__file__).resolve().parent
KIB = 1 << 10


def fill(region: HostRegion, seed: int, n: int | None = None) -> bytes:
    a = np.frombuffer(region, np.uint8, n or region.size)
    a[:] = np.random.default_rng(seed).integers(0, 256, a.size, dtype=np.uint8)
    data = a.tobytes()
    del a
    return data


def head(region: HostRegion, n: int) -> bytes:
    return bytes(memoryview(region)[:n])


def check_partial_update(tx: RdmaSenderEndpoint, rx: RdmaReceiverEndpoint, src: HostRegion, dst: HostRegion,
                         seed: int, offset: int, length: int) -> None:
    """A partial update: only ``[offset, offset + length)`` of fresh source bytes moves; the rest stays."""
    fill(src, seed)
    before = head(dst, dst.size)
    tx.write(timeout=30, offset=offset, length=length)
    rx.wait_complete(timeout=30)
    after, now = head(dst, dst.size), head(src, src.size)
    end = offset + length
    assert after[offset:end] == now[offset:end]
    assert after[:offset] == before[:offset] and after[end:] == before[end:]


def pair(src: Any, dst: Any, qps: int = 3, **kw: Any) -> tuple[RdmaSenderEndpoint, RdmaReceiverEndpoint]:
    rx = RdmaReceiverEndpoint(dst, qps=qps)
    tx = RdmaSenderEndpoint(src, qps=qps, **kw)
    # descriptors cross the control channel as msgpack: prove they survive it
    tx.connect(msgpack.unpackb(msgpack.packb(rx.descriptors())))
    rx.connect(msgpack.unpackb(msgpack.packb(tx.descriptors())))
    return tx, rx


# ----------------------------------------------------------------- transfers
@pytest.mark.parametrize(("qps", "wr_size"), [(1, 4096), (3, 100_003), (4, 1 << 20)])
def test_many_chunks_writes_cross_boundaries(qps: int, wr_size: int) -> None:
    """Requests of odd sizes straddle chunk boundaries on both sides; every byte arrives."""
    src_sizes = [16 * KIB, 64 * KIB, 4 * KIB, 128 * KIB, 8 * KIB, 256 * KIB, 12 * KIB, 512 * KIB, 36 * KIB]
    with HostRegion._from_chunks(src_sizes) as src, HostRegion._from_chunks([100 * KIB] * 11) as dst:
        assert len(src.resolve_extent(0, src.size).segments) == len(src_sizes)
        data = fill(src, 1)
        tx, rx = pair(src, dst, qps=qps, wr_size=wr_size)
        try:
            st = tx.write(timeout=30)
            rx.wait_complete(timeout=30)
            assert st["bytes"] == src.size and st["wrs"] == -(-src.size // wr_size)
            assert head(dst, src.size) == data
        finally:
            tx.close()
            rx.close()


def test_repeated_updates_reuse_one_registration() -> None:
    with HostRegion.allocate(2 << 20, 256 * KIB) as src, HostRegion.allocate(2 << 20, 192 * KIB) as dst:
        tx, rx = pair(src, dst, qps=2, wr_size=192 * KIB)
        try:
            mr_tx, mr_rx, rkey = tx._mr, rx._mr, rx.descriptors()["rkey"]
            for u in range(1, 5):
                data = fill(src, 100 + u)
                assert tx.write(timeout=30)["update"] == u
                assert rx.wait_complete(timeout=30)["update"] == u
                assert head(dst, src.size) == data, f"update {u}"
                assert tx._mr is mr_tx and rx._mr is mr_rx and rx.descriptors()["rkey"] == rkey
            check_partial_update(tx, rx, src, dst, 7, 300_000, 500_000)
        finally:
            tx.close()
            rx.close()


def test_tensor_region_roundtrip() -> None:
    src_tensors = dict(synthetic.tensors(3 << 20))
    with TensorRegion.from_tensors(src_tensors, chunk_size=256 * KIB) as src, \
            TensorRegion.from_manifest(src.manifest, chunk_size=320 * KIB) as dst:
        tx, rx = pair(src, dst, qps=2, wr_size=200_000)
        try:
            tx.write(timeout=30)
            rx.wait_complete(timeout=30)
        finally:
            tx.close()
            rx.close()
        views = dst.tensors()
        assert all(views[n].tobytes() == a.tobytes() for n, a in src_tensors.items())
        del views


def test_sender_may_run_ahead_of_the_receiver() -> None:
    """Three updates written back to back before the receiver waits: each wait takes
    exactly its own update's immediates (none of the next one's)."""
    with HostRegion.allocate(512 * KIB) as src, HostRegion.allocate(512 * KIB) as dst:
        tx, rx = pair(src, dst, qps=3, wr_size=64 * KIB)
        try:
            for u in range(1, 4):
                data = fill(src, 200 + u)
                tx.write(timeout=30)
            for u in range(1, 4):
                assert rx.wait_complete(timeout=30)["update"] == u
            assert head(dst, src.size) == data
            with pytest.raises(TransferTimeout):
                rx.wait_complete(timeout=0.5)   # nothing more was sent
        finally:
            tx.close()
            rx.close()


def test_fewer_requests_than_qps_still_completes_every_qp() -> None:
    """A QP with no data sends a zero-length WRITE_WITH_IMM, so the receiver still completes."""
    with HostRegion.allocate(4096) as src, HostRegion.allocate(4096) as dst:
        data = fill(src, 3)
        tx, rx = pair(src, dst, qps=4, wr_size=1 << 20)
        try:
            assert tx.write(timeout=30)["wrs"] == 1
            rx.wait_complete(timeout=30)
            assert head(dst, 4096) == data
        finally:
            tx.close()
            rx.close()


def post_threads_alive() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("tensorxfer-rdma-post")]


@pytest.mark.parametrize(("qps", "threads"), [(4, 1), (4, 2), (4, 3), (2, 4), (5, 2)])
def test_posting_threads_share_one_stripe(qps: int, threads: int) -> None:
    """Posting from several threads (each its QP group and CQ) moves the same stripe as one thread:
    request i on QP i % qps, every QP's final immediate, several updates in a row, odd sizes."""
    with HostRegion._from_chunks([96 * KIB, 300 * KIB, 52 * KIB, 700 * KIB]) as src, \
            HostRegion.allocate(1200 * KIB) as dst:
        tx, rx = pair(src, dst, qps=qps, wr_size=100_003, post_threads=threads)
        try:
            assert len(tx._cqs) == min(threads, qps) and len(rx._cqs) == 1
            for u in range(1, 4):
                data = fill(src, 300 + u)
                st = tx.write(timeout=30)
                assert st["wrs"] == -(-src.size // 100_003) and st["post_threads"] == min(threads, qps)
                assert rx.wait_complete(timeout=30)["update"] == u
                assert head(dst, src.size) == data, f"update {u}"
            check_partial_update(tx, rx, src, dst, 9, 123_457, 654_321)    # through the groups too
        finally:
            tx.close()
            rx.close()
    assert post_threads_alive() == []


def test_posting_threads_one_group_failing_fails_the_write_at_once() -> None:
    """A completion error in one posting thread's group is the write's error (the other thread stops,
    it does not wait out the timeout), and the endpoint is broken afterwards."""
    chunk = 128 * KIB
    with HostRegion._from_chunks([chunk] * 4) as src, HostRegion.allocate(4 * chunk) as dst:
        tx, rx = pair(src, dst, qps=4, wr_size=40 * KIB, post_threads=2, _first_chunk_only=True)
        try:
            t0 = time.monotonic()
            with pytest.raises(VerbsError) as ei:
                tx.write(timeout=20)
            assert time.monotonic() - t0 < 10
            assert ei.value.status == "IBV_WC_LOC_PROT_ERR"
            assert ei.value.offset is not None and ei.value.length is not None
            assert ei.value.offset + ei.value.length > chunk
            with pytest.raises(TransportUnavailable, match="broken"):
                tx.write(timeout=10)
        finally:
            tx.close()
            rx.close()
    assert post_threads_alive() == []


def test_posting_threads_argument_is_checked() -> None:
    with HostRegion.allocate(64 * KIB) as src:
        for bad in (0, -1, 1.5):
            with pytest.raises(ValueError, match="post_threads"):
                RdmaSenderEndpoint(src, post_threads=bad)  # type: ignore[arg-type]


# ----------------------------------------------------------------- the seed's bug, on purpose
def test_first_chunk_only_registration_fails_with_loc_prot_err() -> None:
    """UCX's bug: an MR over the first handle only.  The write crossing into the second
    handle fails with IBV_WC_LOC_PROT_ERR, reported with its QP and region range; the
    correct (whole-extent) registration then moves the same bytes."""
    chunk = 256 * KIB
    wr = 96 * KIB                       # request 2 is [192 KiB, 288 KiB): it crosses the boundary
    with HostRegion._from_chunks([chunk] * 4) as src, HostRegion.allocate(4 * chunk) as dst:
        data = fill(src, 5)
        tx, rx = pair(src, dst, qps=1, wr_size=wr, _first_chunk_only=True)
        try:
            assert tx._mr.length == chunk
            t0 = time.monotonic()
            with pytest.raises(VerbsError) as ei:
                tx.write(timeout=10)
            assert time.monotonic() - t0 < 10
            err = ei.value
            assert err.status == "IBV_WC_LOC_PROT_ERR"
            assert err.offset == 2 * wr and err.length == wr
            assert err.offset < chunk < err.offset + err.length
            assert err.qp_num == tx.descriptors()["qps"][0]["qp_num"]
            msg = str(err)
            assert "IBV_WC_LOC_PROT_ERR" in msg and f"[{2 * wr}, {3 * wr})" in msg and hex(err.qp_num) in msg
            with pytest.raises(TransportUnavailable, match="broken"):
                tx.write(timeout=10)
        finally:
            tx.close()
            rx.close()
        # the same layout, registered over the resolved extent: passes
        tx, rx = pair(src, dst, qps=3, wr_size=wr)
        try:
            assert tx._mr.length == 4 * chunk
            tx.write(timeout=30)
            rx.wait_complete(timeout=30)
            assert head(dst, src.size) == data
        finally:
            tx.close()
            rx.close()


def test_first_chunk_only_many_qps_names_a_request_beyond_the_mr() -> None:
    chunk = 128 * KIB
    with HostRegion._from_chunks([chunk] * 3) as src, HostRegion.allocate(3 * chunk) as dst:
        tx, rx = pair(src, dst, qps=3, wr_size=40 * KIB, _first_chunk_only=True)
        try:
            with pytest.raises(VerbsError) as ei:
                tx.write(timeout=10)
            assert ei.value.status == "IBV_WC_LOC_PROT_ERR"
            assert ei.value.offset is not None and ei.value.length is not None
            assert ei.value.offset + ei.value.length > chunk
        finally:
            tx.close()
            rx.close()


def test_revoked_remote_access_is_rem_access_err() -> None:
    """Deregistering the receiver's MR revokes REMOTE_WRITE at once: writes fail on the sender."""
    with HostRegion.allocate(256 * KIB) as src, HostRegion.allocate(256 * KIB) as dst:
        tx, rx = pair(src, dst, qps=1, wr_size=64 * KIB)
        try:
            rx._mr.close()
            with pytest.raises(VerbsError) as ei:
                tx.write(timeout=10)
            assert ei.value.status == "IBV_WC_REM_ACCESS_ERR" and ei.value.offset == 0
        finally:
            tx.close()
            rx.close()


# ----------------------------------------------------------------- independent pyverbs peer
def run_pyverbs(*args: object) -> subprocess.Popen[str]:
    if not Path("/usr/bin/python3").exists():
        pytest.skip("/usr/bin/python3 (Debian's, with python3-pyverbs) is missing")
    probe = subprocess.run(["/usr/bin/python3", "-c", "import pyverbs"], capture_output=True, timeout=120)
    if probe.returncode:
        pytest.skip("python3-pyverbs is not installed for /usr/bin/python3")
    return subprocess.Popen(["/usr/bin/python3", str(HERE / "rdma_pyverbs_peer.py"), *map(str, args)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def to_json(desc: dict[str, Any]) -> str:
    return json.dumps({**desc, "gid": desc["gid"].hex()}) + "\n"


def from_json(line: str) -> dict[str, Any]:
    d = json.loads(line)
    d["gid"] = bytes.fromhex(d["gid"])
    return dict(d)


def finish(p: subprocess.Popen[str]) -> None:
    try:
        p.wait(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        assert p.stdin is not None and p.stdout is not None
        p.stdin.close()
        p.stdout.close()


def test_pyverbs_receiver_sees_our_writes() -> None:
    """tensorxfer writes into a buffer pyverbs registered; pyverbs hashes what landed."""
    size = 1 << 20
    p = run_pyverbs("recv", size, 3, 2)
    assert p.stdin is not None and p.stdout is not None
    try:
        with HostRegion._from_chunks([192 * KIB, 320 * KIB, 64 * KIB, 448 * KIB]) as src:
            peer = from_json(p.stdout.readline())
            with RdmaSenderEndpoint(src, qps=3, wr_size=50_000) as tx:
                tx.connect(peer)
                p.stdin.write(to_json(tx.descriptors()))
                p.stdin.flush()
                assert json.loads(p.stdout.readline()) == {"connected": True}
                for u in (1, 2):
                    data = fill(src, 40 + u)
                    tx.write(timeout=30)
                    got = json.loads(p.stdout.readline())
                    assert got["update"] == u
                    assert got["sha256"] == hashlib.sha256(data).hexdigest(), f"update {u}"
        finish(p)
        assert p.returncode == 0
    finally:
        if p.poll() is None:
            finish(p)


def test_pyverbs_sender_writes_into_our_region() -> None:
    """A plain pyverbs post_send loop writes into our multi-chunk region."""
    import random

    size = 600 * KIB
    p = run_pyverbs("send", size, 2, 64 * KIB, 9, 1)
    assert p.stdin is not None and p.stdout is not None
    try:
        with HostRegion._from_chunks([100 * KIB] * 6) as dst, RdmaReceiverEndpoint(dst, qps=2) as rx:
            rx.connect(from_json(p.stdout.readline()))
            p.stdin.write(to_json(rx.descriptors()))
            p.stdin.flush()
            rx.wait_complete(timeout=60, peer_alive=lambda: p.poll() is None)
            assert head(dst, size) == random.Random(9).randbytes(size)
            p.stdin.write("{}\n")
            p.stdin.flush()
            p.stdout.readline()
        finish(p)
        assert p.returncode == 0
    finally:
        if p.poll() is None:
            finish(p)


# ----------------------------------------------------------------- two processes and faults
class Peer:
    """A tensorxfer endpoint in another process (tests/rdma_tx_peer.py), msgpack lines on stdio."""

    def __init__(self, *args: object) -> None:
        self.p = subprocess.Popen([sys.executable, str(HERE / "rdma_tx_peer.py"), *map(str, args)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def send(self, obj: object) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(msgpack.packb(obj).hex().encode() + b"\n")
        self.p.stdin.flush()

    def recv(self) -> Any:
        assert self.p.stdout is not None
        line = self.p.stdout.readline()
        assert line, f"peer exited (rc={self.p.poll()})"
        return msgpack.unpackb(bytes.fromhex(line.decode().strip()))

    def close(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait(timeout=60)
        for f in (self.p.stdin, self.p.stdout):
            if f is not None:
                f.close()


def test_two_processes_then_sender_killed_mid_transfer() -> None:
    """Update 1 from another process lands intact; the sender is then killed during
    update 2, and the receiver errors promptly (PeerLost), without hanging."""
    size, chunk = 8 << 20, 1 << 20
    peer = Peer("send", size, 2, chunk, 70, 1000, 256 * KIB)
    try:
        with HostRegion.allocate(size, 768 * KIB) as dst, RdmaReceiverEndpoint(dst, qps=2) as rx:
            rx.connect(peer.recv())
            peer.send(rx.descriptors())
            peer.send("go")
            alive = lambda: peer.p.poll() is None  # noqa: E731
            rx.wait_complete(timeout=120, peer_alive=alive)
            expect = np.random.default_rng(70).integers(0, 256, size, dtype=np.uint8).tobytes()
            assert head(dst, size) == expect
            assert peer.recv()["bytes"] == size
            killer = threading.Timer(0.3, peer.p.kill)
            killer.start()
            t0 = time.monotonic()
            with pytest.raises(PeerLost, match="sender lost"):
                # on a fast device whole updates may finish before the kill lands:
                # keep asking for more until it does
                while time.monotonic() - t0 < 60:
                    try:
                        peer.send("go")
                    except BrokenPipeError:
                        pass
                    rx.wait_complete(timeout=120, peer_alive=alive)
            killer.join()
            print(f"receiver raised PeerLost {time.monotonic() - t0:.2f} s after the kill was scheduled")
            assert time.monotonic() - t0 < 30
            # without a liveness hook, the deadline bounds the wait
            t0 = time.monotonic()
            with pytest.raises(TransferTimeout, match="incomplete after"):
                rx.wait_complete(timeout=1.0)
            assert time.monotonic() - t0 < 5
    finally:
        peer.close()


def test_receiver_killed_mid_transfer_sender_errors_promptly() -> None:
    """The receiver process dies during a write: with the liveness hook the sender raises
    PeerLost within ~50 ms of noticing; without it the stall timeout (or the QP's retry
    limit, IBV_WC_RETRY_EXC_ERR) bounds the wait."""
    size = 16 << 20
    peer = Peer("recv", size, 2, 1 << 20, 50)
    try:
        with HostRegion.allocate(size, 1 << 20) as src, RdmaSenderEndpoint(src, qps=2, wr_size=256 * KIB) as tx:
            rx_desc = peer.recv()
            tx.connect(rx_desc)
            peer.send(tx.descriptors())
            assert peer.recv() == {"connected": True}
            tx.write(timeout=60)
            assert peer.recv()["update"] == 1
            timer = threading.Timer(0.2, peer.p.kill)
            timer.start()
            t0 = time.monotonic()
            alive = lambda: peer.p.poll() is None  # noqa: E731
            with pytest.raises((PeerLost, VerbsError)) as ei:
                while time.monotonic() - t0 < 60:   # keep writing: the kill lands during one of these
                    tx.write(timeout=60, peer_alive=alive)
            timer.join()
            elapsed = time.monotonic() - t0
            print(f"sender saw {type(ei.value).__name__}: {ei.value} after {elapsed:.2f} s")
            assert elapsed < 5, f"sender noticed the dead peer only after {elapsed:.1f} s"
            if isinstance(ei.value, VerbsError):
                assert ei.value.status == "IBV_WC_RETRY_EXC_ERR"
            with pytest.raises(TransportUnavailable, match="broken"):
                tx.write(timeout=5)
            # no liveness hook: a fresh session aimed at the dead QPs stalls, and the
            # stall timeout ends it
            with RdmaSenderEndpoint(src, qps=2, wr_size=256 * KIB) as tx2:
                tx2.connect(rx_desc)
                t0 = time.monotonic()
                with pytest.raises((TransferTimeout, VerbsError)) as ei2:
                    tx2.write(timeout=2)
                elapsed = time.monotonic() - t0
                print(f"without the hook: {type(ei2.value).__name__}: {ei2.value} after {elapsed:.2f} s")
                assert elapsed < 10
    finally:
        peer.close()


# ----------------------------------------------------------------- registration paths
def test_dmabuf_registration_fallback_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    """Soft-RoCE rejects dmabuf MRs: the device path falls back to ibv_reg_mr and says so.

    The region below is a HostRegion presenting itself as a device region whose
    export_dmabuf() hands out a memfd (no dmabuf exporter exists in the VM); the
    kernel's real rejection of it drives the fallback.
    """
    from tensorxfer.transport import _verbs

    class DeviceLike:
        device = "cuda:0"

        def __init__(self, r: HostRegion) -> None:
            self.r, self.size = r, r.size

        def resolve_extent(self, offset: int, length: int) -> Any:
            return self.r.resolve_extent(offset, length)

        def export_dmabuf(self) -> int:
            return os.dup(self.r.chunks[0][2])

    with HostRegion.allocate(64 * KIB) as r, _verbs.Context.open() as ctx:
        pd = ctx.alloc_pd()
        with pytest.raises(VerbsError, match="ibv_reg_dmabuf_mr"):
            pd.reg_dmabuf_mr(r.chunks[0][2], 0, r.size, r.ptr, _verbs.ACCESS_LOCAL_WRITE)
        with caplog.at_level(logging.INFO, logger="tensorxfer.rdma"):
            mr = rdma.register_region(pd, DeviceLike(r), r.size, _verbs.ACCESS_LOCAL_WRITE)
        assert mr.path == "reg_mr" and mr.length == r.size
        assert "dmabuf registration failed" in caplog.text and "falling back to ibv_reg_mr" in caplog.text
        mr.close()

        # A driver that cannot export a dmabuf at all (cuMemGetHandleForAddressRange fails: CudaError) must
        # fall back too -- on nvidia-peermem hosts that is the only path; the CudaError used to escape.
        class NoDmabuf(DeviceLike):
            def export_dmabuf(self) -> int:
                raise CudaError("cuMemGetHandleForAddressRange: CUDA_ERROR_NOT_SUPPORTED")

        caplog.clear()
        with caplog.at_level(logging.INFO, logger="tensorxfer.rdma"):
            mr = rdma.register_region(pd, NoDmabuf(r), r.size, _verbs.ACCESS_LOCAL_WRITE)
        assert mr.path == "reg_mr" and "CUDA_ERROR_NOT_SUPPORTED" in caplog.text
        mr.close()


def test_a_final_immediate_twice_on_one_qp_is_refused_at_once() -> None:
    """A sender repeats QP 0's final immediate and never sends QP 1's.  The receive loop used to drop the repeat
    silently (and a flood of them kept it inside its nogil loop, past its deadline); now the repeat is a
    TransferError at once, not a timeout after the missing QP's wait."""
    from tensorxfer.transport import _verbs

    with HostRegion.allocate(64 * KIB) as src, HostRegion.allocate(64 * KIB) as dst:
        rx = RdmaReceiverEndpoint(dst, qps=2)
        tx = RdmaSenderEndpoint(src, qps=2)
        try:
            tx.connect(rx.descriptors())
            rx.connect(tx.descriptors())
            peer = rx.descriptors()
            for _ in range(2):      # QP 0 only, twice, each time with update 1's final immediate
                _verbs.write_striped(tx._qps[:1], tx._cq, tx._local_ptr, tx._mr.lkey, peer["addr"], peer["rkey"],
                                     4096, 4096, 4, 1, 1, 10.0)
            t0 = time.monotonic()
            with pytest.raises(TransferError, match="twice"):
                rx.wait_complete(timeout=10, update=1)
            assert time.monotonic() - t0 < 5
        finally:
            tx.close()
            rx.close()


# ----------------------------------------------------------------- resource hygiene
def test_close_is_children_first_and_idempotent() -> None:
    from tensorxfer.transport import _verbs

    with HostRegion.allocate(64 * KIB) as r:
        ctx = _verbs.Context.open()
        pd = ctx.alloc_pd()
        cq = ctx.create_cq(16)
        qp = pd.create_qp(cq, cq, 8, 8)
        mr = pd.reg_mr(r.ptr, r.size, _verbs.ACCESS_LOCAL_WRITE, owner=r)
        r.close()                       # never raises: the MR's buffer export keeps the memory mapped
        assert r.closed and not r.released
        cq.close()                      # the CQ closes the QP using it first
        assert qp.closed and cq.closed and not pd.closed
        ctx.close()                     # then MR, PD, context
        assert mr.closed and pd.closed and ctx.closed
        assert r.released               # the MR's export went with it: unmapped only now
        for obj in (qp, mr, cq, pd, ctx):
            obj.close()                 # idempotent
        with pytest.raises(ValueError, match="closed"):
            _ = mr.rkey
        with pytest.raises(ValueError, match="closed"):
            ctx.alloc_pd()


def test_unclosed_objects_warn() -> None:
    from tensorxfer.transport import _verbs

    with pytest.warns(ResourceWarning, match="unclosed RDMA"):
        ctx = _verbs.Context.open()
        pd = ctx.alloc_pd()
        del ctx, pd
        gc.collect()
    with HostRegion.allocate(64 * KIB) as dst:
        with pytest.warns(ResourceWarning, match="unclosed RdmaReceiverEndpoint"):
            rx = RdmaReceiverEndpoint(dst, qps=1)
            del rx
            gc.collect()


def test_endpoint_close_releases_everything() -> None:
    with HostRegion.allocate(64 * KIB) as src, HostRegion.allocate(64 * KIB) as dst:
        tx, rx = pair(src, dst, qps=2)
        objs = [tx._ctx, tx._pd, tx._mr, *tx._cqs, *tx._qps, rx._ctx, rx._pd, rx._mr, rx._cq, *rx._qps]
        tx.write(timeout=30)
        rx.wait_complete(timeout=30)
        assert len(tx._cqs) == 2 and post_threads_alive()   # two posting threads by default
        tx.close()
        rx.close()
        tx.close()
        rx.close()
        assert all(o.closed for o in objs)
        assert post_threads_alive() == []
        with pytest.raises(ValueError, match="closed"):
            tx.write()
    # the regions closed cleanly: the MRs released their buffer exports


# ----------------------------------------------------------------- bad input
def test_bad_descriptors_and_arguments() -> None:
    with HostRegion.allocate(64 * KIB) as src, HostRegion.allocate(32 * KIB) as small:
        with pytest.raises(ValueError, match="qps"):
            RdmaSenderEndpoint(src, qps=0)
        with pytest.raises(TypeError):
            RdmaSenderEndpoint(object())
        with pytest.raises(TransportUnavailable, match="not found"):
            RdmaSenderEndpoint(src, device="no-such-device")
        with RdmaSenderEndpoint(src, qps=2) as tx, RdmaReceiverEndpoint(small, qps=2) as rx, \
                RdmaReceiverEndpoint(src, qps=1) as rx1:
            with pytest.raises(ValueError, match="connect"):
                tx.write()
            with pytest.raises(ProtocolError):
                tx.connect({"transport": "tcp"})
            with pytest.raises(ProtocolError, match="expected receiver"):
                tx.connect(tx.descriptors())
            bad = rx.descriptors()
            bad["gid"] = b"short"
            with pytest.raises(ProtocolError, match="gid"):
                tx.connect(bad)
            with pytest.raises(ProtocolError, match="registered"):
                tx.connect(rx.descriptors())          # receiver region too small
            with pytest.raises(ProtocolError, match="QPs"):
                tx.connect(rx1.descriptors())
            with pytest.raises(ProtocolError):
                rx.connect("nonsense")                # type: ignore[arg-type]
