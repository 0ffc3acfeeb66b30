"""Elastic weight sync with real processes on a real store: a real etcd server (Debian's etcd-server) or a
TCPStore.  Targets join, die and leave while two sources keep pushing; a dead source is named."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="the sync's peers hold torch tensors")

from tensorxfer.sync.records import group_key
from tensorxfer.sync.rendezvous import connect
from tests import elastic_peers as peers
from tests.etcd_server import etcd_server, need_etcd
from tests.helpers import wait_until

ROOT = Path(__file__).resolve().parent.parent
ALL: list[Any] = []


class Peer:
    """One peer process and the JSON lines it prints."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.elastic_peers", *args], cwd=ROOT,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: queue.Queue[dict[str, Any]] = queue.Queue()
        self.stderr: list[str] = []
        ALL.append(self)
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=lambda: self.stderr.extend(self.proc.stderr), daemon=True).start()  # type: ignore

    def _read(self) -> None:
        for line in self.proc.stdout:       # type: ignore[union-attr]
            self.lines.put(json.loads(line))

    def next(self, timeout: float = 60) -> dict[str, Any]:
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            for p in ALL:
                if p.proc.poll() is None:
                    p.proc.send_signal(signal.SIGUSR1)
            time.sleep(1)
            others = "\n".join(f"{p.proc.args[3:]}: {''.join(p.stderr)[-3000:]}" for p in ALL if p is not self)
            raise AssertionError(f"peer {self.proc.args[3:]} said nothing in {timeout} s; stderr: "
                                 f"{''.join(self.stderr)[-6000:]}\nthe others:\n{others}") from None

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            if self.proc.stdin:
                try:
                    self.send("exit")
                except OSError:
                    pass
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if f:
                f.close()


