"""Transfers of segments (a weight sync's runs): each transport moves exactly the runs, each to its place.

The same transports as a whole-region update, given strided groups of runs from the sender's region to
scattered places in the receiver's; checked byte for byte against numpy applying the same runs, over a
setup update and a warm one (the data path is reused).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from tensorxfer import Manifest, TensorRegion
from tensorxfer.errors import ProtocolError
from tensorxfer.transport import ipc, tcp
from tensorxfer.transport.base import TransferContext
from tensorxfer.transport.segments import Segments

from .helpers import Background

SRC, DST = 3 << 20, 5 << 20


def region(nbytes: int, seed: int | None = None) -> TensorRegion:
    r = TensorRegion.from_manifest(Manifest.layout([("b", "U8", (nbytes,))]))
    if seed is not None:
        with memoryview(r.region) as mv:
            mv[:nbytes] = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    return r


def payload(r: TensorRegion) -> np.ndarray:
    with memoryview(r.region) as mv:
        return np.frombuffer(bytes(mv[:r.nbytes]), dtype=np.uint8).copy()


def layout(seed: int) -> Segments:
    """Strided groups (rows of a 2-D block, like a row-parallel shard) and plain runs, disjoint in the
    destination, in a shuffled order."""
    rng = np.random.default_rng(seed)
    groups = []
    dst = 0
    for _ in range(40):
        count = int(rng.integers(1, 300))
        n = int(rng.integers(1, 5000))
        dst_stride = n + int(rng.integers(0, 64))
        src_stride = n + int(rng.integers(0, 4096))
        src = int(rng.integers(0, SRC - (count - 1) * src_stride - n))
        if dst + (count - 1) * dst_stride + n > DST:
            break
        groups.append((src, dst, n, count, src_stride if count > 1 else 0, dst_stride if count > 1 else 0))
        dst += (count - 1) * dst_stride + n + int(rng.integers(0, 1000))
    rng.shuffle(groups)
    return Segments.of(*zip(*groups))


def expected(src: np.ndarray, dst_before: np.ndarray, seg: Segments) -> np.ndarray:
    out = dst_before.copy()
    for s, d, n in seg.runs():
        out[d:d + n] = src[s:s + n]
    return out


def ctx(streams: int | None = None) -> TransferContext:
    return TransferContext(local_host="127.0.0.1", peer_host="127.0.0.1", session_key=os.urandom(32),
                           stall_timeout=20.0, streams=streams)


def hop(rt, st, src: TensorRegion, dst: TensorRegion, seg: Segments, seq: int) -> int:
    d = rt.prepare(dst, seq, seq == 1, segments=seg)
    got = Background(rt.wait)
    st.connect(src, seq, d, segments=seg)
    sent = st.send(src)
    assert got.result(60) == sent == seg.total_bytes
    return d["setup"]


def test_split_cuts_runs_into_equal_parts_in_wire_order() -> None:
    seg = layout(1)
    parts = seg.split(4)
    assert 1 < len(parts) <= 4
    flat = [r for p in parts for r in p.runs()]
    assert flat == list(seg.runs())
    sizes = [p.total_bytes for p in parts]
    assert sum(sizes) == seg.total_bytes and max(sizes) - min(sizes) <= 2 * int(seg.nbytes.max())


def test_segments_past_a_region_are_refused() -> None:
    seg = Segments.of([0], [DST - 10], [20])
    with pytest.raises(ProtocolError, match="reach past"):
        seg.check_within(SRC, DST)


@pytest.mark.parametrize("streams", [1, 3])
def test_tcp_moves_exactly_the_segments_and_reuses_its_streams(streams: int) -> None:
    seg = layout(2)
    c = ctx(streams)
    with region(SRC, seed=1) as src, region(DST, seed=2) as dst, tcp.TcpReceiver(c) as rt, tcp.TcpSender(c) as st:
        before = payload(dst)
        assert hop(rt, st, src, dst, seg, 1) is True
        assert np.array_equal(payload(dst), expected(payload(src), before, seg))
        with memoryview(src.region) as mv:
            mv[:SRC] = bytes(SRC)                  # the next step: new values, the same runs
        assert hop(rt, st, src, dst, seg, 2) is False, "a warm update must reuse the streams"
        assert np.array_equal(payload(dst), expected(payload(src), before, seg))
        assert rt.counters.connects == 1 and st.counters.connects == 1


def test_ipc_copies_exactly_the_segments_out_of_the_senders_memory() -> None:
    seg = layout(3)
    c = ctx()
    with region(SRC, seed=3) as src, region(DST, seed=4) as dst, ipc.IpcReceiver(c) as rt, ipc.IpcSender(c) as st:
        before = payload(dst)
        assert hop(rt, st, src, dst, seg, 1) is True
        assert np.array_equal(payload(dst), expected(payload(src), before, seg))
        with memoryview(src.region) as mv:
            mv[:SRC] = bytes([7]) * SRC
        assert hop(rt, st, src, dst, seg, 2) is False
        assert np.array_equal(payload(dst), expected(payload(src), before, seg))
        assert rt.counters.registrations == 1, "the sender's handles are mapped once"


@pytest.mark.rdma
def test_rdma_writes_exactly_the_segments_each_to_its_place() -> None:
    from tensorxfer.transport.rdma import rdma_available
    from tensorxfer.transport.rdma_engine import RdmaReceiver, RdmaSender

    ok, reason = rdma_available()
    if not ok:
        pytest.skip(f"no usable RDMA device: {reason}")
    seg = layout(4)
    c = ctx(2)
    with region(SRC, seed=5) as src, region(DST, seed=6) as dst, RdmaReceiver(c) as rt, RdmaSender(c) as st:
        before = payload(dst)
        assert hop(rt, st, src, dst, seg, 1) is True
        assert np.array_equal(payload(dst), expected(payload(src), before, seg))
        with memoryview(src.region) as mv:
            mv[:SRC] = bytes([9]) * SRC
        assert hop(rt, st, src, dst, seg, 2) is False, "a warm update must reuse the MR and the QPs"
        assert np.array_equal(payload(dst), expected(payload(src), before, seg))
        assert rt.counters.registrations == 1 and st.counters.registrations == 1
