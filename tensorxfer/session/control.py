"""The control connection as both ends of a session use it: its timeouts, keep-alive frames, and the
context a session hands its data paths."""

from __future__ import annotations

import threading
import time

from tensorxfer import connections
from tensorxfer.errors import PeerLost, ProtocolError, TensorXferError
from tensorxfer.protocol import Channel
from tensorxfer.transport.base import TransferContext

DEFAULT_STALL_TIMEOUT = 30.0
DEFAULT_HANDSHAKE_TIMEOUT = 10.0
CONTROL_TIMEOUT = 10.0
ALLOCATION_FLOOR_BYTES_PER_S = 100e6    # slowest allocation rate a live receiver is assumed to reach
KEEPALIVE_SECONDS = 2.0                 # how often a busy receiver says "wait" (well under any ack timeout)


def seconds(**named: float) -> tuple[float, ...]:
    """The timeouts ``named`` as floats, each checked to be seconds > 0 (ValueError naming it: a zero, a
    negative or a NaN timeout would end waits at once, reported as a peer that stalled or never came)."""
    out = []
    for name, value in named.items():
        v = float(value)
        if not v > 0:
            raise ValueError(f"{name} is seconds > 0, got {value!r}")
        out.append(v)
    return tuple(out)


def control_timeout(stall_timeout: float) -> float:
    """How long a control wait may take: at least :data:`CONTROL_TIMEOUT`, so that a short data stall
    timeout does not make a busy peer's allocation (before accept) or verification (before ack) look
    like a stall."""
    return max(stall_timeout, CONTROL_TIMEOUT)


def remaining(deadline: float | None) -> float | None:
    """Seconds left until ``deadline`` (``time.monotonic()``), never 0: a zero socket timeout means
    non-blocking (BlockingIOError), not "time is up"."""
    return None if deadline is None else max(1e-3, deadline - time.monotonic())


def transfer_context(ch: Channel, session_key: bytes, stall_timeout: float, streams: int | None) -> TransferContext:
    """A session's transport context (its hosts: where data connections go).

    Raises
    ------
    PeerLost
        The peer reset the control connection since its last frame (reading the addresses fails).
    """
    try:
        local, peer = ch.sock.getsockname()[0], ch.sock.getpeername()[0]
    except OSError as e:
        raise PeerLost(f"the {ch.peer_role or 'peer'} reset the control connection ({e.strerror or e})") from None
    return TransferContext(local_host=local, peer_host=peer, session_key=session_key, stall_timeout=stall_timeout,
                           streams=streams, control_lost=lambda: control_lost(ch))


def control_lost(ch: Channel) -> bool:
    """Whether the peer closed or reset the control connection (without reading a byte of a frame: only
    EOF or an error counts; a frame already waiting, e.g. the sender's done, means it is alive)."""
    try:
        return connections.peer_closed(ch.sock)
    except ProtocolError:       # the channel was closed here
        return True


class KeepAlive:
    """Sends ``wait`` frames from a thread while the receiver works between ``done`` and ``ack``.

    Only this thread sends while the block runs; the block's own frames (error, ack) are sent after it
    ended, so frames never interleave.
    """

    def __init__(self, ch: Channel, seq: int) -> None:
        self._ch, self._seq = ch, seq
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tensorxfer-keepalive", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(KEEPALIVE_SECONDS):
            try:
                self._ch.send("wait", seq=self._seq)
            except TensorXferError:
                return      # the sender is gone; the block's own frames will find that out

    def __enter__(self) -> KeepAlive:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
