"""Fan-out by chain pipelining (tensorxfer.fanout) between real processes, over tcp and ipc."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import tensorxfer as tx
from tensorxfer import fanout
from tensorxfer.errors import ManifestError, ProtocolError, UpstreamFailed
from tensorxfer.fanout import FanoutSender, Landed, ReceiverResult, Version, parse_chain, slowest_hop
from tensorxfer.transport import ipc, tcp

from .helpers import ROOT, Background, needs_gpu, wait_until

TOKEN = "fan-s3cret"
PEER = os.path.join(ROOT, "tests", "fanout_peer.py")


class Peer:
    """A fan-out receiver process; ``lines()`` are its JSON reports so far."""

    def __init__(self, stall: float = 10.0, digest: bool = True, ipc_piece_delay: float | None = None,
                 device: str = "cpu", env: dict[str, str] | None = None, pacing: int = 0,
                 ipc_wedge: bool = False, launcher: tuple[str, ...] = ()) -> None:
        env = dict(os.environ, PYTHONPATH=ROOT, **(env or {}))
        extra = ["--device", device]
        if ipc_piece_delay is not None:
            extra += ["--ipc-piece-delay", str(ipc_piece_delay)]
        if ipc_wedge:
            extra.append("--ipc-wedge-after-copy")
        self.proc = subprocess.Popen([*launcher, sys.executable, PEER, TOKEN, str(stall), "1" if digest else "0",
                                      str(pacing), *extra],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        assert self.proc.stdout is not None
        self.address = json.loads(self.proc.stdout.readline())["address"]
        self.reports: list[dict] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.reports.append(json.loads(line))

    def oks(self) -> list[dict]:
        return [r for r in self.reports if r.get("ok")]

    def wait_oks(self, n: int, timeout: float = 30.0) -> list[dict]:
        deadline = time.monotonic() + timeout
        while len(self.oks()) < n:
            assert time.monotonic() < deadline, f"{self.address}: {len(self.oks())} of {n} updates: {self.reports}"
            time.sleep(0.02)
        return self.oks()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdout, self.proc.stderr):
            if f is not None:
                f.close()
        self._reader.join(5)


@pytest.fixture
def peers():
    made: list[Peer] = []

    def make(n: int, **kw) -> list[Peer]:
        new = [Peer(**kw) for _ in range(n)]
        made.extend(new)
        return new
    yield make
    for p in made:
        p.stop()


def model(nbytes: int, seed: int = 0) -> tx.TensorRegion:
    rng = np.random.default_rng(seed)
    quarter = nbytes // 4
    tensors = {f"layer{i}.w": rng.integers(0, 255, quarter, dtype=np.uint8) for i in range(4)}
    return tx.TensorRegion.from_tensors(tensors)


def sha(region: tx.TensorRegion) -> str:
    mv = memoryview(region.region).cast("B")[:region.nbytes]
    try:
        return hashlib.sha256(mv).hexdigest()
    finally:
        mv.release()


@pytest.mark.slow
def test_one_to_four_over_tcp_byte_identical_verified(peers):
    ps = peers(4)
    with model(64 << 20) as region, FanoutSender([p.address for p in ps], token=TOKEN, transport="tcp") as fan:
        stats = fan.send(region, verify=True)
        assert stats.ok, stats.failed
        assert [r.address for r in stats.receivers] == [p.address for p in ps]
        assert [r.via for r in stats.receivers] == ["sender"] + [p.address for p in ps[:-1]]
        assert all(r.verified and r.transport == "tcp" and r.bytes == region.nbytes for r in stats.receivers)
        assert stats.version.update == 1 and stats.piece_bytes == tcp.FORWARD_PIECE_BYTES
        assert json.loads(json.dumps(stats.as_dict()))["receivers"][3]["ok"]
        want = sha(region)
        for p in ps:
            [got] = p.wait_oks(1)
            assert got["sha256"] == want and got["verified"]
            assert got["update"] == 1 and got["digest"] == stats.version.digest.hex()
        # A second update reuses every hop's session: same chain, new bytes, update 2.
        region.tensors()["layer0.w"][:] = 7
        stats = fan.send(region, verify=True)
        assert stats.ok and stats.version.update == 2
        for p in ps:
            assert p.wait_oks(2)[1]["sha256"] == sha(region)


def _chain_with_fault(peers, action: str, stall: float, transport: str = "tcp", warm: bool = False, **peer_kw):
    """Send to four receivers and kill (or stop) the second one mid-update; ``warm``: after one update that set
    every hop up (so the fault hits the data path, not a setup)."""
    ps = peers(4, stall=stall, **peer_kw)
    fired = threading.Event()
    sent = [0]
    victim = ps[1]

    def progress(n: int) -> None:      # the first hop's progress: over ipc, how far its copy got
        sent[0] += n
        if sent[0] > (96 << 20) and not fired.is_set():
            fired.set()
            victim.proc.send_signal(signal.SIGKILL if action == "kill" else signal.SIGSTOP)

    with model(256 << 20, seed=3) as region, \
            FanoutSender([p.address for p in ps], token=TOKEN, transport=transport, stall_timeout=stall) as fan:
        if warm:
            assert fan.send(region).ok      # no progress callback: the fault fires in the next update
        t0 = time.perf_counter()
        stats = fan.send(region, verify=True, progress=progress)
        elapsed = time.perf_counter() - t0
        assert fired.is_set()
        [bad] = stats.failed
        assert bad.address == victim.address
        ok = [r for r in stats.receivers if r.ok]
        assert [r.address for r in ok] == [ps[0].address, ps[2].address, ps[3].address]
        assert all(r.transport == transport for r in ok)
        assert ok[1].via == ps[0].address        # the hop before the failed one repaired the chain
        want = sha(region)
        for p in (ps[0], ps[2], ps[3]):
            assert p.wait_oks(1 + warm)[-1]["sha256"] == want
        assert fan.chain == [ps[0].address, ps[2].address, ps[3].address]
        # The next update goes around the dead receiver from the start.
        stats2 = fan.send(region, verify=True)
        assert stats2.ok and [r.address for r in stats2.receivers] == fan.chain
        return bad, elapsed, ps


@pytest.mark.slow
def test_receiver_killed_mid_chain_others_complete(peers):
    bad, _, _ = _chain_with_fault(peers, "kill", stall=10.0)
    assert bad.error_type in ("PeerLost", "TransferTimeout", "ProtocolError"), bad
    assert bad.error


@pytest.mark.slow
def test_stalled_receiver_cut_out_after_stall_timeout(peers):
    bad, elapsed, _ = _chain_with_fault(peers, "stop", stall=2.0)
    assert bad.error_type == "TransferTimeout", bad
    assert elapsed < 30


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def fd_report(reports: list[dict]) -> list:
    """Each report's fd count with what the fds were (sockets, memfds, ...): the message of a failed check."""
    return [(r["fds"], r.get("fd_kinds")) for r in reports]


