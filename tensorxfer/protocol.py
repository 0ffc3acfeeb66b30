"""The control protocol: length-prefixed msgpack frames over one TCP connection.

``docs/protocol.md`` is the full specification; this module implements it.

A frame is a 4-byte big-endian unsigned length ``N`` followed by ``N`` bytes
of msgpack encoding one map whose ``"type"`` key names the frame.  Frames are
read with a bounds-checked reader: the length is checked against a limit
before anything is allocated (64 KiB until the peer is authenticated, then
``max_frame`` — a manifest of a million tensors fits, as one ``bin``), and
the body is pre-scanned before msgpack decodes it: at most
:data:`MAX_FRAME_OBJECTS` objects nested at most :data:`MAX_FRAME_DEPTH`
deep (:func:`scan_msgpack`).  msgpack's own per-container limits bound only
each container, not their number: a 16 MiB frame of empty maps decoded into
16 million dicts (1.2 GiB), so without the scan a frame could make the
receiver allocate ~80 times its own size.  Every field a caller reads goes
through :func:`field`, which checks its type.  Never pickle.

Connections are owned by :class:`Channel`; ``close()`` is idempotent.
Errors map onto the exception tree: EOF or a reset is :class:`PeerLost`, a
socket timeout is :class:`TransferTimeout`, anything malformed, oversized,
truncated or unexpected is :class:`ProtocolError`, and an ``error`` frame
from the peer is raised as the error it names (:func:`raise_peer_error`).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import msgpack

from tensorxfer.errors import (
    AuthError,
    ChecksumMismatch,
    OfferRefused,
    PeerLost,
    ProtocolError,
    QuantizationError,
    TransferError,
    TransferTimeout,
    TransportUnavailable,
)

PROTOCOL_VERSION = 2       # 2: session-scoped transports (offer.fresh, accept descriptors.setup)
HEADER = struct.Struct(">I")
PREAUTH_MAX_FRAME = 64 << 10          # hello/auth frames are tiny; a stranger cannot make us allocate more
DEFAULT_MAX_FRAME = (256 << 20) + (1 << 20)   # the largest manifest Manifest.unpack accepts, plus room
NONCE_BYTES = 32
AUTH_CONTEXT = b"tensorxfer-auth-v1"
#: Control frames are a few dozen objects (the largest: an rdma accept, ~10 per QP); a manifest
#: travels as one bin.  4096 objects cost at most ~0.5 MiB of Python objects, whatever the frame size.
MAX_FRAME_OBJECTS = 4096
MAX_FRAME_DEPTH = 16
FRAME_TYPES = frozenset(("hello", "auth", "offer", "accept", "done", "wait", "ack", "error", "bye", "resume",
                         "held", "skip"))

T = TypeVar("T")


def field(frame: Mapping[str, Any], name: str, kind: type[T] | tuple[type, ...], optional: bool = False) -> T:
    """``frame[name]`` checked to be an instance of ``kind``.

    Raises
    ------
    ProtocolError
        The field is missing (and not ``optional``) or has another type.
    """
    if name not in frame:
        if optional:
            return None  # type: ignore[return-value]
        raise ProtocolError(f"{frame.get('type', '?')} frame lacks the {name!r} field")
    value = frame[name]
    if value is None and optional:
        return None  # type: ignore[return-value]
    # bool is an int subclass; a count or size field must not accept True.
    if isinstance(value, bool) and kind is int:
        raise ProtocolError(f"{frame.get('type')} frame: field {name!r} must be an integer, got a bool")
    if not isinstance(value, kind):
        raise ProtocolError(f"{frame.get('type')} frame: field {name!r} has type {type(value).__name__}")
    return value  # type: ignore[return-value]


def int_in(value: Any, low: int, end: int) -> bool:
    """``value`` is an int (not a bool: it subclasses int) with ``low <= value < end``."""
    return isinstance(value, int) and not isinstance(value, bool) and low <= value < end


def nonce() -> bytes:
    """A fresh random nonce (challenges, stream proofs)."""
    return os.urandom(NONCE_BYTES)


def mac(key: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 over the length-prefixed ``parts`` (prefixes keep concatenations unambiguous)."""
    h = hmac.new(key, AUTH_CONTEXT, hashlib.sha256)
    for p in parts:
        h.update(HEADER.pack(len(p)))
        h.update(p)
    return h.digest()


