"""The rendezvous stores (a real TCPStore, a real etcd server) behind one interface, and the membership
protocol's decisions on them: who joins, who is dropped and when, who decides."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import tensorxfer as tx
from tensorxfer.sync import Piece, RankSpec, SourceTensor, TargetTensor, replicate_box
from tensorxfer.sync.membership import Membership, StepRecord
from tensorxfer.sync.rendezvous import Rendezvous, connect
from tests.etcd_server import etcd_server, need_etcd

pytest.importorskip("torch", reason="the TCPStore is torch.distributed's")


@pytest.fixture(params=["tcpstore", "etcd"])
def url(request: Any, tmp_path: Path) -> Iterator[str]:
    if request.param == "etcd":
        need_etcd()
        with etcd_server(tmp_path) as u:
            yield u + "?ttl=2"
    else:
        from tensorxfer.sync.rendezvous import open_tcp_store

        server = open_tcp_store("127.0.0.1", 0, True)
        yield f"tcp://127.0.0.1:{server.port}"


def test_every_store_keeps_the_same_promises(url: str) -> None:
    a, b = connect(url), connect(url)
    try:
        assert isinstance(a, Rendezvous)
        a.publish("k/x", b"1")
        a.publish_many({"k/y": b"2", "k/z": b"3"})
        assert b.peek(["k/x", "k/nope", "k/z"]) == [b"1", None, b"3"]
        assert b.has("k/y") and not b.has("k/nope")
        assert b.read(["k/x", "k/y"], 1) == [b"1", b"2"]
        t = time.monotonic()
        with pytest.raises(tx.TransferTimeout, match="k/never"):
            b.read(["k/x", "k/never"], 0.3)
        assert time.monotonic() - t < 5
        assert a.publish_once("k/once", b"first") == b"first"
        assert b.publish_once("k/once", b"second") == b"first", "the first writer wins"
        a.join("m", "0", b"zero")
        b.join("m", "3", b"three")
        v = a.members_version("m")
        assert a.members("m") == {"0": b"zero", "3": b"three"}
        b.leave("m", "3")
        b.leave("m", "3")       # idempotent
        assert a.members("m") == {"0": b"zero"}
        assert v is None or a.members_version("m") != v, "a leave must change the membership version"
        # evicting a dead member removes only the record it saw: a new incarnation's stays
        b.join("m", "5", b"old")
        a.join("m", "5", b"new")
        assert not b.evict("m", "5", b"old") and a.members("m")["5"] == b"new"
        assert b.evict("m", "5", b"new") and "5" not in a.members("m")
        assert not b.evict("m", "nobody", b"x")
    finally:
        a.close()
        b.close()


@pytest.mark.slow
def test_an_etcd_member_that_dies_is_gone_when_its_lease_expires(tmp_path: Path) -> None:
    need_etcd()
    with etcd_server(tmp_path) as u:
        watcher, dying = connect(u), connect(u + "?ttl=2")
        try:
            dying.join("m", "7", b"alive")
            assert watcher.members("m") == {"7": b"alive"}
            dying._stop.set()       # type: ignore[attr-defined]   # its keep-alive stops, as in a killed process
            deadline = time.monotonic() + 10
            while watcher.members("m") and time.monotonic() < deadline:
                time.sleep(0.2)
            assert watcher.members("m") == {}, "the lease should have expired within its TTL"
        finally:
            watcher.close()
            dying.close()


def test_a_store_url_that_is_not_one_is_refused() -> None:
    for bad in ("redis://h:1", "etcd://host", "etcd://h:2379?color=red", "h:2379"):
        with pytest.raises(ValueError, match="rendezvous URL"):
            connect(bad)
    with pytest.raises(tx.TransferError, match=r"127\.0\.0\.1:1"):
        connect("etcd://127.0.0.1:1?timeout=2")


def _spec(role: str, rank: int) -> RankSpec:
    if role == "source":
        return RankSpec("source", rank, [SourceTensor("w", (4,), "F32", replicate_box((4,)), 0)])
    return RankSpec("target", rank, [TargetTensor("w", (4,), "F32", 0, (Piece("w", replicate_box((4,)), (0,)),))])


@pytest.mark.slow
def test_membership_decisions(url: str) -> None:
    """Joiners come in at the next step, the dead go out (named ones after a short grace, silent ones after
    the stall timeout, departed ones at once), a dropped incarnation never comes back, the lowest source
    decides and the others take its record."""
    rdvs: list[Rendezvous] = []

    def member(role: str, rank: int) -> Membership:
        rdv = connect(url)
        rdvs.append(rdv)
        m = Membership(rdv, "g", role, rank, stall_timeout=1.5)
        m.register(_spec(role, rank), ("127.0.0.1", 1000 + rank) if role == "target" else None)
        return m

    try:
        s0, s1, t0, t1 = member("source", 0), member("source", 1), member("target", 0), member("target", 1)
        first = s0.form((2, 2), 10)
        assert first == StepRecord(0, 1, {0: s0.uid, 1: s1.uid}, {0: t0.uid, 1: t1.uid})
        assert t1.form((2, 2), 10) == first, "every rank reads the same formation"
        t2 = member("target", 2)
        one = s0.decide(1, first)
        assert one.epoch == 2 and one.targets == {0: t0.uid, 1: t1.uid, 2: t2.uid}
        assert s1.decide(1, first) == one, "the others take the decider's record"
        # step 1: everyone reports, but target 1 says nothing and source 0 names target 2 failed
        s0.report(1, False, 1, {2: "PeerLost: gone"})
        s1.report(1, True, 1, {})
        t0.report(1, True, 1, {})
        t = time.monotonic()
        two = s0.decide(2, one)
        waited = time.monotonic() - t
        assert two.targets == {0: t0.uid} and two.epoch == 3, two
        assert 1.4 < waited < 5, f"a silent member is waited for the stall timeout, not more ({waited:.1f} s)"
        # the decider evicted the dropped: they are no longer members, and t1 rejoins as a new incarnation
        assert set(s0.live("target")) == {0}
        old = t1.uid
        t1.rejoin()
        for m in (s0, s1, t0):
            m.report(2, True, 2, {})
        t = time.monotonic()
        three = s0.decide(3, two)
        assert time.monotonic() - t < 1.4, "everyone reported: no waiting (a wait is the 1.5 s stall timeout)"
        assert three.targets == {0: t0.uid, 1: t1.uid} and t1.uid != old
        # a source that leaves is out at once; a non-lowest source decides itself when the lowest is silent
        s0.leave()
        for m in (s1, t0, t1):
            m.report(3, True, 3, {})
        t = time.monotonic()
        four = s1.decide(4, three)
        assert four.sources == {1: s1.uid}, four
        assert time.monotonic() - t < 1.5 + 1.0 + 1.0
    finally:
        for r in rdvs:
            r.close()


@pytest.mark.slow
def test_sync_status_prints_the_group_from_the_store_alone(url: str) -> None:
    import subprocess
    import sys

    from tensorxfer.cli.sync_status import render
    from tensorxfer.sync.membership import group_status

    empty = subprocess.run([sys.executable, "-m", "tensorxfer.cli.main", "sync-status", url, "nobody"],
                           capture_output=True, text=True, timeout=60)
    assert empty.returncode == 0 and "no step decided yet" in empty.stdout, empty
    rdvs = [connect(url) for _ in range(2)]
    try:
        s0 = Membership(rdvs[0], "g", "source", 0, 1.0)
        t0 = Membership(rdvs[1], "g", "target", 0, 1.0)
        s0.register(_spec("source", 0))
        t0.register(_spec("target", 0), ("127.0.0.1", 4242))
        first = s0.form((1, 1), 10)
        for m in (s0, t0):
            m.publish_digest(first.epoch, "ab" * 32)
        one = s0.decide(1, first)
        s0.report(1, False, 1, {0: "PeerLost: gone"})
        t0.report(1, True, 1, {})
        out = subprocess.run([sys.executable, "-m", "tensorxfer.cli.main", "sync-status", url, "g"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert lines[0] == f"group 'g': newest step 1, epoch {one.epoch}"
        assert any(line.split()[:6] == ["source", "0", "yes", "yes", "abababababab", "1"] and
                   "failed (0: PeerLost: gone)" in line for line in lines), out.stdout
        assert any(line.split()[:7] == ["target", "0", "yes", "yes", "abababababab", "1", "ok"] and
                   "at 127.0.0.1:4242" in line for line in lines), out.stdout
        assert render(group_status(rdvs[0], "g")) == out.stdout.rstrip("\n")
    finally:
        for r in rdvs:
            r.close()


def test_the_default_read_waits_on_any_store_that_can_only_peek() -> None:
    """A store with no wait of its own (a dict here: pure logic) still gets a bounded, named wait."""
    import threading

    class DictStore(Rendezvous):
        def __init__(self) -> None:
            self.kv: dict[str, bytes] = {}

        def publish(self, key: str, value: bytes) -> None:
            self.kv[key] = value

        def peek(self, keys: Any) -> list[bytes | None]:
            return [self.kv.get(k) for k in keys]

        def publish_once(self, key: str, value: bytes) -> bytes:
            return self.kv.setdefault(key, value)

        def join(self, prefix: str, name: str, value: bytes) -> None:
            self.kv[f"{prefix}/{name}"] = value

        def leave(self, prefix: str, name: str) -> None:
            self.kv.pop(f"{prefix}/{name}", None)

        def evict(self, prefix: str, name: str, value: bytes) -> bool:
            return self.kv.pop(f"{prefix}/{name}", None) is not None

        def members(self, prefix: str) -> dict[str, bytes]:
            return {k[len(prefix) + 1:]: v for k, v in self.kv.items() if k.startswith(prefix + "/")}

    store = DictStore()
    later = threading.Timer(0.2, store.publish, ("k/late", b"v"))
    later.start()
    t = time.monotonic()
    assert store.read(["k/late"], 5) == [b"v"]
    assert 0.15 < time.monotonic() - t < 1.0
    with pytest.raises(tx.TransferTimeout, match="k/never"):
        store.read(["k/late", "k/never"], 0.2)


def test_a_tcpstore_key_published_as_the_wait_times_out_is_read_not_raised() -> None:
    """The lowest source publishes its step record just as a follower's LEADER_WAIT ends: the follower
    must take the record (it raised torch's DistStoreError out of push() before)."""
    import torch.distributed as dist

    from tensorxfer.sync.rendezvous import TorchStoreRendezvous, open_tcp_store

    server = open_tcp_store("127.0.0.1", 0, True)

    class LateWait:         # the real store; its wait times out the moment the key lands
        def __getattr__(self, name: str) -> Any:
            return getattr(server, name)

        def wait(self, keys: Any, timeout: Any) -> None:
            server.set(keys[0], b"decided")
            raise dist.DistStoreError("wait timeout after 1000ms")

    rdv = TorchStoreRendezvous(LateWait())
    assert rdv.read(["step/5"], 1.0) == [b"decided"]
    with pytest.raises(tx.TransferTimeout, match="step/6"):
        TorchStoreRendezvous(server).read(["step/6"], 0.05)


def test_a_rank_waiting_on_a_tcpstore_stops_at_ctrl_c(tmp_path: Path) -> None:
    """A real process waiting for a key that never comes (a target before its sources start) stops at SIGINT
    within a second, as Python does anywhere else: c10d's wait is C++ no signal interrupts, and a whole
    timeout's wait ignored Ctrl-C until it ended."""
    import signal
    import subprocess
    import sys

    script = tmp_path / "wait.py"
    script.write_text("from tensorxfer.sync.rendezvous import TorchStoreRendezvous, open_tcp_store\n"
                      "store = open_tcp_store('127.0.0.1', 0, True)\n"
                      "print('waiting', flush=True)\n"
                      "TorchStoreRendezvous(store).read(['never'], 60)\n")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parent.parent)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "waiting\n"
        time.sleep(0.5)         # inside the wait
        start = time.monotonic()
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=10)
        assert time.monotonic() - start < 2.0
        assert proc.stderr is not None and "KeyboardInterrupt" in proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()
        for f in (proc.stdout, proc.stderr):
            if f is not None:
                f.close()