@pytest.mark.parametrize("transport", ["tcp", "ipc"])
@pytest.mark.slow
def test_repeated_updates_keep_fds_and_rss_flat(peers, transport):
    ps = peers(3, digest=False)
    with model(16 << 20) as region, FanoutSender([p.address for p in ps], token=TOKEN, transport=transport) as fan:
        for _ in range(5):
            assert fan.send(region).ok
        before = fds()
        for _ in range(40):
            stats = fan.send(region)
            assert stats.ok and all(r.transport == transport for r in stats.receivers)
        assert fds() == before
    for p in ps:
        reports = p.wait_oks(45)
        assert {r["fds"] for r in reports[5:]} == {reports[5]["fds"]}, fd_report(reports)
        growth = reports[-1]["rss_kb"] - reports[5]["rss_kb"]
        assert growth < 8 << 10, f"{p.address}: RSS grew {growth} KiB over 40 updates"


def test_receiver_without_token_refuses_to_relay():
    with tx.Receiver("127.0.0.1:0") as a, tx.Receiver("127.0.0.1:0") as b, model(1 << 20) as region:
        bg = Background(a.receive, timeout=20)
        got = Background(b.receive, timeout=20)
        with FanoutSender(["{}:{}".format(*a.address), "{}:{}".format(*b.address)], transport="tcp") as fan:
            stats = fan.send(region)
        assert got.result().nbytes == region.nbytes and b.version is not None and a.version is None
        assert [r.ok for r in stats.receivers] == [False, True]     # a refused; b got it from the sender
        assert stats.receivers[0].error_type == "OfferRefused" and "relay" in stats.receivers[0].error
        with pytest.raises(ManifestError):
            bg.result()


