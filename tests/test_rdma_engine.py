"""The ``rdma`` transport through the engine (Sender/Receiver), on a real verbs device (Soft-RoCE in CI).

Both ends live in this process (the receiver in a thread); the control
connection is loopback TCP, the data moves by RDMA WRITE over the device.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

from tensorxfer import Manifest, Receiver, Sender, TensorRegion
from tensorxfer.transport.rdma import rdma_available
from tests.helpers import Background

OK, REASON = rdma_available()
pytestmark = [pytest.mark.rdma, pytest.mark.skipif(not OK, reason=f"no usable RDMA device: {REASON}")]

KIB = 1 << 10


def addr(rx: Receiver) -> str:
    return "{}:{}".format(*rx.address)


def manifest() -> Manifest:
    # odd sizes so tensors (and RDMA requests) straddle the sender's 64 KiB chunks
    return Manifest.layout([(f"t{i}", "U8", (100_003 + 7919 * i,)) for i in range(20)] + [("tail", "U8", (5,))])


def fill(region: TensorRegion, seed: int) -> bytes:
    mv = memoryview(region.region).cast("B")
    data = np.random.default_rng(seed).integers(0, 256, region.nbytes, dtype=np.uint8).tobytes()
    mv[:region.nbytes] = data
    mv.release()
    return data


def payload(region: TensorRegion) -> bytes:
    mv = memoryview(region.region).cast("B")
    try:
        return bytes(mv[:region.nbytes])
    finally:
        mv.release()


def test_forced_rdma_moves_a_multi_chunk_region_byte_exact_three_times() -> None:
    with TensorRegion.from_manifest(manifest(), chunk_size=64 * KIB) as src, Receiver() as rx:
        assert len(src.region.resolve_extent(0, src.nbytes).segments) > 10
        job = Background(lambda: [payload(rx.receive(timeout=60)) for _ in range(3)])
        sent = []
        with Sender(addr(rx), transport="rdma", streams=3, stall_timeout=60) as s:
            for seed, verify in ((1, False), (2, True), (3, True)):
                sent.append(fill(src, seed))
                st = s.send(src, verify=verify)
                assert st.transport == "rdma" and st.bytes == src.nbytes and st.verified == verify
                assert st.streams == 3 and not st.reallocated
        got = job.result(timeout=120)
        assert got == sent
        assert rx.last_stats is not None and rx.last_stats.verified


def test_auto_picks_rdma_when_ipc_is_disabled(monkeypatch: pytest.MonkeyPatch,
                                              caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("TENSORXFER_DISABLE_IPC", "1")
    caplog.set_level(logging.INFO, logger="tensorxfer")
    with TensorRegion.from_manifest(manifest(), chunk_size=64 * KIB) as src, Receiver() as rx:
        data = fill(src, 7)
        job = Background(lambda: payload(rx.receive(timeout=60)))
        with Sender(addr(rx), stall_timeout=60) as s:
            assert s.transport == "rdma"
            assert s.send(src, verify=True).transport == "rdma"
        assert job.result(timeout=120) == data
    assert any("chose 'rdma'" in r.message for r in caplog.records)
