"""A weight-sync group on an operator's bad day: stalled ranks (SIGSTOP / SIGCONT by pid), a store written by
someone without the group's token, garbage in the store, ranks that come late.  Real processes on a real
etcd server (Debian's etcd-server) or a real TCPStore; every version a target reports is checked byte for
byte against what the sources held."""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest

pytest.importorskip("torch", reason="the sync's peers hold torch tensors")

import torch

import tensorxfer as tx
from tensorxfer.sync.records import Seal, strip
from tensorxfer.sync.rendezvous import connect, open_tcp_store
from tensorxfer.sync.spec import RankSpec
from tests import elastic_peers as peers
from tests.etcd_server import etcd_server, need_etcd
from tests.test_elastic import Peer, push
from tests.test_sync import _catch

GROUP = "elastic"


@pytest.fixture(params=["etcd", "tcpstore"])
def url(request: Any, tmp_path: Path) -> Iterator[str]:
    if request.param == "etcd":
        need_etcd()
        with etcd_server(tmp_path) as u:
            yield u + "?ttl=3"
    else:
        server = open_tcp_store("127.0.0.1", 0, True)
        yield f"tcp://127.0.0.1:{server.port}"


@pytest.fixture
def group(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Peer]]:
    """The peers a test starts (stopped, and resumed first if a test left one stopped, at the end)."""
    monkeypatch.setenv("ELASTIC_PEERS_COPY_HOST", "0")
    everyone: list[Peer] = []
    yield everyone
    for p in everyone:
        if p.proc.poll() is None:
            os.kill(p.proc.pid, signal.SIGCONT)
        p.stop()


def start(everyone: list[Peer], url: str) -> tuple[list[Peer], list[Peer]]:
    """The group's targets and sharded sources, started, and version 1 landed byte-exact on every target."""
    ts = [Peer("target", str(r), url) for r in range(peers.TARGETS)]
    ss = [Peer("source", str(r), url, "sharded") for r in range(peers.SOURCES)]
    everyone += ts + ss
    for p in ts + ss:
        assert p.next().get("ready"), p.stderr
    push(ss, 1)
    for r, t in enumerate(ts):
        expect(t, r, 1)
    return ts, ss


def expect(target: Peer, rank: int, version: int, timeout: float = 60) -> dict[str, Any]:
    """Target ``rank``'s next line reports ``version``, byte-exact against what the sources held."""
    got = target.next(timeout)
    want = peers.digests(peers.target_share(rank, peers.model(version)))
    assert got.get("version") == version and got["sha"] == want and got["live"], (rank, version, got)
    return got


def reaches(target: Peer, rank: int, version: int, timeout: float = 60) -> None:
    """Target ``rank`` reports ``version`` (byte-exact) before any later one; every version it reports on the
    way is byte-exact too, errors on the way are allowed (the steps it missed)."""
    while True:
        got = target.next(timeout)
        if "error" in got:
            continue
        want = peers.digests(peers.target_share(rank, peers.model(got["version"])))
        assert got["sha"] == want and got["live"], (rank, got)
        assert got["version"] <= version, (rank, version, got)
        if got["version"] == version:
            return


def unpack(raw: bytes) -> Any:
    """A record as a reader without the token sees it (sealed or, before records were sealed, plain)."""
    try:
        return msgpack.unpackb(raw)
    except ValueError:
        return msgpack.unpackb(strip(raw))


def key(*parts: object) -> str:
    return "/".join(["tensorxfer.sync", GROUP, *map(str, parts)])


