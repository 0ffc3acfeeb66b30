"""The control protocol's frame reader and handshake, against hostile bytes on real sockets."""

from __future__ import annotations

import socket
import struct

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tensorxfer as tx
from tensorxfer import protocol as P
from tests.helpers import Background


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    ca, cb = P.Channel(a), P.Channel(b)
    yield ca, cb
    ca.close()
    cb.close()


def raw(ch: P.Channel, data: bytes) -> None:
    ch.sock.sendall(data)


def frame(obj: object) -> bytes:
    body = msgpack.packb(obj, use_bin_type=True)
    return struct.pack(">I", len(body)) + body


def test_frame_roundtrip(pair):
    a, b = pair
    a.send("offer", seq=1, manifest=b"\x00\x01", verify=False)
    got = b.recv("offer", timeout=2)
    assert got == {"type": "offer", "seq": 1, "manifest": b"\x00\x01", "verify": False}


def test_oversized_frame_is_refused_before_reading_it(pair):
    a, b = pair
    raw(a, struct.pack(">I", P.PREAUTH_MAX_FRAME + 1))
    with pytest.raises(tx.ProtocolError, match="limit"):
        b.recv("hello", timeout=2)


def test_limit_rises_only_after_authentication(pair):
    a, b = pair
    a.send("offer", manifest=b"x" * (P.PREAUTH_MAX_FRAME + 10))
    with pytest.raises(tx.ProtocolError, match="limit"):
        b.recv("offer", timeout=2)


def test_frame_after_auth_can_be_large():
    x, y = socket.socketpair()
    with P.Channel(x) as a, P.Channel(y) as b:
        b.authenticated()
        job = Background(a.send, "offer", manifest=b"x" * (1 << 20))
        assert len(b.recv("offer", timeout=2)["manifest"]) == 1 << 20
        job.result()


def test_empty_frame(pair):
    a, b = pair
    raw(a, struct.pack(">I", 0))
    with pytest.raises(tx.ProtocolError, match="empty"):
        b.recv("hello", timeout=2)


def test_truncated_frame_is_peer_lost(pair):
    a, b = pair
    raw(a, struct.pack(">I", 100) + b"\x81")
    a.sock.shutdown(socket.SHUT_WR)
    with pytest.raises(tx.PeerLost, match="mid-frame"):
        b.recv("hello", timeout=2)


def test_short_header_is_peer_lost(pair):
    a, b = pair
    raw(a, b"\x00\x00")
    a.sock.shutdown(socket.SHUT_WR)
    with pytest.raises(tx.PeerLost, match="mid-frame"):
        b.recv("hello", timeout=2)


def test_silence_is_a_timeout(pair):
    _, b = pair
    with pytest.raises(tx.TransferTimeout):
        b.recv("hello", timeout=0.1)


@pytest.mark.parametrize("obj", [[1, 2], {"type": 5}, {"no": "type"}, {"type": "pickle"}, "hello"])
def test_malformed_frames(pair, obj):
    a, b = pair
    raw(a, frame(obj))
    with pytest.raises(tx.ProtocolError):
        b.recv("hello", timeout=2)


def test_not_msgpack(pair):
    a, b = pair
    raw(a, struct.pack(">I", 3) + b"\xc1\xc1\xc1")
    with pytest.raises(tx.ProtocolError, match="msgpack"):
        b.recv("hello", timeout=2)


def test_out_of_order_frame(pair):
    a, b = pair
    a.send("done", seq=1, bytes=0)
    with pytest.raises(tx.ProtocolError, match="expected a offer or bye frame"):
        b.recv("offer", "bye", timeout=2)


def test_peer_error_frames_become_typed_errors(pair):
    a, b = pair
    a.send("error", code="checksum", message="bad", tensor="w")
    with pytest.raises(tx.ChecksumMismatch) as e:
        b.recv("ack", timeout=2)
    assert e.value.tensor == "w"
    a.send("error", code="refused", message="too big")
    with pytest.raises(tx.ManifestError, match="too big"):
        b.recv("ack", timeout=2)


def test_field_types():
    f = {"type": "offer", "seq": True, "n": 3, "b": b"x"}
    with pytest.raises(tx.ProtocolError, match="bool"):
        P.field(f, "seq", int)
    with pytest.raises(tx.ProtocolError, match="lacks"):
        P.field(f, "missing", int)
    with pytest.raises(tx.ProtocolError, match="type"):
        P.field(f, "b", int)
    assert P.field(f, "n", int) == 3 and P.field(f, "missing", int, optional=True) is None


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_fuzzed_bodies_only_raise_protocol_error(body):
    try:
        P.decode_frame(body)
    except tx.ProtocolError:
        pass