def test_offer_checks():
    with pytest.raises(ProtocolError):
        parse_chain(["127.0.0.1:1", "127.0.0.1:1"])
    with pytest.raises(ProtocolError):
        parse_chain(["not an address"])
    with pytest.raises(ProtocolError):
        Version.from_wire({"update": 0, "digest": b"x" * 32})
    with pytest.raises(ProtocolError):
        ReceiverResult.from_wire({"address": 1})
    with pytest.raises(ValueError):
        FanoutSender(["127.0.0.1:1", "127.0.0.1:1"])


def test_landed_waits_for_ranges_and_aborts():
    landed = Landed(100, stall_timeout=0.2)
    landed.add(0, 10)
    landed.add(10, 30)
    landed.wait_range(5, 35)
    bg = Background(landed.wait_range, 40, 20)
    landed.add(50, 50)
    landed.add(40, 10)
    bg.result(5)
    with pytest.raises(UpstreamFailed, match="no new bytes"):
        Landed(10, 0.05).wait_range(0, 10)
    aborted = Landed(10, 5.0)
    bg = Background(aborted.wait_range, 0, 10)
    aborted.abort("upstream died")
    with pytest.raises(UpstreamFailed, match="upstream died"):
        bg.result(5)


def test_landed_prefix_grows_only_with_contiguous_bytes():
    landed = Landed(100, stall_timeout=0.2)
    landed.add(20, 30)                      # out of order: nothing contiguous from 0 yet
    bg = Background(landed.wait_prefix, 0)
    time.sleep(0.05)
    assert bg.thread.is_alive()
    landed.add(0, 20)
    assert bg.result(5) == 50               # both pieces, in one answer
    with pytest.raises(UpstreamFailed, match="no new bytes"):
        landed.wait_prefix(50)
    landed.add_all()
    assert landed.wait_prefix(50) == 100
    aborted = Landed(10, 5.0)
    bg = Background(aborted.wait_prefix, 0)
    aborted.abort("upstream died")
    with pytest.raises(UpstreamFailed, match="upstream died"):
        bg.result(5)


@pytest.mark.slow
def test_cli_send_to_three_receivers_json(tmp_path):
    from .helpers import finish
    from .test_cli import cli, model_dir, start_recv
    from .test_cli import sha as file_sha

    src = model_dir(tmp_path / "src")
    env = {"TENSORXFER_TOKEN": TOKEN}
    recvs = [start_recv(tmp_path / f"out{i}", "--once", "--transport", "tcp", env=env) for i in range(3)]
    to = [a for _, where in recvs for a in ("--to", where)]
    send = cli("send", str(src), *to, "--transport", "tcp", "--verify", "--json", env=env)
    rc_s, out_s, err_s = finish(send, timeout=60)
    assert rc_s == 0, err_s
    sent = json.loads(out_s)
    assert sent["event"] == "sent" and sent["verified"] and sent["transport"] == "tcp"
    assert [r["address"] for r in sent["receivers"]] == [where for _, where in recvs] == sent["chain"]
    assert all(r["ok"] and r["verified"] and r["bytes"] == sent["bytes"] for r in sent["receivers"])
    assert sent["version"]["update"] == 1 and len(sent["version"]["digest"]) == 64
    for i, (proc, _) in enumerate(recvs):
        rc_r, _, err_r = finish(proc)
        assert rc_r == 0, err_r
        for p in src.iterdir():
            assert file_sha(p) == file_sha(tmp_path / f"out{i}" / p.name), p.name


