"""Pipelined rdma hops (issue 11): piece marks to a relaying receiver, a write gated by a relay's landed prefix.

On a real verbs device (Soft-RoCE in CI's VM); both ends in this process, the receiver in a thread.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import replace

import msgpack
import numpy as np
import pytest

from tensorxfer.errors import PeerLost, TransferError, UpstreamFailed
from tensorxfer.fanout import Landed
from tensorxfer.region import TensorRegion
from tensorxfer.transport import rdma_engine
from tensorxfer.transport.base import TransferContext
from tensorxfer.transport.rdma import RdmaReceiverEndpoint, RdmaSenderEndpoint, rdma_available
from tensorxfer.transport.rdma_engine import RdmaReceiver, RdmaSender
from tests.helpers import Background, region_of

OK, REASON = rdma_available()
pytestmark = [pytest.mark.rdma, pytest.mark.skipif(not OK, reason=f"no usable RDMA device: {REASON}")]

MIB = 1 << 20
NBYTES = 8 * MIB + 12_345          # the last request is short


def ctx(stall: float = 30.0) -> TransferContext:
    return TransferContext(local_host="127.0.0.1", peer_host="127.0.0.1", session_key=os.urandom(32),
                           stall_timeout=stall, streams=2)


def fill(region: TensorRegion, seed: int) -> bytes:
    data = np.random.default_rng(seed).integers(0, 256, region.nbytes, dtype=np.uint8).tobytes()
    mv = memoryview(region.region).cast("B")
    mv[:region.nbytes] = data
    mv.release()
    return data


def payload(region: TensorRegion, offset: int = 0, length: int | None = None) -> bytes:
    mv = memoryview(region.region).cast("B")
    try:
        return bytes(mv[offset:region.nbytes if length is None else offset + length])
    finally:
        mv.release()


class Pieces:
    """A relay's on_piece: records each range and checks its bytes are really in the region when reported."""

    def __init__(self, dst: TensorRegion, want: bytes) -> None:
        self.dst, self.want = dst, want
        self.ranges: list[tuple[int, int]] = []
        self.wrong: list[tuple[int, int]] = []
        self.changed = threading.Condition()

    def __call__(self, offset: int, length: int) -> None:
        if payload(self.dst, offset, length) != self.want[offset:offset + length]:
            self.wrong.append((offset, length))
        with self.changed:
            self.ranges.append((offset, length))
            self.changed.notify_all()

    @property
    def end(self) -> int:
        return self.ranges[-1][0] + self.ranges[-1][1] if self.ranges else 0

    def wait_end(self, end: int, timeout: float) -> None:
        with self.changed:
            assert self.changed.wait_for(lambda: self.end >= end, timeout), (self.ranges, end)

    def check_cover(self, nbytes: int) -> None:
        assert not self.wrong, f"reported before its bytes landed: {self.wrong}"
        pos = 0
        for offset, length in self.ranges:       # contiguous, increasing, from 0
            assert offset == pos and length > 0, self.ranges
            pos += length
        assert pos == nbytes


@pytest.fixture
def small_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    # a mark after every 1 MiB request: several pieces in a region that moves in seconds under TCG
    monkeypatch.setattr(rdma_engine, "RELAY_PIECE_BYTES", MIB)


def hop(c: TransferContext, dst: TensorRegion, src: TensorRegion, rx: RdmaReceiver, tx: RdmaSender,
        seq: int, fresh: bool) -> Background:
    """prepare/connect one update (the receiver's wait in the background, as the session does)."""
    d = msgpack.unpackb(msgpack.packb(rx.prepare(dst, seq, fresh)))
    job = Background(rx.wait)
    tx.connect(src, seq, d)
    return job


def test_a_relay_receiver_gets_increasing_pieces_before_the_update_completes(small_pieces: None) -> None:
    c = ctx()
    with region_of(NBYTES) as dst, region_of(NBYTES) as src, RdmaReceiver(c) as rx, RdmaSender(c) as tx:
        for seq in (1, 2):                  # the setup update and a warm one
            want = fill(src, seq)
            pieces = Pieces(dst, want)
            rx.on_piece = pieces
            d = rx.prepare(dst, seq, seq == 1)
            assert d["marks"] == 1 and d["wr_size"] == MIB and d["streams"] == 2
            job = Background(rx.wait)
            tx.connect(src, seq, msgpack.unpackb(msgpack.packb(d)))
            assert tx.send(src) == NBYTES
            assert job.result(timeout=120) == NBYTES
            assert payload(dst) == want
            assert len(pieces.ranges) >= 2, pieces.ranges     # all but the last came before completion
            pieces.check_cover(NBYTES)
        # the plain path is unchanged: no on_piece, no marks asked for
        rx.on_piece = None
        want = fill(src, 3)
        d = rx.prepare(dst, 3, False)
        assert "marks" not in d
        job = Background(rx.wait)
        tx.connect(src, 3, d)
        tx.send(src)
        assert job.result(timeout=120) == NBYTES and payload(dst) == want