def token_key(token: str | bytes | None) -> bytes | None:
    """The HMAC key for a shared token (``None`` when there is no token)."""
    if token is None:
        return None
    raw = token.encode() if isinstance(token, str) else bytes(token)
    if not raw:
        raise ValueError("the token must not be empty (pass None for no authentication)")
    return hashlib.sha256(b"tensorxfer-token" + raw).digest()


_ERROR_TYPES: dict[str, type[Exception]] = {
    "auth": AuthError,
    "version": ProtocolError,
    "protocol": ProtocolError,
    "refused": OfferRefused,
    "transport": TransportUnavailable,
    "checksum": ChecksumMismatch,
    "transfer": TransferError,
    "landed": TransferError,       # the receiver's on_landed (e.g. writing the files) failed
    "quantization": QuantizationError,     # a sync source's weights cannot be quantized (a NaN, named)
}


def raise_peer_error(frame: Mapping[str, Any]) -> None:
    """Raise the exception an ``error`` frame names (``code``, ``message``, optional ``tensor``)."""
    code = field(frame, "code", str)
    message = f"peer reported: {field(frame, 'message', str)}"
    cls = _ERROR_TYPES.get(code, TransferError)
    if cls is ChecksumMismatch or cls is QuantizationError:
        raise cls(message, field(frame, "tensor", str, optional=True))
    if cls is OfferRefused:
        reason = field(frame, "message", str)
        raise OfferRefused(f"the receiver refused the offer: {reason}", reason,
                           field(frame, "error_type", str, optional=True))
    raise cls(message)


