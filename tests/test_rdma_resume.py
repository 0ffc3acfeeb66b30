"""Recovery within one update over rdma (issue 40), on a real verbs device (Soft-RoCE in the CI VM).

Faults are real: a QP of the sender or of the receiver is moved to the error state (``ibv_modify_qp`` to
``IBV_QPS_ERR``, ``rdma_engine.Fault``) once a chosen number of bytes landed, mid-update; in-flight requests
then flush or are dropped by the device as they would on a link that failed.  Both ends live in this process
(the receiver in a thread) and talk over loopback TCP for control, by RDMA WRITE for the data.
"""

from __future__ import annotations

import gc
import logging
import os

import numpy as np
import pytest

import tensorxfer as tx
from tensorxfer import Manifest, Receiver, Sender, TensorRegion
from tensorxfer.errors import CompletionError
from tensorxfer.session.recovery import RecoveryPolicy
from tensorxfer.transport import rdma_engine
from tensorxfer.transport.rdma import rdma_available
from tensorxfer.transport.rdma_engine import Fault
from tests.helpers import Background

OK, REASON = rdma_available()
pytestmark = [pytest.mark.rdma, pytest.mark.skipif(not OK, reason=f"no usable RDMA device: {REASON}")]

MIB = 1 << 20
PATTERN = 0x9E3779B97F4A7C15
# The VM is slow (Soft-RoCE under TCG, ~20-50 MB/s): sizes stay modest; the 1 GiB run is the benchmark's.
SIZE = int(os.environ.get("TENSORXFER_RDMA_RESUME_MB", "64")) * MIB
# A sender-side fault needs more than the sender keeps in flight (4 QPs x 32 requests x 1 MiB = 128 MiB): on
# Soft-RoCE a post runs the device inline, so a smaller update is all posted, and landed, before the first slice.
BIG = max(SIZE, 256 * MIB)


