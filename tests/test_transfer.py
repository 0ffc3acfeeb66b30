"""Sender/Receiver over real loopback sockets (both ends in this process, in threads)."""

from __future__ import annotations

import errno
import itertools
import logging
import os

import numpy as np
import pytest

import tensorxfer as tx
from tensorxfer import Manifest, Receiver, Sender, TensorRegion
from tensorxfer.transport.tcp import MIN_SLICE_BYTES, SLICE_ALIGN, plan_slices, slices_of
from tests.helpers import Background, FlipProxy, region_of, wait_until


def model(seed: int = 0, n: int = 40, big: int = 300_000) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {f"layer.{i}.weight": rng.standard_normal((big // 400 + i, 100), dtype=np.float32) for i in range(n)}
    out["norm"] = rng.standard_normal(7).astype(np.float16)
    return out


def addr(rx: Receiver) -> str:
    return "{}:{}".format(*rx.address)


def same(a: TensorRegion, b: TensorRegion) -> bool:
    va, vb = a.tensors(), b.tensors()
    ok = list(va) == list(vb) and all(np.array_equal(va[k].view(np.uint8), vb[k].view(np.uint8)) for k in va)
    del va, vb
    return ok


def test_roundtrip_and_repeated_updates_reuse_one_region():
    src = model()
    with TensorRegion.from_tensors(src) as region, Receiver() as rx:
        job = Background(lambda: [rx.receive(timeout=10) for _ in range(3)])
        with Sender(addr(rx), streams=3, transport="tcp") as s:
            stats = [s.send(region)]
            region.update_from(model(seed=1))
            stats.append(s.send(region))
            region.update_from(model(seed=2))
            stats.append(s.send(region, verify=True))
        got = job.result()
        assert got[0] is got[1] is got[2], "same-layout updates must land in the same region"
        assert same(got[2], region)
        assert [st.reallocated for st in stats] == [False, False, False]
        assert stats[2].verified and stats[0].transport == "tcp" and stats[0].bytes == region.nbytes
        assert stats[0].streams == len(plan_slices(region.nbytes, 3)) and stats[0].gbps > 0
        assert rx.last_stats is not None and rx.last_stats.verified
        del got


def test_different_layout_is_reallocated_explicitly():
    with TensorRegion.from_tensors(model()) as a, TensorRegion.from_tensors(model(n=5)) as b, Receiver() as rx:
        job = Background(lambda: [rx.receive(timeout=10) for _ in range(2)])
        with Sender(addr(rx)) as s:
            s.send(a)
            st = s.send(b)
        first, second = job.result()
        assert st.reallocated and rx.last_stats is not None and rx.last_stats.reallocated
        assert first is not second and first.closed and not second.closed
        assert same(second, b)
        del first, second


def test_receiver_serves_senders_one_after_another():
    with region_of(5 << 20, fill=7) as r1, region_of(5 << 20, fill=9) as r2, Receiver() as rx:
        job = Background(lambda: [bytes(memoryview(rx.receive(timeout=10).region)[:16]) for _ in range(2)])
        with Sender(addr(rx)) as s:
            s.send(r1)
        with Sender(addr(rx)) as s:
            s.send(r2)
        assert job.result() == [bytes([7]) * 16, bytes([9]) * 16]


def test_empty_and_tiny_regions():
    with TensorRegion.from_tensors({"x": np.zeros(0, np.float32)}) as empty, \
            TensorRegion.from_tensors({"y": np.arange(3, dtype=np.int64)}) as tiny, Receiver() as rx:
        def two() -> list:
            first = rx.receive(timeout=10).nbytes
            return [first, rx.receive(timeout=10).tensors()["y"].tolist()]
        job = Background(two)
        with Sender(addr(rx), streams=8, transport="tcp") as s:
            assert s.send(empty).streams == 0
            assert s.send(tiny, verify=True).streams == 1
        assert job.result() == [0, [0, 1, 2]]


def test_offer_over_the_limit_is_refused_before_allocating():
    with region_of(8 << 20) as big, Receiver(max_region_bytes=1 << 20) as rx:
        job = Background(rx.receive, timeout=10)
        with Sender(addr(rx)) as s, pytest.raises(tx.OfferRefused, match=r"refused|limit|max") as refused:
            s.send(big)
        assert refused.value.receiver_error == "ManifestError" and "peer reported" not in str(refused.value)
        with pytest.raises(tx.ManifestError):
            job.result()
        assert rx.region is None, "nothing may be allocated for a refused offer"


def test_a_receiver_refusing_an_offer_reaches_the_sender_in_words_with_its_own_type():
    """It reached the sender as ``ManifestError: ... OutputError: [Errno 28] ...``."""
    def disk_full(manifest):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/models/out")

    with region_of(1 << 20) as src, Receiver() as rx:
        job = Background(rx.receive, timeout=10, on_offer=disk_full)
        with Sender(addr(rx)) as s, pytest.raises(tx.OfferRefused) as refused:
            s.send(src)
        e = refused.value
        assert e.reason == "No space left on device: /models/out" and e.receiver_error == "OSError"
        assert str(e) == "the receiver refused the offer: No space left on device: /models/out"
        assert isinstance(e, tx.ManifestError)          # what callers caught before
        with pytest.raises(OSError):
            job.result()
        assert rx.region is None


def test_wrong_token_is_refused_and_no_data_moves():
    # Failed handshakes are strangers to the receiver: dropped and counted, never an error of receive(),
    # which goes on to serve the sender with the right token.
    with region_of(1 << 20) as r, Receiver(token="right") as rx:
        job = Background(rx.receive, timeout=10)
        with pytest.raises(tx.AuthError):
            Sender(addr(rx), token="wrong")
        with pytest.raises(tx.AuthError, match="token mismatch"):
            Sender(addr(rx))
        wait_until(lambda: rx.dropped_connections == 2)
        assert rx.region is None
        with Sender(addr(rx), token="right") as s:
            s.send(r)
        assert job.result() is rx.region and rx.region is not None


def test_token_on_sender_only_is_refused():
    with Receiver() as rx:
        job = Background(rx.receive, timeout=1)
        with pytest.raises(tx.AuthError, match="token"):
            Sender(addr(rx), token="secret")
        with pytest.raises(tx.TransferTimeout, match=r"1 connection.*dropped.*token"):
            job.result()


def test_receive_timeout_without_a_sender():
    with Receiver() as rx, pytest.raises(tx.TransferTimeout):
        rx.receive(timeout=0.2)


def test_forced_transport_that_cannot_run_is_an_error_never_a_fallback():
    with pytest.raises(tx.TransportUnavailable, match="rdma"):
        Sender("127.0.0.1:1", transport="rdma")
    with pytest.raises(ValueError, match="transport must be"):
        Sender("127.0.0.1:1", transport="carrier-pigeon")


def test_auto_logs_its_choice(caplog):
    caplog.set_level(logging.INFO, logger="tensorxfer")
    with Receiver() as rx:
        job = Background(rx.receive, timeout=0.5)
        with Sender(addr(rx)) as s:
            assert s.transport == "ipc"     # same host, same user: the fastest path
        with pytest.raises(tx.TransferTimeout):
            job.result()
    assert any("chose 'ipc'" in r.message for r in caplog.records)


def _gpu_present() -> bool:
    from tensorxfer import memory

    if memory.CudaRegion is None:
        return False
    from tensorxfer.memory import _cuda

    try:
        return _cuda.device_count() > 0
    except tx.CudaError:
        return False


@pytest.mark.skipif(_gpu_present(), reason="a GPU is present: the receiver can allocate on it")
def test_cuda_device_is_refused_clearly():
    with Receiver(device="cuda:0") as rx, region_of(1 << 20) as r:
        job = Background(rx.receive, timeout=10)
        with Sender(addr(rx)) as s, pytest.raises(tx.TransferError, match="cannot allocate"):
            s.send(r)
        with pytest.raises(tx.CudaError):
            job.result()


def test_flipped_byte_is_detected_and_named():
    tensors = {"a": np.zeros(1 << 20, np.uint8), "b": np.ones(1 << 20, np.uint8), "c": np.zeros(10, np.uint8)}
    with TensorRegion.from_tensors(tensors) as r, Receiver() as rx:
        proxy = FlipProxy(rx.address, flip_at=r.manifest["b"].offset + 12345)
        try:
            job = Background(rx.receive, timeout=10)
            with Sender("{}:{}".format(*proxy.address), streams=1, transport="tcp") as s, \
                    pytest.raises(tx.ChecksumMismatch, match="'b'") as sent:
                s.send(r, verify=True)
            assert sent.value.tensor == "b"
            with pytest.raises(tx.ChecksumMismatch) as got:
                job.result()
            assert got.value.tensor == "b"
        finally:
            proxy.close()


def test_stranger_on_the_data_port_cannot_inject_bytes():
    with region_of(6 << 20, fill=3) as r, Receiver() as rx:
        proxy = FlipProxy(rx.address, flip_at=None, inject=True)
        try:
            job = Background(rx.receive, timeout=10)
            with Sender("{}:{}".format(*proxy.address), streams=1, transport="tcp") as s:
                s.send(r, verify=True)
            got = job.result()
            assert proxy.injected and bytes(memoryview(got.region)[:r.nbytes]) == bytes([3]) * r.nbytes
            del got
        finally:
            proxy.close()


def test_sender_after_close_and_idempotent_close():
    with region_of(1 << 20) as r, Receiver() as rx:
        job = Background(rx.receive, timeout=1)
        s = Sender(addr(rx))
        s.close()
        s.close()
        with pytest.raises(tx.TransferError, match="closed"):
            s.send(r)
        with pytest.raises(tx.TransferTimeout):
            job.result()
        rx.close()
        rx.close()
        assert rx.closed


@pytest.mark.parametrize("nbytes", [0, 1, MIN_SLICE_BYTES - 1, MIN_SLICE_BYTES * 3 + 17, 31_200_000_000])
@pytest.mark.parametrize("streams", [1, 2, 4, 7, 64])
def test_plan_slices_tile_the_region(nbytes, streams):
    slices = plan_slices(nbytes, streams)
    assert len(slices) <= streams
    assert sum(n for _, n in slices) == nbytes
    assert all(off % SLICE_ALIGN == 0 and n > 0 for off, n in slices)
    assert all(a + n == b for (a, n), (b, _) in itertools.pairwise(slices))
    if slices:
        assert slices_of(nbytes, slices[0][1]) == slices


def test_offer_with_hostile_manifest_is_refused():
    bad = Manifest.layout([("x", "U8", (10,))])
    with TensorRegion.from_manifest(bad) as r, Receiver(max_region_bytes=5) as rx:
        job = Background(rx.receive, timeout=10)
        with Sender(addr(rx)) as s, pytest.raises(tx.ManifestError):
            s.send(r)
        with pytest.raises(tx.ManifestError):
            job.result()


def test_idle_session_timeout_keeps_the_session():
    with region_of(1 << 20, fill=5) as r, Receiver() as rx:
        connecting = Background(Sender, addr(rx))
        with pytest.raises(tx.TransferTimeout, match="no offer"):
            rx.receive(timeout=1.0)    # the handshake happens here, then the sender stays idle
        with connecting.result() as s:
            job = Background(rx.receive, timeout=10)
            s.send(r)
            assert bytes(memoryview(job.result().region)[:4]) == b"\x05" * 4


def raw_session(rx: Receiver):
    """A hand-driven sender: a real socket that completes the handshake and then misbehaves."""
    import socket

    from tensorxfer import protocol as P
    ch = P.Channel(socket.create_connection(rx.address))
    P.client_handshake(ch, None, {"transports": ["tcp"]}, 5)
    return ch


@pytest.mark.parametrize("misbehaviour", ["seq", "garbage", "done-first", "no-manifest"])
def test_misbehaving_sender_is_a_protocol_error_and_nothing_is_allocated(misbehaviour):
    import struct
    with Receiver() as rx:
        job = Background(rx.receive, timeout=10)
        ch = raw_session(rx)
        try:
            m = Manifest.layout([("x", "U8", (10,))]).pack()
            if misbehaviour == "seq":
                ch.send("offer", seq=5, manifest=m, transport="tcp", streams=1, verify=False)
            elif misbehaviour == "garbage":
                ch.sock.sendall(struct.pack(">I", 5) + b"\xc1" * 5)
            elif misbehaviour == "done-first":
                ch.send("done", seq=1, bytes=10)
            else:
                ch.send("offer", seq=1, transport="tcp", verify=False)
            with pytest.raises(tx.ProtocolError):
                job.result()
            assert rx.region is None
        finally:
            ch.close()


def test_ipv6_loopback():
    import socket
    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")
    try:
        rx = Receiver("[::1]:0")
    except OSError as e:
        pytest.skip(f"cannot bind ::1: {e}")
    with rx, region_of(9 << 20, fill=1) as r:
        job = Background(rx.receive, timeout=10)
        with Sender(f"[::1]:{rx.address[1]}", transport="tcp") as s:
            assert s.send(r, verify=True).streams == 3
        job.result()


def test_on_offer_and_progress_see_the_whole_transfer():
    seen: list = []
    moved: list[int] = []
    with region_of(9 << 20, fill=2) as r, Receiver() as rx:
        job = Background(rx.receive, timeout=10, progress=moved.append, on_offer=seen.append)
        sent: list[int] = []
        with Sender(addr(rx)) as s:
            s.send(r, progress=sent.append)
        job.result()
    assert [m.nbytes for m in seen] == [r.nbytes]
    assert sum(moved) == sum(sent) == r.nbytes


def test_on_landed_runs_before_the_ack_and_its_failure_reaches_the_sender():
    seen: list[int] = []

    def landed(region: TensorRegion) -> None:
        seen.append(region.nbytes)
        if len(seen) == 2:
            raise OSError(28, "No space left on device")

    with Receiver() as rx, region_of(1 << 20, fill=7) as src:
        addr = "{}:{}".format(*rx.address)
        got = Background(rx.receive, timeout=10, on_landed=landed)
        with Sender(addr, transport="tcp") as tx_:
            tx_.send(src)
            assert got.result() is rx.region and seen == [1 << 20]
            failed = Background(rx.receive, timeout=10, on_landed=landed)
            with pytest.raises(tx.TransferError, match="No space left on device"):
                tx_.send(src)
        with pytest.raises(OSError, match="No space left"):
            failed.result()


def test_a_host_name_that_does_not_resolve_is_said_in_words():
    """It read ``[Errno -2] Name or service not known`` (the CLI: ``gaierror``)."""
    with region_of(1 << 10) as src, pytest.raises(tx.PeerLost) as lost, Sender("no-such-host.invalid:5000") as s:
        s.send(src)
    message = str(lost.value)
    assert "'no-such-host.invalid' does not resolve" in message and "check the address" in message
    assert "Errno" not in message and "gaierror" not in message
