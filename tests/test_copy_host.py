"""The copy host: targets on one device hand their ipc pairs' copies to one of them (real sockets, memfds,
a real TCPStore; the GPU case, where it is on by default, runs in test_sync's cuda-marked tests)."""

from __future__ import annotations

import logging
import os
import threading

import pytest

from tensorxfer.errors import PeerLost, TransferError
from tensorxfer.sync.copy_host import elect
from tensorxfer.sync.rendezvous import TorchStoreRendezvous, open_tcp_store
from tensorxfer.transport.ipc.delegate import CopyHost, CopyLane

torch = pytest.importorskip("torch", reason="the weight sync's examples are torch tensors")

import tensorxfer as tx  # noqa: E402
from tests.test_sync import (  # noqa: E402  (after the skip: test_sync needs torch)
    Stores,
    expected_target,
    global_tensors,
    run_ranks,
    source_tensors,
    target_tensors,
)


def test_a_lane_of_another_group_is_refused_and_close_is_idempotent() -> None:
    host = CopyHost(b"k" * 32, None, stall_timeout=5)
    try:
        with pytest.raises(TransferError, match="authentication"):
            CopyLane(host.path, b"x" * 32, timeout=5)
        lane = CopyLane(host.path, b"k" * 32, timeout=5)    # the right key gets in
        lane.close()
        lane.close()
    finally:
        host.close()
        host.close()
    assert not os.path.exists(host.path)
    with pytest.raises(PeerLost, match="cannot reach"):
        CopyLane(host.path, b"k" * 32, timeout=5)
    assert not [t for t in threading.enumerate() if t.name.startswith("tensorxfer-copy")]


def test_the_first_target_on_a_device_hosts_and_a_gone_host_is_passed_over() -> None:
    server = open_tcp_store("127.0.0.1", 0, True)
    rdv = TorchStoreRendezvous(open_tcp_store("127.0.0.1", server.port, False))
    region = tx.TensorRegion.from_tensors({"w": torch.zeros(1024)})
    made = []
    try:
        def key_of(*parts: object) -> str:
            return "g/" + "/".join(map(str, parts))
        first = elect(rdv, key_of, 0, region, None, 5.0)
        made.append(first[0])
        assert first[0] is not None and first[1] is None
        second = elect(rdv, key_of, 1, region, None, 5.0)
        assert second == (None, (first[0].path, None))     # follows the first
        first[0].close()                                    # the host goes (its socket with it)
        third = elect(rdv, key_of, 2, region, None, 5.0)    # a later target hosts in the next generation
        made.append(third[0])
        assert third[0] is not None and third[1] is None and third[0].path != first[0].path
    finally:
        for host in made:
            if host is not None:
                host.close()
        region.close()
        rdv.close()


def test_a_killed_host_left_in_the_store_is_passed_over(tmp_path) -> None:
    """A host killed outright leaves its record and its socket file: the next target checks the process."""
    import subprocess
    import sys

    import msgpack

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(gone.stdout)
    leftover = tmp_path / "s"
    leftover.write_bytes(b"")
    server = open_tcp_store("127.0.0.1", 0, True)
    rdv = TorchStoreRendezvous(open_tcp_store("127.0.0.1", server.port, False))
    region = tx.TensorRegion.from_tensors({"w": torch.zeros(1024)})
    host = None
    try:
        def key_of(*parts: object) -> str:
            return "g/" + "/".join(map(str, parts))
        from tensorxfer.sync.copy_host import device_identity

        rdv.publish_once(key_of("copy-host", device_identity(region), 0),
                         msgpack.packb({"rank": 0, "pid": dead_pid, "path": str(leftover)}))
        host, follows = elect(rdv, key_of, 1, region, None, 5.0)
        assert host is not None and follows is None
    finally:
        if host is not None:
            host.close()
        region.close()
        rdv.close()


def test_followers_copy_on_their_own_once_the_host_is_gone(caplog: pytest.LogCaptureFixture) -> None:
    """One target hosts (whichever was elected first), the other follows; the host closes between steps: the
    follower's next step fails over to copying itself, with the right bytes, and says so."""
    n, m = 2, 2
    stores = Stores()
    g0 = global_tensors(0)
    src_tensors = [source_tensors(r, n, g0) for r in range(n)]
    tgt_tensors = [target_tensors(r, m, torch.float32) for r in range(m)]
    syncs = run_ranks(
        [lambda r=r: tx.WeightSync(stores.client(), "h", "source", r, (n, m), src_tensors[r], token="k",
                                   transport="ipc", timeout=30, elastic=False) for r in range(n)] +
        [lambda r=r: tx.WeightSync(stores.client(), "h", "target", r, (n, m), tgt_tensors[r], token="k",
                                   transport="ipc", timeout=30, elastic=False, copy_host=True) for r in range(m)])
    sources, targets = syncs[:n], syncs[n:]
    try:
        [host] = [t._copy_host for t in targets if t._copy_host is not None]
        for step in (1, 2, 3):
            g = global_tensors(step)
            for r in range(n):
                for name, src in source_tensors(r, n, g).items():
                    src_tensors[r][name].tensor.copy_(src.tensor)
            if step == 3:
                host.close()
            with caplog.at_level(logging.WARNING, logger="tensorxfer.transport.ipc.copy"):
                results = run_ranks([s.push for s in sources] + [lambda t=t: t.wait(timeout=60) for t in targets])
            assert results[n:] == [step] * m
            for r in range(m):
                want = expected_target(r, m, g)
                for name, target in tgt_tensors[r].items():
                    assert torch.equal(target.tensor, want[name]), (step, r, name)
        assert host.copies == 2 * n        # steps 1 and 2: every follower pair; step 3 was copied by target 1
        assert sum("copies in its own process from now on" in r.message for r in caplog.records) == n
    finally:
        for s in syncs:
            s.close()


