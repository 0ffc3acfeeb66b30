"""The RDMA transport's behaviour where it cannot run, and its input validation (no device needed)."""

from __future__ import annotations

import os
from typing import Any

import pytest

from tensorxfer import HostRegion
from tensorxfer.errors import ProtocolError, TransportUnavailable
from tensorxfer.transport import rdma
from tensorxfer.transport.rdma import RdmaReceiverEndpoint, RdmaSenderEndpoint, rdma_available


def good(role: str = "receiver") -> dict[str, Any]:
    d = {"transport": "rdma", "version": 1, "role": role, "qps": [{"qp_num": 17, "psn": 5}], "lid": 0,
         "gid": bytes(16), "mtu": 1024, "link_layer": "Ethernet"}
    if role == "receiver":
        d.update(addr=0x7F0000000000, rkey=0x1234, length=1 << 20)
    return d


def test_rdma_available_gives_a_reason() -> None:
    ok, reason = rdma_available()
    assert isinstance(ok, bool) and reason
    if rdma.rdma_available(device="no-such-device")[0]:
        pytest.fail("a device that does not exist cannot be available")
    why = rdma_available(device="no-such-device")[1]
    if rdma._verbs is None:     # a bare machine: the reason is the missing module, named as such
        assert "No module named 'tensorxfer.transport._verbs'" in why and "libibverbs-dev" in why
    elif rdma._verbs.library_error() is not None:     # a wheel on a machine without rdma-core
        assert why == rdma._verbs.library_error() and "apt-get install libibverbs1" in why
    else:
        assert "no-such-device" in why or "no RDMA devices" in why


def test_endpoints_raise_transport_unavailable_without_a_device() -> None:
    ok, _ = rdma_available()
    if ok:
        pytest.skip("an RDMA device is present (covered by tests/test_rdma.py)")
    reason = ("the RDMA transport is not built: No module named" if rdma._verbs is None
              else "libibverbs could not be loaded" if rdma._verbs.library_error() is not None
              else "no RDMA devices")
    with HostRegion.allocate(4096) as r:
        with pytest.raises(TransportUnavailable, match=reason):
            RdmaSenderEndpoint(r)
        with pytest.raises(TransportUnavailable, match=reason):
            RdmaReceiverEndpoint(r)


@pytest.mark.parametrize(("mutate", "match"), [
    (lambda d: d.update(transport="tcp"), "not RDMA"),
    (lambda d: d.update(version=99), "not RDMA"),
    (lambda d: d.pop("gid"), "gid"),
    (lambda d: d.update(gid=b"x" * 15), "16 bytes"),
    (lambda d: d.update(qps=[{"qp_num": "1", "psn": 0}]), "qp_num"),
    (lambda d: d.update(qps="nope"), "qps"),
    (lambda d: d.update(mtu=None), "mtu"),
    (lambda d: d.update(role="sender"), "expected receiver"),
    # ranges: a value a verbs call would take as uint32/uint16/enum must be refused as a ProtocolError, not
    # surface as OverflowError or ValueError from deep inside the connect or the first write
    (lambda d: d.update(qps=[{"qp_num": 1 << 32, "psn": 0}]), "qp_num"),
    (lambda d: d.update(qps=[{"qp_num": True, "psn": 0}]), "qp_num"),
    (lambda d: d.update(qps=[{"qp_num": 17, "psn": -1}]), "psn"),
    (lambda d: d.update(qps=[{"qp_num": 17, "psn": 1 << 24}]), "psn"),
    (lambda d: d.update(lid=70000), "lid"),
    (lambda d: d.update(mtu=5), "mtu"),
    (lambda d: d.update(rkey=1 << 32), "rkey"),
    (lambda d: d.update(addr=-1), "addr"),
    (lambda d: d.pop("length"), "length"),
    (lambda d: d.update(addr=(1 << 64) - 4096, length=1 << 20), "past the end"),
])
def test_descriptor_validation(mutate: Any, match: str) -> None:
    d = good()
    rdma._check_peer(d, "receiver")
    mutate(d)
    with pytest.raises(ProtocolError, match=match):
        rdma._check_peer(d, "receiver")
    with pytest.raises(ProtocolError):
        rdma._check_peer([1, 2], "receiver")


