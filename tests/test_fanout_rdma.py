"""Fan-out over rdma between real processes, on a real verbs device (Soft-RoCE in CI's VM).

Every hop is an engine session over rdma (MR registered and QPs connected once per hop, kept across
updates); an rdma relay forwards as its own copy lands: its receiver asks its sender for piece marks
(immediates every few requests per QP), and its sender posts no request past the landed prefix.
"""

from __future__ import annotations

import signal
import threading
import time

import pytest

from tensorxfer.fanout import FanoutSender
from tensorxfer.fanout import sender as fanout_sender
from tensorxfer.transport.rdma import rdma_available

from .fanout_peer import fd_kinds
from .test_fanout import TOKEN, fd_report, fds, model, peers, sha  # noqa: F401  (peers: the fixture)

OK, REASON = rdma_available()
pytestmark = [pytest.mark.rdma, pytest.mark.skipif(not OK, reason=f"no usable RDMA device: {REASON}")]

MIB = 1 << 20


def test_one_to_three_over_rdma_byte_identical_verified_twice(peers):  # noqa: F811
    ps = peers(3, stall=60.0)
    with model(8 * MIB) as region, \
            FanoutSender([p.address for p in ps], token=TOKEN, transport="rdma", stall_timeout=60) as fan:
        for update in (1, 2):
            if update == 2:
                region.tensors()["layer2.w"][:] = 42
            stats = fan.send(region, verify=True)
            assert stats.ok, stats.failed
            assert [r.address for r in stats.receivers] == [p.address for p in ps]
            assert [r.via for r in stats.receivers] == ["sender"] + [p.address for p in ps[:-1]]
            assert all(r.transport == "rdma" and r.verified and r.bytes == region.nbytes for r in stats.receivers)
            assert stats.version.update == update
            assert 0 < stats.piece_bytes < region.nbytes      # pipelined, not store and forward
            want = sha(region)
            for p in ps:
                got = p.wait_oks(update, timeout=120)[update - 1]
                assert got["sha256"] == want and got["verified"] and got["update"] == update
        # every hop registered and connected once: the second update paid only data
        assert stats.head is not None and stats.head.counters == {"registrations": 1, "connects": 1, "updates": 2}


def test_a_killed_rdma_receiver_is_named_and_the_others_complete(peers):  # noqa: F811
    ps = peers(3, stall=20.0)
    victim = ps[1]
    with model(8 * MIB, seed=5) as region, \
            FanoutSender([p.address for p in ps], token=TOKEN, transport="rdma", stall_timeout=20) as fan:
        assert fan.send(region).ok                   # every hop set up
        region.tensors()["layer0.w"][:] = 9
        # Kill the middle receiver while the next update moves: once the origin's write to the first
        # receiver completed, the middle one (fed by the first) is somewhere in its own hop and has not
        # acknowledged (it waits for the hop after it).  It is named; the chain goes around it.
        killed = threading.Event()

        def kill_victim(_: int) -> None:
            if not killed.is_set():
                killed.set()
                victim.proc.kill()
        stats = fan.send(region, verify=True, progress=kill_victim)
        assert killed.is_set()
        [bad] = stats.failed
        assert bad.address == victim.address and bad.error_type and bad.error
        ok = [r for r in stats.receivers if r.ok]
        assert [r.address for r in ok] == [ps[0].address, ps[2].address]
        assert all(r.verified for r in ok)
        for p in (ps[0], ps[2]):
            assert p.wait_oks(2, timeout=120)[-1]["sha256"] == sha(region)
        assert fan.chain == [ps[0].address, ps[2].address]
        assert fan.send(region, verify=True).ok      # the next update goes around it from the start


def test_a_stalled_rdma_receiver_is_cut_out_after_the_stall_timeout(peers):  # noqa: F811
    # The middle receiver is stopped (SIGSTOP) while the next update moves.  One-sided writes into its
    # region still land (the device does them, not the process), so what times out is its silence: the
    # relay before it waits for its accept or its ack, names it TransferTimeout and sends the update to
    # the last receiver instead.  The stopped process never acknowledges a version it did not check.
    ps = peers(3, stall=3.0)
    victim = ps[1]
    stopped = threading.Event()

    def stop_victim(_: int) -> None:
        # The origin's write to the first receiver just completed: the victim, fed by the first, has not
        # acknowledged (it waits for the hop after it), so it stops mid-update, wherever its bytes are.
        if not stopped.is_set():
            stopped.set()
            victim.proc.send_signal(signal.SIGSTOP)

    with model(8 * MIB, seed=7) as region, \
            FanoutSender([p.address for p in ps], token=TOKEN, transport="rdma", stall_timeout=3) as fan:
        assert fan.send(region).ok                   # every hop set up: the stop hits a warm chain
        region.tensors()["layer3.w"][:] = 11
        t0 = time.perf_counter()
        stats = fan.send(region, verify=True, progress=stop_victim)
        elapsed = time.perf_counter() - t0
        assert stopped.is_set()
        [bad] = stats.failed
        assert bad.address == victim.address and bad.error_type == "TransferTimeout", bad
        assert elapsed < 60, elapsed                 # a control timeout (10 s) plus the resend, not a hang
        ok = [r for r in stats.receivers if r.ok]
        assert [r.address for r in ok] == [ps[0].address, ps[2].address] and all(r.verified for r in ok)
        assert ok[1].via == ps[0].address            # the hop before the stalled one repaired the chain
        for p in (ps[0], ps[2]):
            assert p.wait_oks(2, timeout=120)[-1]["sha256"] == sha(region)
        assert not [r for r in victim.oks() if r.get("update") == 2]
        assert fan.chain == [ps[0].address, ps[2].address]
        assert fan.send(region, verify=True).ok      # the next update goes around it from the start


def test_repeated_rdma_chain_updates_keep_fds_and_rss_flat(peers, monkeypatch):  # noqa: F811
    # Every hop registers and connects once; 20 more updates must open nothing and grow no memory
    # on the sender or on any receiver (relays included: their marks, gates and forward sessions).
    # The chain must stay as it is for that: a hop the emulated NIC happens to slow down three updates in a
    # row would be moved to the tail (its own test covers that), and the relays around it would connect anew.
    monkeypatch.setattr(fanout_sender, "SLOW_STRIKES", 1 << 30)
    ps = peers(3, stall=60.0, digest=False)
    with model(4 * MIB) as region, \
            FanoutSender([p.address for p in ps], token=TOKEN, transport="rdma", stall_timeout=60) as fan:
        for _ in range(3):
            assert fan.send(region).ok
        before, kinds = fds(), fd_kinds()
        for _ in range(20):
            stats = fan.send(region)
            assert stats.ok and all(r.transport == "rdma" for r in stats.receivers), stats.failed
            assert list(stats.chain) == [p.address for p in ps], stats.chain
        assert fds() == before, (kinds, fd_kinds())
        assert stats.head is not None and stats.head.counters["registrations"] == 1
    for p in ps:
        reports = p.wait_oks(23, timeout=120)
        assert {r["fds"] for r in reports[3:]} == {reports[3]["fds"]}, fd_report(reports)
        growth = reports[-1]["rss_kb"] - reports[3]["rss_kb"]
        assert growth < 8 << 10, f"{p.address}: RSS grew {growth} KiB over 20 updates"