def test_a_lane_copies_each_step_and_keeps_what_a_new_setup_does_not_replace() -> None:
    """Lane-level, on memfds: a setup maps the source and the follower's region; a later setup without the
    source's handles (a new plan for the same memory) keeps that mapping, one with new handles replaces it;
    the follower's region is passed once."""
    import numpy as np

    from tensorxfer.memory import HostRegion
    from tensorxfer.transport.segments import Segments

    def region_of(values: bytes) -> HostRegion:
        region = HostRegion.allocate(len(values))
        memoryview(region)[:len(values)] = values
        return region

    size = 1 << 16
    a, b = region_of(bytes(range(256)) * (size // 256)), region_of(b"\x07" * size)
    follower = tx.TensorRegion.from_tensors({"d": torch.zeros(size, dtype=torch.uint8)})    # a target's region
    dst = follower.region
    host = CopyHost(None, None, stall_timeout=5)
    lane = CopyLane(host.path, None, timeout=5)
    try:
        def handles(region: HostRegion) -> list[tuple[int, int]]:
            return [(sz, fd) for _, sz, fd in region.export_handles()]

        first = Segments.of([0, 4096], [100, 5000], [64, 32], [3, 1], [256, 0], [64, 0])   # a strided group too
        src_a = handles(a)
        lane.setup(src_a, size, follower, first, "host", "a1")
        for _, fd in src_a:
            os.close(fd)        # still the caller's: the host holds its own
        lane.copy(1)
        view = np.frombuffer(memoryview(dst), np.uint8)
        src = np.frombuffer(memoryview(a), np.uint8)
        want = np.zeros(size, np.uint8)
        for j in range(3):
            want[100 + 64 * j:164 + 64 * j] = src[256 * j:256 * j + 64]
        want[5000:5032] = src[4096:4128]
        assert np.array_equal(view, want)
        lane.setup(None, size, follower, Segments.of([10], [20000], [50]), "host", "a2")     # same source
        lane.copy(2)
        want[20000:20050] = src[10:60]
        assert np.array_equal(view, want)
        src_b = handles(b)
        lane.setup(src_b, size, follower, Segments.of([0], [30000], [8]), "host", "b1")      # a new source
        for _, fd in src_b:
            os.close(fd)
        lane.copy(3)
        want[30000:30008] = 7
        assert np.array_equal(view, want)
        assert host.copies == 3 and host.lanes_served == 1
        del view, src
    finally:
        lane.close()
        host.close()
        for r in (a, b, follower):
            r.close()


def test_a_setup_that_reaches_outside_a_region_is_refused_and_the_host_serves_on() -> None:
    from tensorxfer.memory import HostRegion
    from tensorxfer.transport.segments import Segments

    src, dst = HostRegion.allocate(4096), tx.TensorRegion.from_tensors({"d": torch.zeros(4096, dtype=torch.uint8)})
    host = CopyHost(None, None, stall_timeout=5)
    try:
        wrap = 1 << 63
        for segments in (Segments.of([4090], [0], [64]), Segments.of([0], [4090], [64]),
                         Segments.of([0], [0], [8], [3], [wrap], [wrap]),         # steps that wrap around
                         Segments.of([2**64 - 8], [2**64 - 8], [16]),             # an end that wraps
                         Segments.of([0], [0], [8], [2**40], [0], [8]),           # a count past the region
                         Segments.of([0, 0], [0, 0], [4096, 4096])):              # the region written twice
            lane = CopyLane(host.path, None, timeout=5)
            handles = [(sz, fd) for _, sz, fd in src.export_handles()]
            try:
                with pytest.raises(TransferError, match=r"copy host: segments (reach past the regions|write)"):
                    lane.setup(handles, 4096, dst, segments, "host", "x")
            finally:
                for _, fd in handles:
                    os.close(fd)
                lane.close()
        lane = CopyLane(host.path, None, timeout=5)     # the host still takes lanes
        lane.close()
    finally:
        host.close()
        src.close()
        dst.close()