def handshake_pair(key_a, key_b, version_b=P.PROTOCOL_VERSION):
    x, y = socket.socketpair()
    a, b = P.Channel(x), P.Channel(y)
    if version_b != P.PROTOCOL_VERSION:     # a receiver from the future, speaking raw frames
        server = Background(lambda: (b.recv("hello", timeout=2),
                                     b.send("hello", version=version_b, role="receiver", auth=False,
                                            nonce=P.nonce(), capabilities={})))
    else:
        server = Background(P.server_handshake, b, key_b, {"transports": ["tcp"]}, 2)
    return a, b, server


def test_handshake_with_matching_tokens_derives_the_same_session_key():
    a, b, server = handshake_pair(P.token_key("t"), P.token_key("t"))
    try:
        hello, key_a = P.client_handshake(a, P.token_key("t"), {}, 2)
        _, key_b = server.result()
        assert key_a == key_b and hello["capabilities"] == {"transports": ["tcp"]}
    finally:
        a.close()
        b.close()


def test_handshake_wrong_token():
    a, b, server = handshake_pair(P.token_key("x"), P.token_key("y"))
    try:
        with pytest.raises(tx.AuthError):
            P.client_handshake(a, P.token_key("x"), {}, 2)
        with pytest.raises(tx.AuthError, match="wrong token"):
            server.result()
    finally:
        a.close()
        b.close()


def test_version_mismatch_names_both_versions():
    a, b, server = handshake_pair(None, None, version_b=99)
    try:
        with pytest.raises(tx.ProtocolError, match=rf"version {P.PROTOCOL_VERSION}.*version 99"):
            P.client_handshake(a, None, {}, 2)
        server.result()
    finally:
        a.close()
        b.close()


def test_receiver_reports_version_mismatch_to_an_old_sender():
    x, y = socket.socketpair()
    a, b = P.Channel(x), P.Channel(y)
    try:
        server = Background(P.server_handshake, b, None, {}, 2)
        a.send("hello", version=0, role="sender", auth=False, nonce=P.nonce(), capabilities={})
        with pytest.raises(tx.ProtocolError, match="version 0"):
            a.recv("hello", timeout=2)
        with pytest.raises(tx.ProtocolError, match="version mismatch"):
            server.result()
    finally:
        a.close()
        b.close()


def test_mac_is_unambiguous():
    assert P.mac(b"k", b"ab", b"c") != P.mac(b"k", b"a", b"bc")


@pytest.mark.parametrize("text,expected", [("1.2.3.4:5", ("1.2.3.4", 5)), (":80", ("127.0.0.1", 80)),
                                           ("[::1]:9", ("::1", 9))])
def test_parse_address(text, expected):
    assert P.parse_address(text) == expected


@pytest.mark.parametrize("text", ["host", "h:x", "h:70000", ""])
def test_parse_address_rejects(text):
    with pytest.raises(ValueError):
        P.parse_address(text)


def test_timeout_mid_frame_marks_the_channel_desynced(pair):
    a, b = pair
    raw(a, struct.pack(">I", 50) + b"\x81")
    with pytest.raises(tx.TransferTimeout):
        b.recv("offer", timeout=0.2)
    assert b.desynced


def test_timeout_between_frames_keeps_the_channel_usable(pair):
    a, b = pair
    with pytest.raises(tx.TransferTimeout):
        b.recv("offer", timeout=0.1)
    assert not b.desynced
    a.send("offer", seq=1)
    assert b.recv("offer", timeout=2)["seq"] == 1


# ------------------------------------------------------------------ resource limits on decoding
def count_objects(obj: object) -> int:
    if isinstance(obj, dict):
        return 1 + sum(count_objects(k) + count_objects(v) for k, v in obj.items())
    if isinstance(obj, list):
        return 1 + sum(count_objects(x) for x in obj)
    return 1


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64 - 1) | st.floats(width=32)
    | st.text(max_size=40) | st.binary(max_size=300),
    lambda kids: st.lists(kids, max_size=6) | st.dictionaries(st.text(max_size=8), kids, max_size=6),
    max_leaves=40,
)


@settings(max_examples=300, deadline=None)
@given(msgpack_values, st.booleans())
@pytest.mark.slow
def test_scan_counts_every_object_msgpack_decodes(obj, single_float):
    body = msgpack.packb(obj, use_bin_type=True, use_single_float=single_float)
    assert P.scan_msgpack(body, 1 << 20, 64) == count_objects(obj)


