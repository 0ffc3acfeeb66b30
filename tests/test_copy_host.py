"""The copy host: targets on one device hand their ipc pairs' copies to one of them (real sockets, memfds,
a real TCPStore; the GPU case, where it is on by default, runs in test_sync's cuda-marked tests)."""

from __future__ import annotations

import logging
import os
import shutil
import threading
from typing import Any

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


def _refused_setups(cases: list[tuple[Any, str]]) -> None:
    """Each ``(segments, message)`` offered over a fresh lane to one copy host of host memory is refused with
    ``message``; the host still takes lanes afterwards."""
    from tensorxfer.memory import HostRegion

    src, dst = HostRegion.allocate(4096), tx.TensorRegion.from_tensors({"d": torch.zeros(4096, dtype=torch.uint8)})
    host = CopyHost(None, None, stall_timeout=5)
    try:
        for segments, message in cases:
            lane = CopyLane(host.path, None, timeout=5)
            handles = [(sz, fd) for _, sz, fd in src.export_handles()]
            try:
                with pytest.raises(TransferError, match=message):
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


def test_a_setup_that_reaches_outside_a_region_is_refused_and_the_host_serves_on() -> None:
    from tensorxfer.transport.segments import Segments

    wrap = 1 << 63
    outside = r"copy host: segments (reach past the regions|write)"
    _refused_setups([(segments, outside) for segments in (
        Segments.of([4090], [0], [64]), Segments.of([0], [4090], [64]),
        Segments.of([0], [0], [8], [3], [wrap], [wrap]),         # steps that wrap around
        Segments.of([2**64 - 8], [2**64 - 8], [16]),             # an end that wraps
        Segments.of([0], [0], [8], [2**40], [0], [8]),           # a count past the region
        Segments.of([0, 0], [0, 0], [4096, 4096]))])             # the region written twice


def test_quantizing_tiles_offered_for_host_memory_are_refused_and_the_host_serves_on() -> None:
    import numpy as np

    from tensorxfer.quant.tiles import WIDTH, QuantTiles
    from tensorxfer.transport.segments import Segments

    table = np.zeros((1, WIDTH), np.int64)
    table[0, :4] = (0, 256, 8, 128)        # one 8 x 128 bf16 block; its values and scale go nowhere
    table[0, 10] = -1
    plain = Segments.of([0], [0], [64])
    segments = Segments(plain.src_off, plain.dst_off, plain.nbytes, plain.count, plain.src_stride, plain.dst_stride,
                        tiles=QuantTiles(table, np.zeros(1, np.int32), ("w",)))
    _refused_setups([(segments, r"setup out of range")])       # only a GPU pair quantizes


# ---------------------------------------------------------------- a copy host in a process of its own
import json  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from tensorxfer.errors import AuthError, TransferTimeout  # noqa: E402
from tensorxfer.memory import HostRegion  # noqa: E402
from tensorxfer.memory._fence import DONE, RUNNING, word  # noqa: E402
from tensorxfer.transport.base import TransferContext  # noqa: E402
from tensorxfer.transport.ipc import IpcReceiver, IpcSender  # noqa: E402
from tensorxfer.transport.ipc.delegate import HOST_DIR_PREFIX  # noqa: E402
from tensorxfer.transport.ipc.lane import IN_DOUBT  # noqa: E402
from tensorxfer.transport.segments import Segments  # noqa: E402

from .helpers import GPU_REASON, ROOT, Background, region_of, wait_until  # noqa: E402

PEER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "copy_host_peer.py")
KEY = b"k" * 32