# ---------------------------------------------------------------- the store, written by someone without the token
@pytest.mark.parametrize("token", ["el", "none"])
@pytest.mark.slow
def test_garbage_in_the_store_is_named_and_a_bad_record_stops_no_one(url: str, token: str, group: list[Peer],
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Member records that are not msgpack, named ``x``, with a port that is no number, a ``latest`` that is no
    step: passed over, the group goes on.  A step record that is not the group's (not msgpack; with no token,
    sealed with the public key but of the wrong types): every rank names its key at once, and the next step
    goes on."""
    monkeypatch.setenv("ELASTIC_PEERS_TOKEN", token)
    targets, sources = start(group, url)
    rdv = connect(url)
    try:
        seal = Seal(None)       # what a writer without the token can do: seal with the public key at most
        prefix = key("member", "target")
        rdv.join(prefix, "7", b"\xc1 not msgpack")
        rdv.join(prefix, "x", seal.seal(f"{prefix}/x", msgpack.packb({"uid": "0" * 16, "address": ["h", 1]})))
        rdv.join(prefix, "8", seal.seal(f"{prefix}/8", msgpack.packb({"uid": "1" * 16, "address": ["h", "http"]})))
        rdv.publish(key("latest"), b"\xff\xfe")
        rdv.publish(key("report", 1, "target", 9), b"{}")
        stats = push(sources, 2)
        assert all(s.get("version") == 2 and s["epoch"] == 1 and not s["failed"] for s in stats), stats
        for r, t in enumerate(targets):
            expect(t, r, 2)

        bad = b"\x93\x01\x02" if token == "el" else seal.seal(key("step", 3), msgpack.packb(
            {"epoch": "one", "sources": [[0, "0" * 16]], "targets": {}}))
        rdv.publish(key("step", 3), bad)
        why = "not sealed" if token == "el" else "has epoch 'one'"
        t0 = time.monotonic()
        for got in push(sources, 3):
            assert got.get("error") == "StoreError" and key("step", 3) in got["message"], got
            assert why in got["message"], got
        for t in targets:
            got = t.next()
            assert got.get("error") == "StoreError" and key("step", 3) in got["message"], got
        assert time.monotonic() - t0 < peers.STALL, "every rank names the bad record at once"
        stats = push(sources, 4)
        assert all(s.get("version") == 4 and not s["failed"] for s in stats), stats
        for r, t in enumerate(targets):
            expect(t, r, 4)
    finally:
        rdv.close()


@pytest.mark.slow
def test_a_rewritten_description_steers_no_byte(url: str, group: list[Peer]) -> None:
    """A writer without the token rewrites a joining target's description (a validly hashed body, its tensors'
    region offsets swapped) before the group plans it: no rank plans from it (StoreError naming the key), no
    byte lands, the target comes back under a fresh description, and the next step is byte-exact."""
    targets, sources = start(group, url)
    joiner = Peer("target", "2", url)
    group.append(joiner)
    assert joiner.next().get("ready"), joiner.stderr
    rdv = connect(url)
    try:
        uid = unpack(rdv.members(key("member", "target"))["2"])["uid"]
        spec_key = key("spec", "target", 2, uid)
        ref = unpack(rdv.peek([spec_key])[0])
        body = zlib.decompress(rdv.peek([key("body", ref["content"])])[0])
        real = RankSpec.from_wire({"v": 1, "rank": 2, "body": body})
        a, b = real.tensors
        # b (5 floats) where a began, a (48 floats) after it: a layout as valid as the real one, another place
        forged = RankSpec("target", 2, [dataclasses.replace(a, region_offset=32),
                                        dataclasses.replace(b, region_offset=0)])
        rdv.publish(key("body", forged.content_digest.hex()), zlib.compress(forged.body))
        rdv.publish(spec_key, msgpack.packb({"content": forged.content_digest.hex(), "address": ref["address"]}))
        for got in push(sources, 2):
            assert got.get("error") == "StoreError" and spec_key in got["message"], got
        for t in (*targets, joiner):
            got = t.next()
            assert got.get("error") == "StoreError", got
        stats = push(sources, 3)
        assert all(s.get("version") == 3 and not s["failed"] and s["targets"] == [0, 1, 2] for s in stats), stats
        for r, t in enumerate(targets):
            expect(t, r, 3)
        got = joiner.next()
        assert got.get("version") == 3 and got["sha"] == peers.digests(peers.model(3)), got
    finally:
        rdv.close()


def test_a_record_sealed_for_one_key_is_refused_under_another() -> None:
    """The seal binds the key: one rank's valid record replayed as another's (or step 3's as step 4's) fails."""
    seal = Seal(b"k" * 32)
    value = seal.seal("g/spec/target/1/u", b"record")
    assert seal.open("g/spec/target/1/u", value) == b"record"
    for other_key in ("g/spec/target/0/u", "g/spec/target/1/v"):
        with pytest.raises(tx.StoreError, match="not sealed"):
            seal.open(other_key, value)
    with pytest.raises(tx.StoreError, match="not sealed"):
        Seal(b"x" * 32).open("g/spec/target/1/u", value)        # another group's token
    with pytest.raises(tx.StoreError, match="not sealed"):
        seal.open("g/k", value[:-1] + bytes([value[-1] ^ 1]))


# ---------------------------------------------------------------- stalls
@pytest.mark.slow
def test_a_target_stalled_for_a_while_gets_no_healthy_source_dropped(url: str, group: list[Peer],
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Two sharded sources each feeding one target (target r holds chunk r).  Target 1 stops for 7 s (stall
    timeout 5 s) while source 0 pushes on without waiting for source 1: source 1 reports target 1 failed
    within the stall timeout and stays in the group; target 1 is left out while stopped, rejoins once it
    runs, and every version is byte-exact."""
    monkeypatch.setenv("ELASTIC_PEERS_TARGETS", "sharded")
    targets, sources = start(group, url)
    os.kill(targets[1].proc.pid, signal.SIGSTOP)
    stopped = time.monotonic()
    for s in sources:
        s.send("push 2")
    got = sources[0].next()
    assert got.get("version") == 2 and not got["failed"], got
    expect(targets[0], 0, 2)
    sources[0].send("push 3")       # source 1 is still waiting for target 1
    got = sources[1].next()
    assert got.get("version") == 2 and set(got["failed"]) == {"1"}, got
    assert time.monotonic() - stopped < peers.STALL + 3, "source 1 gave up on target 1 within the stall timeout"
    got = sources[0].next()
    assert got.get("version") == 3 and got["targets"] == [0] and not got["failed"], got
    sources[1].send("push 3")
    got = sources[1].next()
    assert got.get("version") == 3 and got["targets"] == [], got      # in the step, with nothing to send
    expect(targets[0], 0, 3)
    time.sleep(max(0.0, 7 - (time.monotonic() - stopped)))
    os.kill(targets[1].proc.pid, signal.SIGCONT)
    got = targets[1].next()
    assert "error" in got, got       # its step 2 failed: both sources had given up on it
    # within two steps of its return the group is whole again; no source was ever left out
    for version in (4, 5):
        stats = push(sources, version)
        assert all(s.get("version") == version for s in stats), stats
        expect(targets[0], 0, version)
    reaches(targets[1], 1, 5)
    assert sorted(p for s in stats for p in s["targets"]) == [0, 1], stats