class Channel:
    """One control connection: sends and receives frames, owns the socket.

    Parameters
    ----------
    sock : socket.socket
        A connected TCP socket; the channel takes ownership (``close()``
        closes it).
    max_frame : int
        The frame size limit once authenticated (see :meth:`authenticated`).
    send_timeout : float
        Seconds a frame may take to leave (a peer that stops reading the
        control connection cannot block us forever).
    """

    def __init__(self, sock: socket.socket, max_frame: int = DEFAULT_MAX_FRAME, send_timeout: float = 30.0) -> None:
        self._sock: socket.socket | None = sock
        self.send_timeout = send_timeout
        self.desynced = False       # a read timed out mid-frame: no later frame boundary can be trusted
        self._deadline: float | None = None     # of the frame being read (see recv)
        self._timeout: float | None = None
        self._limit = PREAUTH_MAX_FRAME
        self._max_frame = max_frame
        self.frames_received = 0
        #: what the other end should be ("receiver" / "sender", set by the handshakes): names it when
        #: its very first answer is not a tensorxfer frame (an HTTP server, an SSH daemon, ...).
        self.peer_role: str | None = None
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            # Control frames are small and latency-bound: never wait for Nagle.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.peer = _peername(sock)

    @property
    def closed(self) -> bool:
        return self._sock is None

    @property
    def sock(self) -> socket.socket:
        if self._sock is None:
            raise ProtocolError("the control channel is closed")
        return self._sock

    def authenticated(self) -> None:
        """Raise the frame limit from the pre-authentication 64 KiB to ``max_frame``."""
        self._limit = self._max_frame

    def send(self, type_: str, **fields: Any) -> None:
        """Send one frame.

        Raises
        ------
        PeerLost
            The connection is gone.
        TransferTimeout
            The peer did not read for longer than the socket timeout.
        """
        body = msgpack.packb({"type": type_, **fields}, use_bin_type=True)
        try:
            self.sock.settimeout(self.send_timeout)
            self.sock.sendall(HEADER.pack(len(body)) + body)
        except TimeoutError:
            raise TransferTimeout(f"control channel to {self.peer}: peer stopped reading") from None
        except OSError as e:
            raise PeerLost(f"control channel to {self.peer} lost while sending {type_!r}: {e}") from None

    def send_error(self, code: str, message: str, **extra: Any) -> None:
        """Best-effort ``error`` frame before closing: the peer may already be gone."""
        try:
            self.send("error", code=code, message=message, **extra)
        except (PeerLost, TransferTimeout, ProtocolError):
            pass   # the peer is gone or stuck; the caller raises the real error

    def recv(self, *expected: str, timeout: float | None = None) -> dict[str, Any]:
        """Receive one frame whose type is one of ``expected``.

        An ``error`` frame from the peer is raised as the error it names.

        Raises
        ------
        ProtocolError
            Oversized, truncated, malformed or unexpected frame.
        PeerLost
            The connection closed or reset (including mid-frame).
        TransferTimeout
            Nothing arrived within ``timeout`` seconds.
        """
        if self._sock is None:
            raise ProtocolError("the control channel is closed")
        # ``timeout`` bounds the whole frame, not each recv: a peer trickling one byte at a time
        # cannot stretch one frame past it.
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._timeout = timeout
        head = self._read_exact(HEADER.size, what="frame header")
        (size,) = HEADER.unpack(head)
        if size == 0 or size > self._limit:
            why = (f"frame of {size} bytes from {self.peer}: the limit here is {self._limit} "
                   f"(and frames are never empty)")
            raise self._foreign(head, why) if not self.frames_received else ProtocolError(why)
        body = self._read_exact(size, what=f"frame body of {size} bytes")
        try:
            frame = decode_frame(body)
        except ProtocolError as e:
            if not self.frames_received:
                raise self._foreign(head + body, str(e)) from None
            raise
        self.frames_received += 1
        if frame["type"] == "error" and "error" not in expected:
            raise_peer_error(frame)
        if frame["type"] not in expected:
            raise ProtocolError(f"expected a {' or '.join(expected)} frame from {self.peer}, got {frame['type']!r}")
        return frame

    def _foreign(self, first: bytes, why: str) -> ProtocolError:
        """The error for a peer whose first bytes are not a tensorxfer frame, quoting them."""
        if len(first) < 64:
            try:        # the rest of its greeting, if it sent one (an HTTP status line, an SSH banner)
                self.sock.settimeout(0.2)
                first += self.sock.recv(64 - len(first))
            except OSError:
                pass    # nothing more came: quote what did
        text = first[:64].decode("ascii", "backslashreplace")
        quoted = repr(text + ("..." if len(first) > 64 else ""))
        if self.peer_role is None:
            return ProtocolError(f"the peer at {self.peer} does not speak the tensorxfer protocol "
                                 f"(it sent {quoted}; {why})")
        verb = "answered" if self.peer_role == "receiver" else "sent"
        return ProtocolError(f"the peer at {self.peer} is not a tensorxfer {self.peer_role} (it {verb} {quoted}); "
                             f"check the address and port ({why})")

    def _read_exact(self, n: int, what: str) -> bytes:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        try:
            while got < n:
                deadline = self._deadline
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError
                    self.sock.settimeout(left)
                else:
                    self.sock.settimeout(None)
                k = self.sock.recv_into(view[got:])
                if k == 0:
                    if got == 0 and what == "frame header":
                        raise PeerLost(f"{self.peer} closed the control connection")
                    raise PeerLost(f"{self.peer} closed the control connection mid-frame ({what}: {got} of {n})")
                got += k
        except TimeoutError:
            if got or what != "frame header":
                self.desynced = True
            raise TransferTimeout(f"control channel to {self.peer}: no {what} within "
                                  f"{self._timeout} s") from None
        except (ConnectionError, OSError) as e:
            if isinstance(e, PeerLost):
                raise
            raise PeerLost(f"control channel to {self.peer} lost: {e}") from None
        finally:
            view.release()
        return bytes(buf)

    def close(self) -> None:
        """Close the socket; idempotent."""
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def __enter__(self) -> Channel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def decode_frame(body: bytes) -> dict[str, Any]:
    """Decode one frame body: pre-scanned (:func:`scan_msgpack`), then decoded with msgpack limits.

    Raises
    ------
    ProtocolError
        Not one msgpack map with a known ``type``, or more objects or deeper
        nesting than a control frame ever has.
    """
    scan_msgpack(body, MAX_FRAME_OBJECTS, MAX_FRAME_DEPTH)
    lim = len(body)
    try:
        frame = msgpack.unpackb(body, raw=False, strict_map_key=True, max_str_len=lim, max_bin_len=lim,
                                max_array_len=MAX_FRAME_OBJECTS, max_map_len=MAX_FRAME_OBJECTS, max_ext_len=0)
    except Exception as e:   # msgpack raises several types for bad input; all mean the same here
        raise ProtocolError(f"frame is not valid msgpack: {type(e).__name__}: {e}") from None
    if not isinstance(frame, dict) or not isinstance(frame.get("type"), str):
        raise ProtocolError("frame is not a msgpack map with a 'type' string")
    if frame["type"] not in FRAME_TYPES:
        raise ProtocolError(f"unknown frame type {frame['type']!r}")
    return frame