@pytest.fixture(params=["etcd", "tcpstore", "tcpstore-ipc-copy-host"])
def store_url(request: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The store; the third case runs the peers over ipc with their targets copying through one of them (the
    copy host: elected among three targets, one of which is killed -- perhaps the host)."""
    monkeypatch.setenv("ELASTIC_PEERS_COPY_HOST", "1" if request.param.endswith("copy-host") else "0")
    if request.param == "etcd":
        need_etcd()
        with etcd_server(tmp_path) as url:
            yield url + "?ttl=3"
    else:
        from tensorxfer.sync.rendezvous import open_tcp_store

        server = open_tcp_store("127.0.0.1", 0, True)
        yield f"tcp://127.0.0.1:{server.port}"


def push(sources: list[Peer], version: int) -> list[dict[str, Any]]:
    for s in sources:
        s.send(f"push {version}")
    return [s.next() for s in sources]


def expect_version(targets: list[Peer], version: int) -> list[dict[str, Any]]:
    want = peers.digests(peers.model(version))
    lines = []
    for t in targets:
        got = t.next()
        assert got.get("version") == version and got["sha"] == want and got["live"], (version, got)
        lines.append(got)
    return lines


@pytest.mark.slow
def test_targets_join_die_and_leave_while_sources_push(store_url: str) -> None:
    everyone: list[Peer] = []
    try:
        targets = [Peer("target", str(r), store_url) for r in range(2)]
        sources = [Peer("source", str(r), store_url, "sharded") for r in range(2)]
        everyone += targets + sources
        hosting = []
        for p in everyone:
            ready = p.next()
            assert ready.get("ready"), p.stderr
            hosting += [ready.get("hosting")] if p in targets else []
        hosted = os.environ["ELASTIC_PEERS_COPY_HOST"] == "1"
        assert hosting.count(True) == hosted, hosting      # one target hosts the copies on its device
        for version in (1, 2):
            assert [r["version"] for r in push(sources, version)] == [version] * 2
            expect_version(targets, version)

        # a third target joins after version 2: the next push includes it, nobody else restarts
        joiner = Peer("target", "2", store_url)
        everyone.append(joiner)
        assert joiner.next().get("ready"), joiner.stderr
        stats = push(sources, 3)
        assert all(s["epoch"] == 2 and not s["failed"] for s in stats), (stats, [t.next(5) for t in targets])
        assert sorted({t for s in stats for t in s["targets"]}) == [0, 1, 2]
        got = expect_version([*targets, joiner], 3)
        # ... and copied the other's pairs (2 sources) at versions 1 and 2 -- done before version 3 began, as the
        # sources waited for every ack (a host's own report of a version may come before its lanes' copies of it)
        counts = sorted(g["hosted"] for g in got)
        assert (counts[-1] >= 2 * 2 and counts[:-1] == [0, 0]) if hosted else counts == [0, 0, 0], got

        # target 1 is killed: version 4 completes for the others and names it; version 5 runs without it
        targets[1].kill()
        stats = push(sources, 4)
        assert all(s["version"] == 4 for s in stats), stats
        assert {1} == {int(t) for s in stats for t in s["failed"]}, stats
        expect_version([targets[0], joiner], 4)
        stats = push(sources, 5)
        assert all(not s["failed"] and s["epoch"] == 3 for s in stats), stats
        assert sorted({t for s in stats for t in s["targets"]}) == [0, 2]
        expect_version([targets[0], joiner], 5)
        # the operator's view, from the store alone
        status = json.loads(subprocess.run([sys.executable, "-m", "tensorxfer.cli.main", "sync-status", store_url,
                                            "elastic", "--json"], capture_output=True, text=True, check=True,
                                           timeout=60).stdout)
        assert status["latest_step"] == 5 and status["epoch"] == 3, status
        assert status["step_members"] == {"source": [0, 1], "target": [0, 2]}, status
        ranks = {(r["role"], r["rank"]): r for r in status["ranks"]}
        assert set(ranks) == {("source", 0), ("source", 1), ("target", 0), ("target", 2)}, "the dead one was evicted"
        assert len({r["digest"] for r in ranks.values()}) == 1 and all(r["alive"] for r in ranks.values())
        assert all(r["report"]["version"] == 5 and r["report"]["ok"] for r in ranks.values()), ranks

        # source 1 is killed: the targets it fed name it within the stall timeout (timed from the kill: a
        # target's own clock started at its wait, before the sync-status above, which imports torch)
        killed = time.monotonic()
        sources[1].kill()
        [got] = push(sources[:1], 6)
        assert got.get("version") == 6 and not got["failed"], got
        for t in (targets[0], joiner):
            got = t.next()
            assert got.get("error") in ("PeerLost", "TransferTimeout") and "source rank 1" in got["message"], got
            assert time.monotonic() - killed < peers.STALL + 2, got
        # the next step has only source 0, whose shard of `a` leaves rows 4..7 uncovered: every rank says so
        [got] = push(sources[:1], 7)
        assert got.get("error") == "PlanError" and "'a' needs box [4:8, 0:6]" in got["message"], got
        for t in (targets[0], joiner):
            got = t.next()
            assert got.get("error") == "PlanError" and "[4:8, 0:6]" in got["message"], got
    finally:
        for p in everyone:
            p.stop()


@pytest.mark.slow
def test_a_dead_source_s_replica_carries_the_next_step(tmp_path: Path) -> None:
    need_etcd()
    everyone: list[Peer] = []
    with etcd_server(tmp_path) as url:
        try:
            url += "?ttl=2"
            targets = [Peer("target", str(r), url) for r in range(2)]
            sources = [Peer("source", str(r), url, "replicated") for r in range(2)]
            everyone += targets + sources
            for p in everyone:
                assert p.next().get("ready"), p.stderr
            push(sources, 1)
            expect_version(targets, 1)
            sources[1].kill()
            # its lease expires (ttl 2 s; later on a busy disk): the next step is planned without it at once
            rdv = connect(url)
            try:
                wait_until(lambda: "1" not in rdv.members(group_key(peers.GROUP, "member", "source")), 30,
                           "the dead source's lease expiring")
            finally:
                rdv.close()
            [stats] = push(sources[:1], 2)
            assert stats.get("version") == 2 and stats["epoch"] == 2 and not stats["failed"], stats
            expect_version(targets, 2)
            # a target that leaves cleanly is left out of the next step, which succeeds for the other
            targets[1].stop()
            [stats] = push(sources[:1], 3)
            assert stats["targets"] == [0] and not stats["failed"] and stats["epoch"] == 3, stats
            expect_version(targets[:1], 3)
        finally:
            for p in everyone:
                p.stop()