@pytest.mark.slow
def test_wait_without_a_timeout_names_a_source_that_stalled_before_offering(url: str, group: list[Peer],
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The targets' wait() has no timeout; source 1 stops before its offer of step 2: each target names it within
    the stall timeout of the step being decided, however long the stop lasts; the group recovers after it."""
    monkeypatch.setenv("ELASTIC_PEERS_WAIT", "none")
    targets, sources = start(group, url)
    os.kill(sources[1].proc.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        sources[0].send("push 2")
        got = sources[0].next()
        assert got.get("version") == 2, got
        for t in targets:
            got = t.next(timeout=4 * peers.STALL)
            assert got.get("error") == "TransferTimeout" and "source rank 1" in got["message"], got
        assert time.monotonic() - t0 < peers.STALL + 3, time.monotonic() - t0
    finally:
        os.kill(sources[1].proc.pid, signal.SIGCONT)
    sources[1].send("push 2")
    sources[1].next()           # its step 2 found the targets gone on: an error or failed pairs
    for version in (3, 4):
        stats = push(sources, version)
        assert all(s.get("version") == version for s in stats), stats
    for r, t in enumerate(targets):
        reaches(t, r, 4)


@pytest.mark.slow
def test_a_region_a_stalled_copy_host_may_still_write_takes_no_bytes_over_any_transport() -> None:
    """A target's memory is in doubt (a copy host took a step into it and stalled mid-copy: its fence reads
    RUNNING, its process lives): a step over tcp fails within the stall timeout naming the host, and no
    version is reported; once the host's step settles, the next step lands."""
    import subprocess
    import sys

    from tensorxfer.memory._fence import Fence
    from tensorxfer.transport.ipc.lane import IN_DOUBT, HostProcess

    server = open_tcp_store("127.0.0.1", 0, True)
    url = f"tcp://127.0.0.1:{server.port}"
    w = torch.arange(32, dtype=torch.float32)
    live = torch.zeros(32)
    host = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    syncs: dict[str, Any] = {}
    fence = Fence.create()
    try:
        def target() -> None:
            syncs["target"] = tx.WeightSync(url, "doubt", "target", 0, (1, 1), {"w": tx.sync.Target.whole(live, "w")},
                                            token="t", transport="tcp", stall_timeout=1.5, timeout=20)
        th = threading.Thread(target=target)
        th.start()
        source = syncs["source"] = tx.WeightSync(url, "doubt", "source", 0, (1, 1), {"w": tx.sync.Source.whole(w)},
                                                 token="t", transport="tcp", stall_timeout=1.5, timeout=20)
        th.join(30)
        tgt = syncs["target"]
        th = threading.Thread(target=lambda: tgt.wait(timeout=20))     # the first step sets the data path up
        th.start()
        source.push()
        th.join(30)
        w.add_(1)
        fence.grant(7)
        assert fence.take(7)                    # the host took step 7 ...
        IN_DOUBT.add(tgt.region, fence, 7, HostProcess(host.pid), "a test's host")       # ... and stalled
        errors: list[BaseException] = []
        th = threading.Thread(target=lambda: errors.append(_catch(lambda: tgt.wait(timeout=20))))
        th.start()
        t = time.monotonic()
        stats = source.push()
        th.join(30)
        assert isinstance(errors[0], tx.TransferTimeout) and f"pid {host.pid}" in str(errors[0]), errors
        assert time.monotonic() - t < 1.5 + 2 and set(stats.failed) == {0}, stats
        assert torch.equal(live, w - 1), "no byte of step 2 landed in memory in doubt"
        live.zero_()
        fence.finish(7, True)                   # the host finished its step: the doubt clears
        w.add_(1)
        live.zero_()
        th = threading.Thread(target=lambda: errors.append(tgt.wait(timeout=20)))
        th.start()
        assert not source.push().failed
        th.join(30)
        assert errors[1] == 3 and torch.equal(live, w), errors
        assert not IN_DOUBT.pending(tgt.region)
    finally:
        host.kill()
        host.wait()
        for s in syncs.values():
            s.close()