# Bytes that follow a msgpack type byte before its payload or children: fixed-size scalars, and the
# width of the length field of str/bin/ext (ext also has a 1-byte type code).
_FIXED = {0xc0: 0, 0xc2: 0, 0xc3: 0, 0xca: 4, 0xcb: 8, 0xcc: 1, 0xcd: 2, 0xce: 4, 0xcf: 8,
          0xd0: 1, 0xd1: 2, 0xd2: 4, 0xd3: 8, 0xd4: 2, 0xd5: 3, 0xd6: 5, 0xd7: 9, 0xd8: 17}
_SIZED = {0xc4: 1, 0xc5: 2, 0xc6: 4, 0xd9: 1, 0xda: 2, 0xdb: 4}         # bin8/16/32, str8/16/32
_EXT = {0xc7: 1, 0xc8: 2, 0xc9: 4}
_CONTAINER = {0xdc: (2, 1), 0xdd: (4, 1), 0xde: (2, 2), 0xdf: (4, 2)}   # array16/32, map16/32: (width, per entry)


def scan_msgpack(data: bytes | bytearray | memoryview, max_objects: int, max_depth: int,
                 what: str = "frame") -> int:
    """Walk one msgpack object without building it; return how many objects it holds.

    The walk touches each object header once and skips str/bin payloads by
    their length, so it costs at most ``max_objects`` steps whatever a
    header claims: a container that declares 2**32 children fails when the
    budget or the bytes run out, before anything is allocated.

    Raises
    ------
    ProtocolError
        More than ``max_objects`` objects, nesting deeper than ``max_depth``,
        a truncated object, a reserved type byte, or bytes after the object.
    """
    buf = memoryview(data).cast("B") if not isinstance(data, bytes) else data
    size = len(buf)
    pos = 0
    count = 0
    pending = [1]          # children still to read at each open container level (the root: one object)
    while pending:
        if pending[-1] == 0:
            pending.pop()
            continue
        pending[-1] -= 1
        if pos >= size:
            raise ProtocolError(f"{what} is truncated msgpack (an object is missing at byte {pos})")
        count += 1
        if count > max_objects:
            raise ProtocolError(f"{what} holds more than {max_objects} msgpack objects (no valid {what} "
                                f"does); refused before decoding it")
        b = buf[pos]
        pos += 1
        children = 0
        if b <= 0x7f or b >= 0xe0:
            continue                                 # fixint
        if b <= 0x8f:
            children = 2 * (b & 0x0f)                # fixmap
        elif b <= 0x9f:
            children = b & 0x0f                      # fixarray
        elif b <= 0xbf:
            pos += b & 0x1f                          # fixstr
        elif b in _FIXED:
            pos += _FIXED[b]
        elif b in _SIZED or b in _EXT:
            width = _SIZED.get(b) or _EXT[b]
            if pos + width > size:
                raise ProtocolError(f"{what} is truncated msgpack (a length field at byte {pos})")
            pos += width + int.from_bytes(buf[pos:pos + width], "big") + (1 if b in _EXT else 0)
        elif b in _CONTAINER:
            width, per = _CONTAINER[b]
            if pos + width > size:
                raise ProtocolError(f"{what} is truncated msgpack (a length field at byte {pos})")
            children = per * int.from_bytes(buf[pos:pos + width], "big")
            pos += width
        else:
            raise ProtocolError(f"{what} is not valid msgpack: reserved type byte {b:#04x} at byte {pos - 1}")
        if pos > size:
            raise ProtocolError(f"{what} is truncated msgpack (an object overruns the {what} at byte {pos})")
        if 0x80 <= b <= 0x9f or b in _CONTAINER:
            if len(pending) > max_depth:     # pending holds one level per open container, plus the root's
                raise ProtocolError(f"{what} nests msgpack containers deeper than {max_depth} levels (no "
                                    f"valid {what} does); refused before decoding it")
            pending.append(children)
    if pos != size:
        raise ProtocolError(f"{what} has {size - pos} bytes after its msgpack object")
    return count