@settings(max_examples=300, deadline=None)
@given(msgpack_values)
@pytest.mark.slow
def test_scan_refuses_every_truncation(obj):
    body = msgpack.packb(obj, use_bin_type=True)
    for cut in range(len(body)):
        with pytest.raises(tx.ProtocolError):
            P.scan_msgpack(body[:cut], 1 << 20, 64)


def test_scan_bounds_objects_depth_and_lying_headers():
    with pytest.raises(tx.ProtocolError, match="more than 10 msgpack objects"):
        P.scan_msgpack(msgpack.packb([{}] * 10), 10, 4)
    assert P.scan_msgpack(msgpack.packb([{}] * 9), 10, 4) == 10
    nested: object = []
    for _ in range(4):
        nested = [nested]
    assert P.scan_msgpack(msgpack.packb(nested), 100, 5) == 5
    with pytest.raises(tx.ProtocolError, match="deeper than 4"):
        P.scan_msgpack(msgpack.packb(nested), 100, 4)
    with pytest.raises(tx.ProtocolError, match="truncated"):   # claims 2**32-1 elements, has 3 bytes
        P.scan_msgpack(b"\xdd\xff\xff\xff\xff\x80\x80\x80", 1 << 40, 4)
    with pytest.raises(tx.ProtocolError, match="truncated"):   # a bin claiming 4 GiB
        P.scan_msgpack(b"\xc6\xff\xff\xff\xff" + b"x" * 10, 100, 4)
    with pytest.raises(tx.ProtocolError, match="reserved"):
        P.scan_msgpack(b"\xc1", 100, 4)
    with pytest.raises(tx.ProtocolError, match="after"):
        P.scan_msgpack(b"\x80\x80", 100, 4)


def empty_maps_offer(size: int) -> bytes:
    """An ``offer`` frame body of ``size`` bytes that is mostly empty msgpack maps (one byte each)."""
    head = b"\x82" + msgpack.packb("type") + msgpack.packb("offer") + msgpack.packb("pad") + b"\xdd"
    n = size - len(head) - 4
    return head + struct.pack(">I", n) + b"\x80" * n


def test_frame_of_many_small_objects_is_refused(pair):
    a, b = pair
    b.authenticated()
    body = empty_maps_offer(1 << 16)
    job = Background(raw, a, struct.pack(">I", len(body)) + body)
    with pytest.raises(tx.ProtocolError, match=f"more than {P.MAX_FRAME_OBJECTS} msgpack objects"):
        b.recv("offer", timeout=5)
    job.result()


def test_deeply_nested_frame_is_refused(pair):
    a, b = pair
    body = b"\x82" + msgpack.packb("type") + msgpack.packb("offer") + msgpack.packb("x") + b"\x91" * 50 + b"\xc0"
    raw(a, struct.pack(">I", len(body)) + body)
    with pytest.raises(tx.ProtocolError, match="deeper than"):
        b.recv("offer", timeout=2)


RECEIVER_PEAK = """
import resource, sys
import tensorxfer as tx
with tx.Receiver("127.0.0.1:0") as rx:
    print(rx.address[1], flush=True)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        rx.receive(timeout=60)
        print("RECEIVED")
    except tx.TensorXferError as e:
        print(type(e).__name__, str(e).replace("\\n", " "))
    grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    print("GREW_KIB", grew, flush=True)
"""


def test_receiver_survives_a_16_mib_frame_of_empty_maps_in_little_memory():
    """After a token-less handshake, one 16 MiB offer of empty maps (16 million objects) used to
    drive the receiver's RSS from 45 MiB to 1.2 GiB.  Now it is refused after the frame is read:
    the peak grows by the frame's own buffers (2 x 16 MiB) and no more."""
    from tests.helpers import child, finish

    size = 16 << 20
    proc = child(RECEIVER_PEAK)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        with P.Channel(socket.create_connection(("127.0.0.1", port), timeout=10)) as ch:
            P.client_handshake(ch, None, {"transports": ["tcp"]}, 10)
            body = empty_maps_offer(size)
            ch.sock.settimeout(30)
            ch.sock.sendall(struct.pack(">I", len(body)) + body)
            rc, out, err = finish(proc, timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            finish(proc)
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("ProtocolError") and "msgpack objects" in lines[0], out + err
    grew_kib = int(lines[-1].split()[1])
    assert grew_kib * 1024 < 3 * size, f"receiver peak RSS grew by {grew_kib} KiB for a {size >> 20} MiB frame"