def test_default_post_batch() -> None:
    assert rdma.default_post_batch(1 << 20) == 1
    assert rdma.default_post_batch(4096) == 32


def test_forced_rdma_on_a_host_without_a_device_names_the_reason() -> None:
    from tensorxfer import Sender
    from tensorxfer.transport import local_transports

    ok, reason = rdma_available()
    if ok:
        pytest.skip("an RDMA device is present (covered by tests/test_rdma_engine.py)")
    assert "rdma" not in local_transports()
    with pytest.raises(TransportUnavailable, match="transport 'rdma' was requested but cannot run") as info:
        Sender("127.0.0.1:1", transport="rdma")
    assert reason in str(info.value)


@pytest.mark.parametrize(("mutate", "match"), [
    (lambda d: d.pop("side_port"), "side_port"),
    (lambda d: d.update(side_port=70000), "out of range"),
    (lambda d: d.update(nonce=b"short"), "out of range"),
    (lambda d: d.update(qps=[]), "out of range"),
    (lambda d: d.update(role="sender"), "expected receiver"),
])
def test_rdma_sender_transport_rejects_malformed_accept_descriptors(mutate: Any, match: str) -> None:
    from tensorxfer.transport.base import TransferContext
    from tensorxfer.transport.rdma_engine import RdmaSender

    d = {**good(), "setup": True, "side_port": 4000, "nonce": bytes(32), "streams": 1}
    mutate(d)
    c = TransferContext(local_host="127.0.0.1", peer_host="127.0.0.1", session_key=bytes(32), stall_timeout=1.0)
    with RdmaSender(c) as tx, pytest.raises(ProtocolError, match=match):
        tx.connect(None, 1, d)  # type: ignore[arg-type]   # refused before the region is looked at


UNLOADABLE = "/nonexistent/libibverbs.so.1"


def test_verbs_module_imports_without_libibverbs() -> None:
    """The verbs module does not link libibverbs (verbs_dl.h loads it when first used): with the library
    unloadable it imports, never maps libibverbs, and every entry point raises a typed error with the fix;
    the rdma transport is unavailable and tcp/ipc are not affected."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import errno
        from tensorxfer.errors import TransportUnavailable, VerbsError
        from tensorxfer.transport import _verbs, local_transports
        from tensorxfer.transport.rdma import RdmaSenderEndpoint, rdma_available
        from tensorxfer import HostRegion
        maps = lambda: open("/proc/self/maps").read()
        assert "libibverbs" not in maps(), "importing the verbs module loaded libibverbs"
        why = _verbs.library_error()
        assert why and "cannot open shared object file" in why and _verbs.LIBRARY_FIX in why, why
        for call in (_verbs.device_names, _verbs.Context.open):
            try:
                call()
            except VerbsError as e:
                assert e.errno == errno.ELIBACC and "apt-get install libibverbs1" in str(e), e
            else:
                raise AssertionError(f"{call} did not raise")
        ok, reason = rdma_available()
        assert not ok and reason == why
        with HostRegion.allocate(4096) as r:
            try:
                RdmaSenderEndpoint(r)
            except TransportUnavailable as e:
                assert "libibverbs could not be loaded" in str(e)
            else:
                raise AssertionError("RdmaSenderEndpoint did not raise")
        assert set(local_transports()) >= {"tcp", "ipc"} and "rdma" not in local_transports()
        assert "libibverbs" not in maps()
        print("ok")
    """)
    env = {**os.environ, "TENSORXFER_LIBIBVERBS": UNLOADABLE}
    if rdma._verbs is None:
        pytest.skip("this build has no verbs module")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_verbs_module_loads_libibverbs_when_present() -> None:
    if rdma._verbs is None:
        pytest.skip("this build has no verbs module")
    if os.environ.get("TENSORXFER_LIBIBVERBS"):
        pytest.skip("TENSORXFER_LIBIBVERBS is set")
    info = rdma._verbs.library_info()
    if not info["loaded"]:
        pytest.skip(f"libibverbs is not installed here: {rdma._verbs.library_error()}")
    assert rdma._verbs.library_error() is None and info["library"] == "libibverbs.so.1"
    assert isinstance(rdma._verbs.device_names(), list)