def region(nbytes: int, seed: int = 0, **kw: int) -> TensorRegion:
    """``nbytes`` in 16 tensors (odd tail: the last RDMA request is short), words numbered from ``seed``."""
    r = TensorRegion.from_manifest(Manifest.layout([(f"t{i}", "U8", (nbytes // 16,)) for i in range(15)]
                                                   + [("tail", "U8", (nbytes - 15 * (nbytes // 16) - 3,))]), **kw)
    with memoryview(r.region) as mv:
        words = np.frombuffer(mv, dtype=np.uint64, count=r.nbytes // 8)
        words[:] = (np.arange(len(words), dtype=np.uint64) + np.uint64(seed)) * np.uint64(PATTERN)
        del words
    return r


def same(a: TensorRegion, b: TensorRegion) -> bool:
    with memoryview(a.region) as x, memoryview(b.region) as y:
        return bool(x.cast("B")[:a.nbytes] == y.cast("B")[:b.nbytes])


def addr(rx: Receiver) -> str:
    return "{}:{}".format(*rx.address)


def breaks(caplog: pytest.LogCaptureFixture) -> list[dict]:
    return [r.rdma_break for r in caplog.records if hasattr(r, "rdma_break")]


@pytest.fixture
def fault(monkeypatch: pytest.MonkeyPatch):
    def make(side: str, after: int, qp: int = 1, times: int = 1) -> Fault:
        f = Fault(side, after, qp=qp, times=times)
        monkeypatch.setattr(rdma_engine, "_FAULT", f)
        return f
    return make


@pytest.mark.parametrize("side", ["sender", "receiver"])
def test_a_qp_broken_mid_update_resumes_only_what_did_not_land(side: str, fault, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="tensorxfer")
    f = fault(side, BIG // 2)
    with region(BIG) as src, Receiver(stall_timeout=20) as rx:
        job = Background(rx.receive, timeout=300)
        with Sender(addr(rx), transport="rdma", streams=4, stall_timeout=20) as s:
            st = s.send(src, verify=True)
        got = job.result(timeout=300)
        rs = rx.last_stats
        assert len(f.fired) == 1 and f.fired[0] >= BIG // 2, f.fired
        assert same(src, got) and rs is not None and rs.verified
        # one update, one version: the cut update completed as update 1
        assert st.update == 1 and rs.update == 1 and rx.version is not None and rx.version.update == 1
        assert st.retries == 1 and rs.retries == 1 and st.recovery_seconds > 0 and rs.recovery_seconds > 0
        # the registration is paid once; the QPs were connected again
        assert dict(st.counters) == {"registrations": 1, "connects": 2, "updates": 1}, st.counters
        assert dict(rs.counters) == {"registrations": 1, "connects": 2, "updates": 1}, rs.counters
        [b] = breaks(caplog)
        # sent twice: requests posted before the break that did not land -- never more than was in flight then
        assert 0 < st.resent_bytes <= b["in_flight"] <= b["posted"] < BIG, (st.resent_bytes, b)
        assert rs.resent_bytes == 0


def test_a_break_in_the_resume_round_is_resumed_again(fault) -> None:
    f = fault("receiver", SIZE // 3, qp=2, times=2)
    with region(SIZE, seed=5) as src, Receiver(stall_timeout=20) as rx:
        job = Background(rx.receive, timeout=300)
        with Sender(addr(rx), transport="rdma", streams=4, stall_timeout=20) as s:
            st = s.send(src)
        got = job.result(timeout=300)
        assert len(f.fired) == 2 and same(src, got)
        assert st.retries == 2 and rx.last_stats is not None and rx.last_stats.retries == 2
        assert st.counters["registrations"] == 1 and st.counters["connects"] == 3


def test_recovery_off_on_the_receiver_fails_typed_and_it_serves_the_next_sender(fault) -> None:
    fault("sender", BIG // 2)
    with region(BIG) as src, Receiver(stall_timeout=20, recovery=None) as rx:
        job = Background(rx.receive, timeout=300)
        with Sender(addr(rx), transport="rdma", streams=4, stall_timeout=20) as s:
            with pytest.raises(tx.TransferError):
                s.send(src)
        with pytest.raises(tx.PeerLost, match="QPs broke"):
            job.result(timeout=60)
        assert rx.version is None                   # nothing partial reported
        rdma_engine._FAULT = None
        job = Background(rx.receive, timeout=300)
        with Sender(addr(rx), transport="rdma", streams=4, stall_timeout=20) as s:
            s.send(src)
        assert same(src, job.result(timeout=300)) and rx.version is not None


def test_breaks_past_the_attempts_fail_typed_and_the_receiver_serves_the_next_sender(fault) -> None:
    fault("receiver", SIZE // 4, times=2)
    with region(SIZE) as src, Receiver(stall_timeout=20, recovery=RecoveryPolicy(attempts=1)) as rx:
        job = Background(rx.receive, timeout=300)
        with Sender(addr(rx), transport="rdma", streams=4, stall_timeout=20) as s:
            with pytest.raises(tx.TransferError):
                s.send(src)
        with pytest.raises(tx.TransferError, match="1 reconnect attempt"):
            job.result(timeout=60)
        assert rx.version is None
        rdma_engine._FAULT = None
        job = Background(rx.receive, timeout=300)
        with Sender(addr(rx), transport="rdma", stall_timeout=20) as s:
            s.send(src)
        assert same(src, job.result(timeout=300))


def test_a_fault_of_memory_is_not_resumed(monkeypatch: pytest.MonkeyPatch) -> None:
    """IBV_WC_LOC_PROT_ERR (the sender's MR covers its first chunk only) would fail on a new QP too: raised as it
    is, with recovery on (the default)."""
    monkeypatch.setattr(rdma_engine, "_FIRST_CHUNK_ONLY", True)
    with region(8 * MIB, chunk_size=MIB) as src, Receiver(stall_timeout=10) as rx:
        job = Background(rx.receive, timeout=60)
        with Sender(addr(rx), transport="rdma", stall_timeout=10) as s:
            with pytest.raises(CompletionError, match="IBV_WC_LOC_PROT_ERR"):
                s.send(src)
        with pytest.raises(Exception):  # noqa: B017  (the receiver sees the sender give up, whatever its form)
            job.result(timeout=60)
        assert rx.version is None


def test_updates_with_a_break_every_5th_register_once_and_leak_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    import psutil

    size, n = 8 * MIB, 20
    me = psutil.Process()
    with region(size) as src, Receiver(stall_timeout=20) as rx:
        job = Background(lambda: [rx.receive(timeout=120) and rx.last_stats for _ in range(n)])
        retries, samples = 0, []
        with Sender(addr(rx), transport="rdma", streams=2, stall_timeout=20) as s:
            for i in range(n):
                # receiver-side: an 8 MiB update is all posted at once (see BIG), so a sender-side fault has
                # nothing left to break by the time it is checked
                monkeypatch.setattr(rdma_engine, "_FAULT", Fault("receiver", size // 2, qp=i // 5 % 2)
                                    if i % 5 == 2 else None)
                retries += s.send(src).retries
                if i in (4, n - 1):
                    gc.collect()
                    samples.append((me.num_fds(), me.memory_info().rss))
        got = job.result(timeout=600)
    assert retries == n // 5 and sum(st.retries for st in got) == retries
    assert dict(got[-1].counters) == {"registrations": 1, "connects": 1 + retries, "updates": n}
    (fds0, rss0), (fds1, rss1) = samples
    assert fds1 == fds0, f"fds grew over {n - 5} updates with breaks: {fds0} -> {fds1}"
    assert rss1 - rss0 < 16 * MIB