# ---------------------------------------------------------------- formation
def _form_and_fail(url: str, group: str, role: str, r: int, delay: float, errors: dict[str, BaseException],
                   took: dict[str, float]) -> None:
    time.sleep(delay)
    t = time.monotonic()
    tensors: dict[str, Any]
    if role == "target":
        tensors = {"w": tx.sync.Target.whole(torch.zeros(8, 4), "w")}
    else:       # both sources hold rows 0..3: rows 4..7 no source holds
        tensors = {"w": tx.sync.Source(torch.ones(4, 4), (8, 4), tx.sync.chunk_box((8, 4), 0, 0, 2))}
    try:
        tx.WeightSync(url, group, role, r, (2, 1), tensors, token="t", transport="tcp", timeout=8,
                      stall_timeout=2).close()
    except BaseException as e:
        errors[f"{role}{r}"] = e
    took[f"{role}{r}"] = time.monotonic() - t


def test_every_rank_of_a_group_that_cannot_plan_gets_the_same_error_promptly() -> None:
    """Two sources whose shards leave rows of ``w`` uncovered and one target: the group forms and every rank's
    plan fails.  A source that looked for step 0 before it was decided must find it (and fail the same way)
    instead of waiting for ranks that formed the group and left.  Ten rounds of three threads."""
    server = open_tcp_store("127.0.0.1", 0, True)
    url = f"tcp://127.0.0.1:{server.port}"
    for round_ in range(10):
        errors: dict[str, BaseException] = {}
        took: dict[str, float] = {}
        threads = [threading.Thread(target=_form_and_fail, args=(url, f"late{round_}", *a, errors, took)) for a in
                   (("target", 0, 0.0), ("source", 0, 0.0), ("source", 1, 0.02 * (round_ % 5)))]
        for th in threads:
            th.start()
        for th in threads:
            th.join(30)
        assert set(errors) == {"target0", "source0", "source1"}, (round_, errors)
        assert all(isinstance(e, tx.PlanError) and "[4:8, 0:4]" in str(e) for e in errors.values()), errors
        assert max(took.values()) < 6, (round_, took)