class HostPeer:
    """``tests/copy_host_peer.py``: a CopyHost in a child process, driven over stdin, signalled for real."""

    def __init__(self, key: bytes | None = KEY, stall: float = 5.0, device: str = "cpu") -> None:
        self._err = tempfile.TemporaryFile()
        index = "" if device == "cpu" else device.partition(":")[2] or "0"
        self.proc = subprocess.Popen([sys.executable, PEER, key.decode() if key else "", str(stall), index],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, text=True,
                                     env=dict(os.environ, PYTHONPATH=ROOT))
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line:
            self.close()
            raise AssertionError(f"the copy host peer did not start: {self.stderr()}")
        info = json.loads(line)
        self.path, self.pid = info["path"], info["pid"]

    def ask(self, cmd: str) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"the copy host peer died: {self.stderr()}"
        return json.loads(line)

    def stderr(self) -> str:
        self._err.seek(0)
        return self._err.read().decode(errors="replace")

    def stop(self) -> None:
        """SIGSTOP, and return once every thread of the process is stopped (a copy thread runs on a moment after
        the main one stopped)."""
        os.kill(self.pid, signal.SIGSTOP)
        wait_until(lambda: all(_proc_state(self.pid, t) in ("T", "t") for t in os.listdir(f"/proc/{self.pid}/task")),
                   5, "the copy host stopping")

    def cont(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()
        self._err.close()


def _proc_state(pid: int, task: str) -> str:
    try:
        with open(f"/proc/{pid}/task/{task}/stat", "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return "T"      # the thread ended meanwhile
    return raw[raw.rindex(b")") + 2:].split()[0].decode()


def _ctx(stall: float) -> TransferContext:
    return TransferContext(local_host="", peer_host="", session_key=b"s" * 32, stall_timeout=stall)


class Follower:
    """A target's copying ipc receiver whose one pair goes through the copy host at ``path``, fed by an ipc
    sender in this process (which outwaits the receiver: the receiver's outcome is the step's)."""

    def __init__(self, src: tx.TensorRegion, dst: tx.TensorRegion, segments: Segments, path: str,
                 stall: float) -> None:
        self.src, self.dst, self.segments = src, dst, segments
        self.rt = IpcReceiver(_ctx(stall))
        self.rt.copy_host = (path, KEY)
        self.st = IpcSender(_ctx(60.0))
        self.fresh = True

    def step(self, seq: int) -> None:
        """One update: the receiver's error, if it failed, is raised (the next step then starts a new session)."""
        d = self.rt.prepare(self.dst, seq, self.fresh, self.segments)
        job = Background(self.rt.wait)
        self.fresh = True
        try:
            self.st.connect(self.src, seq, d, self.segments)
            self.st.send(self.src)
        except TransferError:
            pass        # the receiver failed: its error is the one to see
        job.result(60)
        self.fresh = False

    @property
    def fence(self) -> Any:
        lane = self.rt._copy_lane
        assert lane is not None and lane._fence is not None
        return lane._fence

    def close(self) -> None:
        self.st.close()
        self.rt.close()


def _region(nbytes: int, device: str) -> tx.TensorRegion:
    return region_of(nbytes) if device == "cpu" else \
        tx.TensorRegion.from_manifest(tx.Manifest.layout([("w", "U8", (nbytes,))]), device=device)


def _fill(region: tx.TensorRegion, value: int) -> None:
    if region.is_cuda:
        region.tensors("torch")["w"].fill_(value)
        torch.cuda.synchronize()
        return
    view = np.frombuffer(memoryview(region.region), np.uint8, count=region.nbytes)
    view[:] = value
    del view


def _holds(region: tx.TensorRegion, value: int, width: int, stride: int) -> bool:
    """Whether the bytes a one-group pair of ``width``-byte rows ``stride`` apart writes all hold ``value``, and
    the rest zero."""
    if region.is_cuda:
        rows = region.tensors("torch")["w"].view(-1, stride)
        return bool((rows[:, :width] == value).all()) and bool((rows[:, width:] == 0).all())
    view = np.frombuffer(memoryview(region.region), np.uint8, count=region.nbytes).reshape(-1, stride)
    try:
        return bool((view[:, :width] == value).all() and (view[:, width:] == 0).all())
    finally:
        del view


# a pair slow enough to stop its host mid-copy: rows of 16 bytes, 64 apart (512 MiB each side; on a GPU,
# where a copy is ~10x faster and the host's thread waits for it in cuStreamSynchronize, 4 GiB)
WIDTH, STRIDE = 16, 64
DEVICES = ["cpu", pytest.param("cuda:0", marks=[
    pytest.mark.cuda, pytest.mark.skipif(GPU_REASON is not None, reason=f"needs a CUDA GPU: {GPU_REASON}")])]

#: The stall timeout of the cases that stop a host: the follower gives a host half of it, and a loaded
#: machine's prepare, connect and local copy must fit in the other half.
STOPPED_STALL = 4.0


def _big_pair(device: str) -> tuple[tx.TensorRegion, tx.TensorRegion, Segments]:
    big = 512 << 20 if device == "cpu" else 4 << 30
    src, dst = _region(big, device), _region(big, device)
    return src, dst, Segments.of([0], [0], [WIDTH], [big // STRIDE], [STRIDE], [STRIDE])


def _check_kernel(device: str) -> None:
    """On a GPU the host must serve the steps in StridedCopy.serve_lane (the kernel built), or this tests nothing
    of it."""
    if device != "cpu":
        from tensorxfer.memory import strided

        assert strided.kernel_image() is not None, "strided_copy.fatbin was not built"


def _stop_mid_copy(host: HostPeer, follower: Follower, seq: int, job: Background) -> bool:
    """SIGSTOP the host once the fence says it took step ``seq``; True if it stopped before the step was done."""
    fence, running, done = follower.fence, word(seq, RUNNING), word(seq, DONE)
    while True:
        seen = fence.load()
        if seen == running:
            host.stop()
            break
        if seen == done or not job.thread.is_alive():
            return False
    if fence.load() == running:
        return True
    host.cont()         # the copy ended before the stop landed: let this step finish, try the next
    return False


def _step_stopped_mid_copy(host: HostPeer, follower: Follower, seq: int) -> tuple[Background, int]:
    """Run steps from ``seq`` on (each a new version of the source) until one is caught with its host stopped
    mid-copy; ``(that step's job, its seq)``."""
    for attempt in range(seq, seq + 10):
        _fill(follower.src, attempt)
        job = Background(follower.step, attempt)
        if _stop_mid_copy(host, follower, attempt, job):
            return job, attempt
        job.result(60)
    raise AssertionError("never caught the copy host mid-copy in 10 steps")


def _end_case(follower: Any, host: Any, *regions: Any) -> None:
    """A stopped/killed-host case's teardown, however it ended: the follower, the host, what its killed host left in
    doubt (looking releases it), the regions."""
    follower.close()
    host.close()
    IN_DOUBT.pending()
    for r in regions:
        r.close()


def _release_doubts() -> None:
    assert not IN_DOUBT.pending(), "a test left memory in doubt"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.slow
def test_a_host_stopped_before_it_read_the_step_never_writes_it_the_follower_copies_it_itself(device: str) -> None:
    """Case A: the host is SIGSTOPped between steps; the follower's next step revokes the grant after half the
    stall timeout, copies the pair itself and succeeds.  Resumed, the host reads the queued step, finds it given up
    (the fence), answers E and writes nothing -- though the source holds newer bytes by then."""
    _check_kernel(device)
    host = HostPeer(device=device)
    src, dst = _region(1 << 20, device), _region(1 << 20, device)
    segments = Segments.of([0], [0], [128], [4096], [256], [256])
    follower = Follower(src, dst, segments, host.path, stall=STOPPED_STALL)
    try:
        _fill(src, 1)
        follower.step(1)                    # through the host
        assert _holds(dst, 1, 128, 256)
        host.stop()
        _fill(src, 2)
        t = time.monotonic()
        follower.step(2)                    # the host never answers: revoked (at half the stall), copied here
        assert STOPPED_STALL / 2 <= time.monotonic() - t < STOPPED_STALL
        assert _holds(dst, 2, 128, 256)
        assert follower.rt.copy_host is None and follower.rt._copy_lane is None     # the lane was given up
        _fill(src, 3)                       # what a late copy would write
        host.cont()
        wait_until(lambda: host.ask("stats")["revoked"] == 1, 10, "the resumed host refusing the step")
        time.sleep(0.3)
        assert _holds(dst, 2, 128, 256), "the copy host wrote a step its follower had given up"
        assert host.ask("stats")["copies"] == 1     # step 1 (on a GPU counted when its lane's run ended)
    finally:
        _end_case(follower, host, src, dst)
    _release_doubts()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.slow
def test_a_host_stopped_mid_copy_fails_the_step_and_holds_the_region_until_it_finishes(
        device: str, caplog: pytest.LogCaptureFixture) -> None:
    """Case B: the host is SIGSTOPped while it copies a step (the fence reads RUNNING): the step fails with a
    TransferTimeout naming the host's pid and the step; while it is stopped every later step fails within the
    stall timeout (the region is in doubt: nothing is copied into it); resumed, the host finishes (the fence reads
    done), the doubt clears and the next step succeeds -- and nothing is written after it."""
    _check_kernel(device)
    host = HostPeer(device=device)
    src, dst, segments = _big_pair(device)
    follower = Follower(src, dst, segments, host.path, stall=STOPPED_STALL)
    try:
        _fill(src, 1)
        follower.step(1)
        assert _holds(dst, 1, WIDTH, STRIDE)
        t = time.monotonic()
        job, seq = _step_stopped_mid_copy(host, follower, 2)
        with pytest.raises(TransferTimeout, match=rf"pid {host.pid}\b.*step {seq}\b"):
            job.result(30)
        assert time.monotonic() - t < STOPPED_STALL * 3 + 5
        assert IN_DOUBT.pending(dst) == [(host.pid, seq, RUNNING)]
        for later in (seq + 1, seq + 2):    # while it is stopped: refused within the stall timeout
            _fill(src, later)
            t = time.monotonic()
            with pytest.raises(TransferTimeout, match=rf"in doubt.*pid {host.pid}\b.*step {seq}\b.*kill"):
                follower.step(later)
            assert time.monotonic() - t < STOPPED_STALL
        assert IN_DOUBT.pending(dst) == [(host.pid, seq, RUNNING)]
        host.cont()
        with caplog.at_level(logging.WARNING, logger="tensorxfer.transport.ipc.lane"):
            wait_until(lambda: not IN_DOUBT.pending(dst), 20, "the resumed host finishing its step")
        assert any(f"through with step {seq} (the fence reads done)" in r.message for r in caplog.records)
        _fill(src, 7)
        follower.step(seq + 3)              # copied here: the lane was given up
        assert _holds(dst, 7, WIDTH, STRIDE)
        time.sleep(0.3)
        assert _holds(dst, 7, WIDTH, STRIDE), "a write landed after the version was reported"
        assert host.ask("stats")["copies"] >= 2     # its late copy counts once it finished
    finally:
        _end_case(follower, host, src, dst)
    _release_doubts()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("when", ["during the step", "after the step failed"])
@pytest.mark.slow
def test_a_host_killed_mid_copy_clears_the_doubt_and_the_follower_copies(when: str, device: str) -> None:
    """Case C: a host SIGKILLed while it holds a step (stopped mid-copy, then killed): its process gone, nothing of
    it can write; the follower copies the pair itself -- in that same step, or (killed after the step failed in
    doubt) in the next one."""
    _check_kernel(device)
    host = HostPeer(device=device)
    src, dst, segments = _big_pair(device)
    follower = Follower(src, dst, segments, host.path, stall=2.0)
    try:
        _fill(src, 1)
        follower.step(1)
        job, seq = _step_stopped_mid_copy(host, follower, 2)
        if when == "during the step":
            host.kill()
            job.result(30)                  # the step succeeds: copied here once the host's pidfd said it ended
            assert _holds(dst, seq, WIDTH, STRIDE)
        else:
            with pytest.raises(TransferTimeout, match=rf"pid {host.pid}\b"):
                job.result(30)
            assert IN_DOUBT.pending(dst) == [(host.pid, seq, RUNNING)]
            host.kill()
            _fill(src, 9)
            follower.step(seq + 1)
            assert _holds(dst, 9, WIDTH, STRIDE)
        assert IN_DOUBT.pending(dst) == []
    finally:
        _end_case(follower, host, src, dst)
    _release_doubts()


# ---------------------------------------------------------------- resource limits
def _sparse_memfd(size: int) -> int:
    """A sealed memfd of ``size`` bytes, none of them committed."""
    import fcntl

    fd = os.memfd_create("tensorxfer-test-sparse", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    return fd


def _handles(region: HostRegion) -> list[tuple[int, int]]:
    return [(size, fd) for _, size, fd in region.export_handles()]


def test_a_lanes_huge_sparse_region_is_mapped_lazily_stalls_no_other_lane_and_is_refused_over_the_limit() -> None:
    """One lane sets up a 3 GiB sparse source while another lane's steps go on: they keep answering promptly and
    the host's RSS stays flat (mapped lazily: only the pages a copy touches are committed; populated, it took a
    host to 3.1 GiB and froze its other lanes 3.5 s).  With ``limit_bytes`` set, a 1 TiB source is refused,
    naming its size and the limit, before anything is mapped."""
    import psutil

    host = HostPeer(stall=10)
    proc = psutil.Process(host.pid)
    src = HostRegion.allocate(1 << 20)
    memoryview(src)[:4096] = b"\x05" * 4096
    dsts = [region_of(1 << 20) for _ in range(3)]
    lanes: list[CopyLane] = []
    owned: list[int] = []
    latencies: list[float] = []
    stop = threading.Event()
    try:
        steady = CopyLane(host.path, KEY, timeout=10)
        lanes.append(steady)
        owned += [fd for _, fd in _handles(src)]
        steady.setup([(1 << 20, owned[-1])], 1 << 20, dsts[0], Segments.of([0], [0], [4096]), "host", "a")

        def feed() -> None:
            seq = 0
            while not stop.is_set():
                seq += 1
                t = time.monotonic()
                assert steady.copy(seq)
                latencies.append(time.monotonic() - t)
        feeder = Background(feed)
        wait_until(lambda: len(latencies) > 20, 10, "the steady lane's steps")
        rss = proc.memory_info().rss
        owned.append(_sparse_memfd(3 << 30))
        huge = CopyLane(host.path, KEY, timeout=10)
        lanes.append(huge)
        before = len(latencies)
        huge.setup([(3 << 30, owned[-1])], 3 << 30, dsts[1], Segments.of([0], [0], [4096]), "host", "b")
        assert huge.copy(1)
        time.sleep(0.2)
        stop.set()
        feeder.result(30)
        assert len(latencies) > before, "the steady lane made no step while the huge one was set up"
        assert max(latencies[before:]) < 1.0, f"a lane stalled {max(latencies[before:]):.2f} s behind another's setup"
        grown = proc.memory_info().rss - rss
        assert grown < 64 << 20, f"the host's RSS grew {grown >> 20} MiB for a sparse region it hardly read"
        view = np.frombuffer(memoryview(dsts[1].region), np.uint8, count=4096)
        assert not view.any()       # a sparse file's first page: zeros, copied
        del view

        assert host.ask("limit 67108864") == {"limit": 64 << 20}
        owned.append(_sparse_memfd(1 << 40))
        refused = CopyLane(host.path, KEY, timeout=10)
        lanes.append(refused)
        with pytest.raises(TransferError, match=r"source region of 1099511627776 bytes .*limit of 67108864 bytes"):
            refused.setup([(1 << 40, owned[-1])], 1 << 40, dsts[2], Segments.of([0], [0], [4096]), "host", "c")
        assert proc.memory_info().rss - rss < 64 << 20
        under = CopyLane(host.path, KEY, timeout=10)     # a region under the limit still gets in
        lanes.append(under)
        under.setup([(1 << 20, owned[0])], 1 << 20, dsts[2], Segments.of([0], [0], [4096]), "host", "d")
        assert under.copy(1)
        view = np.frombuffer(memoryview(dsts[2].region), np.uint8, count=4096)
        assert (view == 5).all()
        del view
    finally:
        stop.set()
        for lane in lanes:
            lane.close()
        for fd in owned:
            os.close(fd)
        host.close()
        src.close()
        for d in dsts:
            d.close()


# ---------------------------------------------------------------- a killed host's directory
def test_the_next_election_removes_the_directory_of_a_host_killed_outright() -> None:
    """SIGKILL leaves a host's socket directory behind; the next election on the machine removes it -- and only
    what it can prove is a dead host's: a live host's directory, one without an owner record and one whose
    recorded process is this (live) one stay; one whose pid now belongs to a process started later goes."""
    peer = HostPeer()
    dead = os.path.dirname(peer.path)
    peer.kill()
    peer.close()
    assert os.path.isdir(dead), "SIGKILL removed the directory after all: nothing to test"
    root = tempfile.gettempdir()
    stray = tempfile.mkdtemp(prefix=HOST_DIR_PREFIX)           # no record (a host between mkdtemp and writing it)
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip()
    reused, mine = tempfile.mkdtemp(prefix=HOST_DIR_PREFIX), tempfile.mkdtemp(prefix=HOST_DIR_PREFIX)
    from tensorxfer.transport.ipc.delegate import _start_time

    theirs = tempfile.mkdtemp(prefix=HOST_DIR_PREFIX)         # a dead host's record, but another user's directory
    for d, start in ((reused, 1), (mine, _start_time(os.getpid())), (theirs, 1)):
        with open(os.path.join(d, "owner"), "w") as f:
            json.dump({"pid": os.getpid(), "start": start, "boot": boot}, f)
    if os.getuid() == 0:
        os.chown(theirs, 65534, 65534)
    else:
        shutil.rmtree(theirs)       # only root can make a directory of another user's here
    live = CopyHost(None, None, stall_timeout=5)
    server = open_tcp_store("127.0.0.1", 0, True)
    rdv = TorchStoreRendezvous(open_tcp_store("127.0.0.1", server.port, False))
    region = region_of(4096)
    elected = None
    try:
        elected, _ = elect(rdv, lambda *parts: "d/" + "/".join(map(str, parts)), 0, region, None, 5.0)
        assert not os.path.exists(dead)
        assert not os.path.exists(reused)
        assert os.path.isdir(stray) and os.path.isdir(mine) and os.path.exists(live.path)
        assert os.path.isdir(theirs) == (os.getuid() == 0)
        assert elected is not None and os.path.exists(elected.path)
        assert os.path.dirname(dead) == root
    finally:
        if elected is not None:
            elected.close()
        live.close()
        for d in (stray, reused, mine, theirs):
            shutil.rmtree(d, ignore_errors=True)
        region.close()
        rdv.close()


# ---------------------------------------------------------------- close() racing the acceptor
@pytest.mark.slow
def test_close_racing_the_acceptor_leaves_no_thread_exception() -> None:
    """Hosts closed while lanes keep connecting: no thread dies of an unhandled error (the acceptor died of EBADF
    when close() closed the listener under its admit), and close() itself raises nothing."""
    import socket

    failures: list[BaseException] = []
    hook, interval = threading.excepthook, sys.getswitchinterval()
    threading.excepthook = lambda args: failures.append(args.exc_value)
    sys.setswitchinterval(1e-5)         # thread switches anywhere: the race's window opens often
    try:
        for _ in range(100):
            host = CopyHost(None, None, stall_timeout=2)
            done = threading.Event()

            def hammer(path: str = host.path, done: threading.Event = done) -> None:
                while not done.is_set():
                    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                    try:
                        s.connect(path)
                    except OSError:
                        pass
                    finally:
                        s.close()
            t = threading.Thread(target=hammer)
            t.start()
            time.sleep(0.01)
            try:
                host.close()
            except Exception as e:
                failures.append(e)
            done.set()
            t.join()
    finally:
        sys.setswitchinterval(interval)
        threading.excepthook = hook
    wait_until(lambda: not [t for t in threading.enumerate() if t.name.startswith(("tensorxfer-copy",
                                                                                    "tensorxfer-prove"))], 10,
               "the hosts' threads ending")
    assert not failures, f"{len(failures)} errors, e.g. {failures[0]!r}"


# ---------------------------------------------------------------- the host's proof
def test_a_host_with_a_wrong_proof_is_refused_before_any_handle_is_passed(tmp_path) -> None:
    """A fake host (a socket server answering the lane's challenge with a wrong K proof): the lane refuses it
    with AuthError and passes it nothing -- no message and no fd after its own proof."""
    import socket

    path = str(tmp_path / "s")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server.bind(path)
    server.listen(1)
    seen: list[tuple[bytes, int]] = []

    def fake_host() -> None:
        conn, _ = server.accept()
        with conn:
            conn.settimeout(10)
            conn.send(b"N" + os.urandom(32))
            proof = conn.recv(4096)
            assert proof[:1] == b"A"
            conn.send(b"K" + bytes(32))         # not the host's proof of the group's key
            while True:
                data, fds, _, _ = socket.recv_fds(conn, 65536, 16)
                for fd in fds:
                    os.close(fd)
                if not data:
                    return
                seen.append((data[:8], len(fds)))
    job = Background(fake_host)
    try:
        with pytest.raises(AuthError, match="failed authentication"):
            CopyLane(path, KEY, timeout=5)
        job.result(10)
    finally:
        server.close()
    assert seen == [], f"the lane passed a host that failed authentication {seen}"


# ---------------------------------------------------------------- segment bounds, exactly
SRC_N, DST_N = 4096 * 3, 4096 * 5


def _boundary_cases() -> list[tuple[str, Segments, bool]]:
    """(what, one group, whether it fits SRC_N / DST_N): each end exactly at a region's end, and one byte past."""
    cases = []
    for past in (0, 1):
        ok = past == 0
        cases += [
            (f"source run end +{past}", Segments.of([SRC_N - 100 + past], [0], [100]), ok),
            (f"destination run end +{past}", Segments.of([0], [DST_N - 100 + past], [100]), ok),
            # 4 rows of 96 bytes 1000 apart: the last row [off + 3000, off + 3096)
            (f"source strided end +{past}", Segments.of([SRC_N - 3096 + past], [0], [96], [4], [1000], [96]), ok),
            (f"destination strided end +{past}",
             Segments.of([0], [DST_N - 3096 + past], [96], [4], [96], [1000]), ok),
            (f"source stride +{past}", Segments.of([SRC_N - 3096], [0], [96], [4], [1000 + past], [96]), ok),
            (f"destination stride +{past}", Segments.of([0], [DST_N - 3096], [96], [4], [96], [1000 + past]), ok),
        ]
    return cases


@pytest.mark.parametrize("what,segments,fits", _boundary_cases(), ids=[c[0] for c in _boundary_cases()])
def test_lane_segments_end_exactly_at_a_region_or_are_refused(what: str, segments: Segments, fits: bool) -> None:
    from tensorxfer.errors import ProtocolError
    from tensorxfer.transport.ipc.delegate import check_lane_segments

    if fits:
        check_lane_segments(segments, SRC_N, DST_N)
    else:
        with pytest.raises(ProtocolError, match="reach past the regions"):
            check_lane_segments(segments, SRC_N, DST_N)


@pytest.mark.parametrize("total", [DST_N, DST_N + 1])
def test_lane_segments_write_at_most_the_followers_region(total: int) -> None:
    from tensorxfer.errors import ProtocolError
    from tensorxfer.transport.ipc.delegate import check_lane_segments

    segments = Segments.of([0, 0], [0, DST_N - (total - 4096)], [4096, total - 4096])
    if total <= DST_N:
        check_lane_segments(segments, DST_N, DST_N)
    else:
        with pytest.raises(ProtocolError, match=f"write {total} bytes into a region of {DST_N}"):
            check_lane_segments(segments, DST_N, DST_N)


@pytest.mark.parametrize("what,segments,fits", _boundary_cases(), ids=[c[0] for c in _boundary_cases()])
def test_host_copy_groups_end_exactly_at_a_buffer_or_are_refused(what: str, segments: Segments, fits: bool) -> None:
    from tensorxfer.memory._hostcopy import copy_groups

    src = np.random.default_rng(7).integers(0, 256, SRC_N, dtype=np.uint8)
    dst = np.zeros(DST_N, np.uint8)
    cols = (segments.src_off, segments.dst_off, segments.nbytes, segments.count, segments.src_stride,
            segments.dst_stride)
    if not fits:
        with pytest.raises(ValueError, match="reaches past"):
            copy_groups(src, dst, *cols)
        assert not dst.any()
        return
    assert copy_groups(src, dst, *cols) == segments.total_bytes
    want = np.zeros(DST_N, np.uint8)
    so, do, w, h, ss, ds = (int(c[0]) for c in cols)
    for r in range(h):
        want[do + r * ds:do + r * ds + w] = src[so + r * ss:so + r * ss + w]
    assert np.array_equal(dst, want)