def test_descriptions_are_stored_compressed_and_a_bad_body_is_refused(url: str) -> None:
    """Bodies go into the store zlib-compressed under the hash of the uncompressed body; a reader inflates
    with a limit and checks the hash: a body that is not zlib, inflates too far or was altered is refused."""
    import zlib

    from tensorxfer.sync import membership

    rdv = connect(url)
    try:
        names = [f"model.layers.{i}.mlp.experts.{e}.gate_proj.weight" for i in range(8) for e in range(16)]
        spec = RankSpec("source", 0, [SourceTensor(n, (4,), "F32", replicate_box((4,)), 16 * i)
                                      for i, n in enumerate(names)])
        writer = Membership(rdv, "z", "source", 0, 5.0)
        writer.register(spec)
        first = writer.form((1, 0), 10)
        key = writer.key("body", spec.content_digest.hex())
        stored = rdv.peek([key])[0]
        assert stored is not None and zlib.decompress(stored) == spec.body and len(stored) < len(spec.body) / 4
        assert Membership(rdv, "z", "target", 0, 5.0).specs(first, 5)[0] == [spec]
        for bad, why in ((spec.body, "not zlib data"), (zlib.compress(spec.body + b"x"), "does not hash"),
                         (zlib.compress(spec.body)[:-9], "truncated")):
            rdv.publish(key, bad)
            with pytest.raises(tx.PlanError, match=why):
                Membership(rdv, "z", "target", 0, 5.0).specs(first, 5)
        bomb = zlib.compress(b"\0" * (4 << 20))
        rdv.publish(key, bomb)
        old, membership.MAX_BODY = membership.MAX_BODY, 1 << 20
        try:
            with pytest.raises(tx.PlanError, match="inflates past"):
                Membership(rdv, "z", "target", 0, 5.0).specs(first, 5)
        finally:
            membership.MAX_BODY = old
    finally:
        rdv.close()