def test_a_gated_relay_sender_stops_at_the_landed_prefix_and_finishes_when_it_grows(small_pieces: None) -> None:
    c = ctx(stall=4.0)
    with region_of(NBYTES) as dst, region_of(NBYTES) as src, RdmaReceiver(replace(c, stall_timeout=60.0)) as rx, \
            RdmaSender(c) as tx:
        want = fill(src, 7)
        pieces = Pieces(dst, want)
        rx.on_piece = pieces                # the next hop is a relay too: its marks show what it got
        landed = Landed(NBYTES, 20.0)       # its own upstream is not what this test stalls
        landed.add(0, 3 * MIB + 100)        # the sender's own copy: 3 MiB and a bit
        job = hop(c, dst, src, rx, tx, 1, True)
        tx.landing = landed
        send = Background(tx.send, src)
        pieces.wait_end(3 * MIB, timeout=60)
        # held there for longer than the stall timeout: waiting for upstream is not the receiver stalling
        time.sleep(c.stall_timeout + 1.0)
        assert pieces.end == 3 * MIB, "nothing past the landed prefix may be written"
        assert send.thread.is_alive() and job.thread.is_alive()
        landed.add(3 * MIB + 100, 2 * MIB)
        pieces.wait_end(5 * MIB, timeout=60)
        landed.add_all()
        assert send.result(timeout=120) == NBYTES
        assert job.result(timeout=120) == NBYTES
        assert payload(dst) == want
        pieces.check_cover(NBYTES)


def test_an_upstream_failure_aborts_the_gated_write_as_upstream_failed() -> None:
    c = ctx(stall=20.0)
    with region_of(NBYTES) as dst, region_of(NBYTES) as src, RdmaReceiver(c) as rx, RdmaSender(c) as tx:
        fill(src, 8)
        landed = Landed(NBYTES, c.stall_timeout)
        landed.add(0, MIB)
        job = hop(c, dst, src, rx, tx, 1, True)
        tx.landing = landed
        send = Background(tx.send, src)
        time.sleep(1.0)
        t0 = time.monotonic()
        landed.abort("upstream died")
        with pytest.raises(UpstreamFailed, match="upstream died"):
            send.result(timeout=30)
        assert time.monotonic() - t0 < 5
        tx.close()                          # the relay drops the hop: the next hop sees its sender gone
        with pytest.raises(PeerLost):
            job.result(timeout=30)


def _hostile(rx_marks: int, rx_wr: int, tx_marks: int, tx_wr: int, match: str) -> None:
    with region_of(8 * MIB) as dst, region_of(8 * MIB) as src, \
            RdmaReceiverEndpoint(dst, qps=2) as rx, RdmaSenderEndpoint(src, qps=2) as tx:
        fill(src, 9)
        tx.connect(rx.descriptors())
        rx.connect(tx.descriptors())
        got: list[tuple[int, int]] = []
        send = Background(tx.write, timeout=5.0, wr_size=tx_wr, marks=tx_marks, update=1)
        t0 = time.monotonic()
        with pytest.raises(TransferError, match=match):
            rx.wait_complete(timeout=60, update=1, marks=rx_marks, wr_size=rx_wr,
                             on_piece=(lambda o, n: got.append((o, n))) if rx_marks else None)
        assert time.monotonic() - t0 < 30
        assert all(o + n <= 8 * MIB for o, n in got)
        rx.close()                          # the sender's write fails or stalls out; either way it ends
        send.thread.join(timeout=60)
        assert not send.thread.is_alive()


@pytest.mark.parametrize(("rx_marks", "rx_wr", "tx_marks", "tx_wr", "match"), [
    (0, 0, 1, MIB, "no marks were asked for"),               # a plain receiver gets marks
    (2, MIB, 1, MIB, "next mark expected there is request 1"),  # marks not where asked
    (1, MIB, 1, 256 << 10, "no more marks are expected"),     # past the QP's requests (smaller requests)
])
def test_a_hostile_or_out_of_range_mark_is_a_typed_error(rx_marks: int, rx_wr: int, tx_marks: int, tx_wr: int,
                                                         match: str) -> None:
    _hostile(rx_marks, rx_wr, tx_marks, tx_wr, match)