def _peername(sock: socket.socket) -> str:
    try:
        name = sock.getpeername()
    except OSError:
        return "peer"
    return f"{name[0]}:{name[1]}" if isinstance(name, tuple) else "local peer"


def parse_address(text: str | tuple[str, int], default_host: str = "127.0.0.1") -> tuple[str, int]:
    """``"host:port"``, ``"[v6]:port"``, ``":port"`` or a ``(host, port)`` pair (as ``Receiver.address``
    gives it) → (host, port).

    Raises
    ------
    ValueError
        Not an address with a port in 0..65535.
    """
    if isinstance(text, tuple | list):
        if len(text) != 2 or not isinstance(text[0], str) or isinstance(text[1], bool) \
                or not isinstance(text[1], int) or not 0 <= text[1] <= 65535:
            raise ValueError(f"address must be (host, port) with a port in 0..65535, got {text!r}")
        return text[0] or default_host, text[1]
    if not isinstance(text, str):
        raise ValueError(f"address must be 'HOST:PORT' or (host, port), got {type(text).__name__}")
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"address must be HOST:PORT, got {text!r}")
    host = host.strip("[]") or default_host
    return host, int(port)


# ------------------------------------------------------------------ update versions and chains
MAX_CHAIN = 64


class _Packable(Protocol):
    def pack(self) -> bytes: ...


def packed_digest(packed: bytes) -> bytes:
    """SHA-256 of a packed manifest: the layout half of a :class:`Version`."""
    return hashlib.sha256(packed).digest()


def manifest_digest(manifest: _Packable) -> bytes:
    """:func:`packed_digest` of ``manifest.pack()``."""
    return packed_digest(manifest.pack())


@dataclass(frozen=True)
class Version:
    """Which update a region holds: the origin sender's update number and its manifest's digest.

    Every offer carries one; a receiver checks the digest against the manifest it unpacked and holds
    the version only once every byte landed (and verified, when asked).
    """

    update: int
    digest: bytes

    def as_wire(self) -> dict[str, Any]:
        return {"update": self.update, "digest": self.digest}

    @classmethod
    def from_wire(cls, value: Any) -> Version:
        if (not isinstance(value, dict) or not int_in(value.get("update"), 1, 1 << 63)
                or not isinstance(value.get("digest"), bytes) or len(value["digest"]) != 32):
            raise ProtocolError("offer: 'version' must be {update: int >= 1, digest: 32 bytes}")
        return cls(value["update"], value["digest"])


def parse_chain(value: Any) -> list[str]:
    """The ``chain`` of an offer (the receivers a fan-out relay forwards to), checked: a list of at most
    :data:`MAX_CHAIN` distinct ``HOST:PORT`` strings."""
    if not isinstance(value, list) or len(value) > MAX_CHAIN or not all(isinstance(a, str) for a in value):
        raise ProtocolError(f"offer: 'chain' must be a list of at most {MAX_CHAIN} HOST:PORT strings")
    if len(set(value)) != len(value):
        raise ProtocolError("offer: 'chain' names an address twice")
    for address in value:
        try:
            parse_address(address)
        except ValueError as e:
            raise ProtocolError(f"offer: bad chain address {address!r}: {e}") from None
    return list(value)


# ------------------------------------------------------------------ handshake
def session_key(key: bytes | None, sender_nonce: bytes, receiver_nonce: bytes) -> bytes:
    """The per-session secret transports prove data connections with.

    Without a token it is derived from public nonces only: it then keeps
    data connections of different sessions apart but is not a secret.
    """
    return mac(key or bytes(32), b"session", sender_nonce, receiver_nonce)