@pytest.mark.slow
def test_cli_once_receiver_waits_for_the_repaired_chain_when_its_relay_dies(tmp_path, peers):
    # Chain A -> B -> C where C is `tensorxfer-recv --once`.  A forwards at 10 MB/s (paced), so B is still
    # forwarding to C when it is killed.  C's session ends with PeerLost; A takes B out and sends C the
    # update again.  C must wait for that (not exit and fail too): it writes the files and exits 0, and
    # only B is named failed.
    from .helpers import finish
    from .test_cli import cli, model_dir, start_recv
    from .test_cli import sha as file_sha

    src = model_dir(tmp_path / "src", rows=20000)      # ~61 MB: about 6 s through A's paced streams
    env = {"TENSORXFER_TOKEN": TOKEN}
    a, b = peers(1, pacing=10_000_000 // tcp.DEFAULT_STREAMS)[0], peers(1)[0]
    c, c_addr = start_recv(tmp_path / "out", "--once", "--transport", "tcp", env=env)
    send = cli("send", str(src), "--to", a.address, "--to", b.address, "--to", c_addr, "--transport", "tcp",
               "--verify", "--json", env=env)
    wait_until(lambda: landed(tmp_path / "out"), 60, "C landing bytes from B")  # B is forwarding to C
    assert send.poll() is None and not b.reports, "the update ended before B could be killed mid-forward"
    b.proc.kill()
    rc_s, out_s, err_s = finish(send, timeout=120)
    rc_c, out_c, err_c = finish(c, timeout=30)
    sent = json.loads(out_s)
    failed = [r for r in sent["receivers"] if not r["ok"]]
    assert [r["address"] for r in failed] == [b.address], sent
    assert rc_s == 1, err_s                             # one receiver failed: the exit code says so
    assert rc_c == 0, err_c
    events = [json.loads(line)["event"] for line in out_c.splitlines()]
    # what C had landed from the dead relay is kept for a resumed send (partial_kept) until the repaired
    # chain's update completes, which leaves no partial output behind
    assert [e for e in events if e != "partial_kept"] == ["upstream_failed", "received"], out_c
    assert not [n for n in os.listdir(tmp_path / "out") if n.startswith(".tensorxfer-")]
    assert "waiting for the repaired chain" in err_c, err_c
    for p in src.iterdir():
        assert file_sha(p) == file_sha(tmp_path / "out" / p.name), p.name
    assert a.wait_oks(1)[-1]["ok"]


def landed(out: Path) -> bool:
    """Whether a receiver writing into ``out`` has bytes in one of its temporary files."""
    try:
        return any(p.name.startswith(".tensorxfer-") and p.name.endswith(".part") and p.stat().st_blocks > 0
                   for p in out.iterdir())
    except FileNotFoundError:       # not made yet, or a file renamed while listed
        return False


def test_versions_are_explicit_and_checked():
    from tensorxfer.fanout import manifest_digest
    from tensorxfer.session import ForwardHooks

    with tx.Receiver("127.0.0.1:0", token=TOKEN) as rx, model(1 << 20) as region:
        where = "{}:{}".format(*rx.address)
        assert rx.version is None
        got = Background(rx.receive, timeout=20)       # a session starts only while receive() runs
        with tx.Sender(where, token=TOKEN, transport="tcp") as s:
            for update in (1, 2):
                if update > 1:
                    got = Background(rx.receive, timeout=20)
                s.send(region)
                got.result()
                assert rx.version == Version(update, manifest_digest(region.manifest))
        # A version whose digest is not the offered manifest's is refused, and the region holds no version.
        got = Background(rx.receive, timeout=20)
        with tx.Sender(where, token=TOKEN, transport="tcp") as s:
            with pytest.raises(ProtocolError, match="digest"):
                s.send(region, forward=ForwardHooks(Version(3, b"\0" * 32)))
        with pytest.raises(ProtocolError, match="digest"):
            got.result()
        assert rx.version is None


@pytest.mark.slow
def test_one_to_four_over_ipc_pipelined_byte_identical_verified(peers):
    # The peers sleep 200 ms in every ipc copy piece, and the region is 4 relay pieces per copy thread, so
    # each hop's copy takes ~0.8 s whatever the machine's thread count.  Pipelined, hop k+1 starts copying
    # once hop k's first pieces landed (~0.2 s later); store and forward, only after hop k's whole copy
    # finished.  The peers report when their first piece started and their last one finished.  Timing is
    # checked on the warm updates: the first one also connects every hop and allocates every region, which
    # on a small shared machine takes longer than a copy.
    ps = peers(4, ipc_piece_delay=0.2)
    with model(4 * ipc.COPY_THREADS * ipc.RELAY_PIECE_BYTES, seed=5) as region, \
            FanoutSender([p.address for p in ps], token=TOKEN, transport="ipc") as fan:
        for update in (1, 2, 3):
            if update > 1:
                region.tensors()["layer2.w"][:] = update
            stats = fan.send(region, verify=True)
            assert stats.ok, stats.failed
            assert [r.via for r in stats.receivers] == ["sender"] + [p.address for p in ps[:-1]]
            assert all(r.transport == "ipc" and r.verified and r.bytes == region.nbytes for r in stats.receivers)
            assert stats.piece_bytes == ipc.RELAY_PIECE_BYTES
            reports = [p.wait_oks(update)[-1] for p in ps]
            for got in reports:
                assert got["sha256"] == sha(region) and got["update"] == update and got["verified"]
            if update == 1:
                continue
            timing = [(round(r["copy_start"], 3), round(r["copy_end"], 3)) for r in reports]
            for up, down in itertools.pairwise(reports):
                # the next hop began copying well before this one finished its copy
                assert down["copy_start"] < up["copy_end"] - 0.3, timing
            # and so the whole chain took far less than four copies one after another
            hop = statistics.median(r["copy_end"] - r["copy_start"] for r in reports)
            assert reports[-1]["copy_end"] - reports[0]["copy_start"] < 2.5 * hop, timing


@pytest.mark.slow
def test_relay_killed_mid_update_over_ipc_others_complete(peers):
    # On a warm chain the second receiver (a relay, copying from the first while the first still copies) is
    # killed once the first hop has copied 96 of 256 MiB; the first hop forwards to the third instead.  The
    # third was copying from the killed one: its session ends (the sender closed with its region ready up to
    # some offset), and it gets the update again from the first.
    bad, _, ps = _chain_with_fault(peers, "kill", stall=10.0, transport="ipc", warm=True, ipc_piece_delay=0.05)
    assert bad.error_type in ("PeerLost", "TransferTimeout", "ProtocolError"), bad
    assert bad.error
    assert [r["error"] for r in ps[2].reports if "error" in r] == ["PeerLost"], ps[2].reports


@pytest.mark.slow
def test_stalled_relay_over_ipc_cut_out_after_stall_timeout(peers):
    # The second receiver stops mid-copy on a warm chain: the first hop's wait for its progress times out (it
    # had not copied all the watermark allowed), and the third, copying from the stopped one, sees its
    # watermark stand still for stall_timeout: TransferTimeout, not a hang.
    bad, elapsed, ps = _chain_with_fault(peers, "stop", stall=2.0, transport="ipc", warm=True,
                                         ipc_piece_delay=0.05)
    assert bad.error_type == "TransferTimeout" and "no progress" in bad.error, bad
    assert elapsed < 15
    errors = [r for r in ps[2].reports if "error" in r]
    assert [r["error"] for r in errors] == ["TransferTimeout"] and "did not advance" in errors[0]["message"], errors


@pytest.mark.slow
def test_relay_over_ipc_names_a_receiver_that_never_finishes_its_copy(peers):
    # The second receiver copies every byte from the first (a relay) and then hangs before saying done.  The
    # relay used to wait for it forever (every byte reported reset its stall clock), so the origin timed the
    # healthy relay out after its whole ack allowance and named it.  Now the relay names the hung one after
    # stall_timeout and acknowledges; the next update goes to the relay alone.
    relay, = peers(1, stall=2.0)
    hung, = peers(1, stall=2.0, ipc_wedge=True)
    with model(8 << 20) as region, \
            FanoutSender([relay.address, hung.address], token=TOKEN, transport="ipc", stall_timeout=2.0) as fan:
        t0 = time.perf_counter()
        stats = fan.send(region)
        elapsed = time.perf_counter() - t0
        [bad] = stats.failed
        assert bad.address == hung.address and bad.error_type == "TransferTimeout", bad
        assert "did not finish" in bad.error and bad.via == relay.address, bad
        assert stats.receivers[0].ok and elapsed < 20, (stats.receivers[0], elapsed)
        assert relay.wait_oks(1)[0]["sha256"] == sha(region)
        assert fan.chain == [relay.address]
        assert fan.send(region).ok
        assert len(relay.wait_oks(2)) == 2


def _unshare_mount() -> tuple[str, ...] | None:
    """A launcher that runs a process in its own mount namespace (ipc then refuses it: not the same host as far
    as memory handles go), or None where that is not allowed."""
    try:
        ok = subprocess.run(["unshare", "-m", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    return ("unshare", "-m") if ok else None


@pytest.mark.slow
def test_auto_chain_lets_every_hop_choose_its_own_transport(peers):
    # transport="auto": the origin reaches the first receiver over ipc, but the second shares no mount namespace
    # with anyone (as a receiver on another machine would), so ipc cannot reach it.  The relay used to forward
    # with the transport the origin chose for it (ipc, forced) and named the second receiver unreachable; now
    # each hop chooses what it and its next hop share.
    launcher = _unshare_mount()
    if launcher is None:
        pytest.skip("unshare -m is not permitted here (needs CAP_SYS_ADMIN)")
    near, = peers(1)
    far, = peers(1, launcher=launcher)
    with model(8 << 20) as region, FanoutSender([near.address, far.address], token=TOKEN) as fan:
        stats = fan.send(region, verify=True)
        assert stats.ok, stats.failed
        assert [r.transport for r in stats.receivers] == ["ipc", "tcp"], stats.receivers
        assert far.wait_oks(1)[0]["sha256"] == sha(region)


@pytest.mark.slow
def test_slow_receiver_is_moved_to_the_tail_of_the_chain(peers):
    # The second of four receivers copies slowly (400 ms per ipc piece, two pieces per copy thread: about
    # 0.8 s a copy, the others a few tens of ms).  It holds back the two after it; the sender names it in
    # every such update and, the SLOW_STRIKES-th time in a row, puts it last.  In the next update the others get
    # their bytes at their own pace and only the slow one is late.  Everyone gets every update, verified.
    fast1, slow, fast2, fast3 = peers(1) + peers(1, ipc_piece_delay=0.4) + peers(2)
    order = [p.address for p in (fast1, slow, fast2, fast3)]
    with model(2 * ipc.COPY_THREADS * ipc.RELAY_PIECE_BYTES, seed=21) as region, \
            FanoutSender(order, token=TOKEN, transport="ipc") as fan:
        for update in range(1, fanout.SLOW_STRIKES + 1):
            stats = fan.send(region, verify=True)
            assert stats.ok, stats.failed
            assert stats.chain == tuple(order) and stats.slow == slow.address, stats.as_dict()
            lag = {r.address: r.lag_seconds for r in stats.receivers}
            assert lag[slow.address] > 0.4 and lag[fast2.address] < lag[slow.address] / 2, lag
            assert fan.chain == (order if update < fanout.SLOW_STRIKES else
                                 [fast1.address, fast2.address, fast3.address, slow.address])
        region.tensors()["layer1.w"][:] = 3
        moved = fan.send(region, verify=True)
        assert moved.ok and moved.chain == tuple(fan.chain), moved.as_dict()
        assert [r.via for r in moved.receivers] == ["sender", fast1.address, fast2.address, fast3.address]
        lag = {r.address: r.lag_seconds for r in moved.receivers}
        assert max(lag[p.address] for p in (fast2, fast3)) < lag[slow.address] - 0.3, lag
        assert fan.chain[-1] == slow.address        # already last: it stays there
        for p in (fast1, slow, fast2, fast3):
            assert p.wait_oks(fanout.SLOW_STRIKES + 1)[-1]["sha256"] == sha(region)
        # Each relay's receive() returned once its own copy was complete, not when the slow tail's was
        # (their acks, carrying the tail's result, went out later).
        done = {p.address: p.oks()[fanout.SLOW_STRIKES]["t"] for p in (fast1, slow, fast2, fast3)}
        assert max(done[p.address] for p in (fast1, fast2, fast3)) < done[slow.address] - 0.3, done


def test_slowest_hop_names_only_a_hop_that_stands_out():
    def results(*lags: float) -> list[ReceiverResult]:
        return [ReceiverResult(f"127.0.0.1:{9000 + i}", True, lag_seconds=t) for i, t in enumerate(lags)]
    slow = slowest_hop(results(1.0, 0.1, 1.9, 0.1))
    assert slow is not None and slow[0].address == "127.0.0.1:9002" and slow[1] == 1.9
    assert slowest_hop(results(1.0, 1.0, 1.0, 1.0)) is None     # every hop lags alike (one memory bus)
    assert slowest_hop(results(1.0, 0.05, 0.05)) is None        # pipelined: pieces apart
    assert slowest_hop(results(5.0, 0.1, 0.1)) is None          # a slow head has no lag to judge
    assert slowest_hop(results(0.02, 0.04, 0.001)) is None      # tiny updates: scheduling noise
    assert slowest_hop(results(0.16, 0.14, 0.01)) is None       # the Soft-RoCE VM's position lag (shared CPUs)
    assert slowest_hop(results(0.5, 0.45, 0.05)) is None        # under the head's own time: a position, not a peer
    assert slowest_hop(results(1.0)) is None
    failed = results(1.0, 0.1, 1.9)
    failed[1] = ReceiverResult(failed[1].address, False, error_type="PeerLost")
    slow = slowest_hop(failed)                                  # the failed one is not judged
    assert slow is not None and slow[0].address == "127.0.0.1:9002"


@pytest.mark.cuda
@needs_gpu
def test_one_to_three_over_ipc_between_gpu_regions_pipelined_byte_identical_verified(peers, monkeypatch):
    # As the host test above, with every region on cuda:0: the relays' device-to-device copies report each
    # piece once the stream finished it (stream marks), and the next hop copies it from the relay's memory.
    # Relay pieces of 8 MiB (the environment, for the peers; this process only reports the size).
    piece = 8 << 20
    monkeypatch.setattr(ipc.messages, "RELAY_CUDA_PIECE_BYTES", piece)
    ps = peers(3, device="cuda:0", ipc_piece_delay=0.2, env={"TENSORXFER_IPC_CUDA_FORWARD_PIECE": str(piece)})
    rng = np.random.default_rng(13)
    tensors = {f"layer{i}.w": rng.integers(0, 255, 2 * piece, dtype=np.uint8) for i in range(4)}
    with tx.TensorRegion.from_tensors(tensors, device="cuda:0") as region, \
            FanoutSender([p.address for p in ps], token=TOKEN, transport="ipc") as fan:
        from tensorxfer.staging import read_into

        host = np.empty(region.nbytes, dtype=np.uint8)
        read_into(region, 0, host)
        want = hashlib.sha256(host).hexdigest()
        for update in (1, 2):
            stats = fan.send(region, verify=True)
            assert stats.ok, stats.failed
            assert all(r.transport == "ipc" and r.verified for r in stats.receivers)
            assert stats.piece_bytes == piece
            reports = [p.wait_oks(update, timeout=60)[-1] for p in ps]
            for got in reports:
                assert got["sha256"] == want and got["update"] == update
            if update == 2:
                timing = [(round(r["copy_start"], 3), round(r["copy_end"], 3)) for r in reports]
                for up, down in itertools.pairwise(reports):
                    assert down["copy_start"] < up["copy_end"] - 0.3, timing


def test_new_replica_pulls_from_a_warm_peer_keeping_the_version():
    with tx.Receiver("127.0.0.1:0", token=TOKEN) as warm, tx.Receiver("127.0.0.1:0", token=TOKEN) as fresh, \
            model(4 << 20, seed=9) as region:
        with pytest.raises(tx.TransferError, match="no complete update"):
            warm.send_on("{}:{}".format(*fresh.address))
        got = Background(warm.receive, timeout=20)
        with FanoutSender(["{}:{}".format(*warm.address)], token=TOKEN, transport="tcp") as fan:
            fan.send(region)
        got.result()
        assert warm.version is not None and warm.version.update == 1
        pulled = Background(fresh.receive, timeout=20)
        stats = warm.send_on("{}:{}".format(*fresh.address), verify=True, transport="tcp")
        assert stats.ok and stats.version == warm.version
        assert sha(pulled.result()) == sha(region) and fresh.version == warm.version


def test_a_private_memory_receiver_lands_in_its_own_memory_but_relays_from_shareable_memory():
    # private_memory (tensorxfer-recv): a plain update lands in this process's own memory (huge pages, no
    # handles); a relayed one in shareable memory, so the next hop on this host can still map it over ipc.
    def at(rx: tx.Receiver) -> str:
        return "{}:{}".format(*rx.address)

    with fanout.Receiver("127.0.0.1:0", token=TOKEN, private_memory=True) as a, \
            fanout.Receiver("127.0.0.1:0", token=TOKEN) as b, model(4 << 20) as region:
        got = Background(a.receive, timeout=20)
        with tx.Sender(at(a), token=TOKEN, transport="tcp") as s:
            s.send(region)
        assert got.result().region.private and sha(a.region) == sha(region)
        got, last = Background(a.receive, timeout=20), Background(b.receive, timeout=20)
        with FanoutSender([at(a), at(b)], token=TOKEN, transport="ipc") as fan:
            stats = fan.send(region)
        assert [r.ok for r in stats.receivers] == [True, True], stats.receivers
        assert not got.result().region.private, "a relay's region must have handles for the next hop"
        assert sha(last.result()) == sha(region)