def client_handshake(ch: Channel, key: bytes | None, capabilities: Mapping[str, Any],
                     timeout: float) -> tuple[dict, bytes]:
    """The sender's half of hello + mutual authentication.

    Returns the receiver's hello frame and the session key.

    Raises
    ------
    ProtocolError
        The versions differ (the message names both), or a frame is bad.
    AuthError
        The tokens differ, only one side has one, or the receiver could not
        prove it knows the token.
    """
    my_nonce = nonce()
    ch.peer_role = "receiver"
    # The hello ends in CR LF CR LF ("eol", ignored by receivers) so that a line-based server at
    # this address (HTTP, SMTP, ...) answers at once and is named, instead of waiting for more.
    ch.send("hello", version=PROTOCOL_VERSION, role="sender", auth=key is not None, nonce=my_nonce,
            capabilities=dict(capabilities), eol="\r\n\r\n")
    try:
        hello = ch.recv("hello", timeout=timeout)
    except PeerLost as e:
        raise PeerLost(f"{e} before answering the hello: is {ch.peer} a tensorxfer receiver? (or it "
                       f"refused this sender: see its log)") from None
    except TransferTimeout as e:
        raise TransferTimeout(f"{e}: the peer at {ch.peer} did not answer the hello; is it a tensorxfer "
                              f"receiver (or one busy with another sender)?") from None
    _check_hello(hello, key, "receiver")
    if key is not None:
        peer_nonce = field(hello, "nonce", bytes)
        ch.send("auth", mac=mac(key, b"sender", peer_nonce, my_nonce))
        reply = ch.recv("auth", timeout=timeout)
        if not hmac.compare_digest(field(reply, "mac", bytes), mac(key, b"receiver", my_nonce, peer_nonce)):
            raise AuthError(f"receiver {ch.peer} failed to prove it holds the token; nothing was sent")
    ch.authenticated()
    return hello, session_key(key, my_nonce, field(hello, "nonce", bytes))


def server_handshake(ch: Channel, key: bytes | None, capabilities: Mapping[str, Any],
                     timeout: float) -> tuple[dict, bytes]:
    """The receiver's half of hello + mutual authentication.

    Returns the sender's hello frame and the session key.

    A failure is also reported to the peer in an ``error`` frame.

    Raises
    ------
    ProtocolError, AuthError
        As :func:`client_handshake`.
    """
    ch.peer_role = "sender"
    hello = ch.recv("hello", timeout=timeout)
    try:
        _check_hello(hello, key, "sender")
    except AuthError as e:
        ch.send_error("auth", str(e))
        raise
    except ProtocolError as e:
        ch.send_error("version" if "version" in str(e) else "protocol", str(e))
        raise
    peer_nonce = field(hello, "nonce", bytes)
    my_nonce = nonce()
    ch.send("hello", version=PROTOCOL_VERSION, role="receiver", auth=key is not None, nonce=my_nonce,
            capabilities=dict(capabilities))
    if key is not None:
        proof = field(ch.recv("auth", timeout=timeout), "mac", bytes)
        if not hmac.compare_digest(proof, mac(key, b"sender", my_nonce, peer_nonce)):
            ch.send_error("auth", "wrong token")
            raise AuthError(f"sender {ch.peer} presented a wrong token; connection refused, no data moved")
        ch.send("auth", mac=mac(key, b"receiver", peer_nonce, my_nonce))
    ch.authenticated()
    return hello, session_key(key, peer_nonce, my_nonce)


def _check_hello(hello: Mapping[str, Any], key: bytes | None, peer_role: str) -> None:
    version = field(hello, "version", int)
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version mismatch: this side speaks version {PROTOCOL_VERSION}, "
                            f"the {peer_role} speaks version {version}; upgrade the older side")
    if field(hello, "role", str) != peer_role:
        raise ProtocolError(f"expected a {peer_role} on the other end, got role {hello['role']!r}")
    nonce_ = field(hello, "nonce", bytes)
    if len(nonce_) != NONCE_BYTES:
        raise ProtocolError(f"hello nonce must be {NONCE_BYTES} bytes, got {len(nonce_)}")
    field(hello, "capabilities", dict)
    peer_auth = field(hello, "auth", bool)
    if peer_auth != (key is not None):
        mine = "has a token" if key is not None else "has no token"
        theirs = "has one" if peer_auth else "has none"
        raise AuthError(f"token mismatch: this side {mine}, the {peer_role} {theirs}; give both the same token")
