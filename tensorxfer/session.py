"""Sender and Receiver: sessions that move whole regions, repeatedly.

A :class:`Sender` opens one control connection to a :class:`Receiver`
(hello, mutual HMAC authentication when a token is set) and keeps it for its
lifetime; every :meth:`Sender.send` is one offer → accept → data → done →
ack exchange (``docs/protocol.md``).  The receiver allocates a region from
the first offer's manifest and lands every later offer with the same layout
in that same region, and both ends keep their transport for the session: it
is set up (registered with the NIC, connected, handles exported) on the first
update and reused by every later one — a training step's update allocates,
registers and connects nothing, and :class:`TransferStats` shows it
(``setup``, ``setup_seconds`` vs ``wire_seconds``, the transport's
``counters``).  An offer with a *different* layout is re-allocated explicitly:
the old region is closed (deferred while views of it are alive) and a new
one allocated; the ``accept`` frame and :attr:`Receiver.last_stats` say so.

A receiver serves senders one after another: when a sender closes its
session, :meth:`Receiver.receive` accepts the next.  Connections are
authenticated concurrently, each within ``handshake_timeout`` in all
(:class:`~tensorxfer.connections.Gate`): idle or trickling strangers are
dropped and counted (:attr:`Receiver.dropped_connections`), never fatal,
and never hold a legitimate sender up.  Everything is plain blocking code
usable from threads; no event loop is needed.

Ownership: the receiver owns the region it returns and reuses it for the
next offer; copy what you need to keep before calling ``receive()`` again.
``close()`` on either side is idempotent and releases every socket.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import select
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from tensorxfer import connections
from tensorxfer.checksum import ALGORITHM, first_mismatch, tensor_checksums
from tensorxfer.connections import Gate
from tensorxfer.errors import (
    ChecksumMismatch,
    CudaError,
    ManifestError,
    PeerLost,
    ProtocolError,
    RegionError,
    TensorXferError,
    TransferError,
    TransferTimeout,
    TransportUnavailable,
)
from tensorxfer.fanout import (
    FanoutSender,
    FanoutStats,
    Onward,
    Relay,
    RelayJob,
    Version,
    manifest_digest,
    packed_digest,
    parse_chain,
)
from tensorxfer.manifest import Manifest, default_max_region_bytes
from tensorxfer.protocol import Channel, client_handshake, field, parse_address, server_handshake, token_key
from tensorxfer.region import TensorRegion, parse_device
from tensorxfer.transport import TRANSPORTS, check_requested, choose, local_capabilities, local_transports
from tensorxfer.transport.base import (
    MAX_STREAMS,
    Progress,
    ReceiverTransport,
    SenderTransport,
    TransferContext,
    setup_flag,
)

log = logging.getLogger(__name__)

DEFAULT_STALL_TIMEOUT = 30.0
DEFAULT_HANDSHAKE_TIMEOUT = 10.0
CONTROL_TIMEOUT = 10.0
ALLOCATION_FLOOR_BYTES_PER_S = 100e6    # slowest allocation rate a live receiver is assumed to reach


@dataclass(frozen=True)
class TransferStats:
    """What one transfer (one update of a session) did.

    ``seconds`` runs from the offer to the ack (allocation on first use,
    setup, data, verification); ``gbps`` is ``bytes * 8 / seconds / 1e9``.
    ``setup_seconds`` is what setting the data path up cost (the receiver's
    allocation and registration, the sender's registration and connection;
    0 on a warm update), ``wire_seconds`` the time the bytes were moving
    (``wire_gbps``).  ``update`` numbers the updates of the session from 1;
    ``setup`` says whether this one set the transport up (the first, and the
    first after the region changed); ``counters`` are the transport's totals
    for the session so far (``registrations``, ``connects``, ``updates``), so
    update 100 can show it registered and connected nothing;
    ``registration`` is how the region was registered with the NIC
    (``"reg_dmabuf_mr"`` / ``"reg_mr"``; empty for transports that register
    nothing).  ``last_byte_seconds`` runs from the offer to the last byte
    (sent, over tcp; landed, over ipc and rdma): in a fan-out chain it
    shows which hop held the others back.
    """

    bytes: int
    seconds: float
    transport: str
    streams: int
    verified: bool = False
    reallocated: bool = False
    update: int = 0
    setup: bool = False
    setup_seconds: float = 0.0
    wire_seconds: float = 0.0
    registration: str = ""
    counters: Mapping[str, int] = dataclasses.field(default_factory=dict)
    last_byte_seconds: float = 0.0

    @property
    def gbps(self) -> float:
        return self.bytes * 8 / self.seconds / 1e9 if self.seconds > 0 else 0.0

    @property
    def wire_gbps(self) -> float:
        return self.bytes * 8 / self.wire_seconds / 1e9 if self.wire_seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"bytes": self.bytes, "seconds": self.seconds, "gbps": self.gbps, "transport": self.transport,
                "streams": self.streams, "verified": self.verified, "reallocated": self.reallocated,
                "update": self.update, "setup": self.setup, "setup_seconds": self.setup_seconds,
                "wire_seconds": self.wire_seconds, "wire_gbps": self.wire_gbps, "registration": self.registration,
                "counters": dict(self.counters), "last_byte_seconds": self.last_byte_seconds}


KEEPALIVE_SECONDS = 2.0        # how often a busy receiver says "wait" (well under any ack timeout)


class _KeepAlive:
    """Sends ``wait`` frames from a thread while the receiver works between ``done`` and ``ack``.

    Only this thread sends while the block runs; the block's own frames
    (error, ack) are sent after it ended, so frames never interleave.
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

    def __enter__(self) -> _KeepAlive:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


class _RelayAck:
    """A relay's ack, sent from a thread once the rest of its chain finished.

    A relay's own copy is complete (and checked) long before the hops after it are, and the ack carries
    their results: so :meth:`Receiver.receive` returns at once and this thread waits for the forward
    (sending ``wait`` frames meanwhile), then acknowledges.  Only this thread uses the session until it
    ends; the receiver joins it before the session's next frame.
    """

    def __init__(self, ch: Channel, seq: int, nbytes: int, job: RelayJob) -> None:
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(ch, seq, nbytes, job), name="tensorxfer-relay-ack",
                                        daemon=True)
        self._thread.start()

    def _run(self, ch: Channel, seq: int, nbytes: int, job: RelayJob) -> None:
        try:
            with _KeepAlive(ch, seq):
                relayed = job.finish()
            ch.send("ack", seq=seq, bytes=nbytes, relayed=relayed)
        except BaseException as e:
            self.error = e

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the ack to go out (or fail); False if still waiting after ``timeout`` seconds."""
        self._thread.join(timeout)
        return not self._thread.is_alive()


def _chain_transport(offer: dict[str, Any], used: str) -> str:
    """How a relay picks the transport to the next hop: as the origin asked (``auto``: each hop chooses what
    it and its next hop share, e.g. ipc on one host and tcp to another), not what the hop before it used.
    An offer without the field (older senders) keeps the old behaviour: the hop's own transport."""
    wanted = field(offer, "chain_transport", str, optional=True)
    if wanted is None:
        return used
    if wanted != "auto" and wanted not in TRANSPORTS:
        raise ProtocolError(f"offer: chain_transport must be 'auto' or one of {sorted(TRANSPORTS)}, got {wanted!r}")
    return wanted


def _context(ch: Channel, session_key: bytes, stall_timeout: float, streams: int | None) -> TransferContext:
    """A session's transport context (its hosts: where data connections go).  Reading the addresses fails
    when the peer reset the connection since its last frame: that is :class:`PeerLost`, not an OSError."""
    try:
        local, peer = ch.sock.getsockname()[0], ch.sock.getpeername()[0]
    except OSError as e:
        raise PeerLost(f"the {ch.peer_role or 'peer'} reset the control connection ({e.strerror or e})") from None
    return TransferContext(local_host=local, peer_host=peer, session_key=session_key, stall_timeout=stall_timeout,
                           streams=streams, control_lost=lambda: _control_lost(ch))


def _control_lost(ch: Channel) -> bool:
    """Whether the peer closed or reset the control connection (without reading a byte of a frame: only
    EOF or an error counts; a frame already waiting, e.g. the sender's done, means it is alive)."""
    try:
        return connections.peer_closed(ch.sock)
    except ProtocolError:       # the channel was closed here
        return True


def _remaining(deadline: float | None) -> float | None:
    # Never 0: a zero socket timeout means non-blocking (BlockingIOError), not "time is up".
    return None if deadline is None else max(1e-3, deadline - time.monotonic())


class Receiver:
    """Listens for senders and receives their regions.

    Parameters
    ----------
    listen : str
        ``HOST:PORT`` to bind (port 0 picks a free one; see :attr:`address`).
    token : str or bytes, optional
        Shared secret; senders must present the same one.  Without a token
        only token-less senders are accepted.
    device : str
        Where received regions live (``"cpu"``).
    max_region_bytes : int, optional
        Offers larger than this are refused before anything is allocated.
        Default (``None``): half of the memory the region would live in —
        this machine's RAM for ``"cpu"``, the GPU's memory for ``"cuda:N"``
        (:func:`~tensorxfer.manifest.default_max_region_bytes`).
    stall_timeout : float
        Seconds without progress before a transfer fails with
        :class:`TransferTimeout`.
    share : bool
        Same host only (transport ``ipc``): instead of copying, the received
        region *is* the sender's memory, mapped read-only for host regions
        (see :mod:`tensorxfer.transport.ipc` for the semantics).  Offers
        over any other transport are refused.

    Raises
    ------
    ValueError
        A malformed address or device.
    OSError
        The address cannot be bound.
    """

    def __init__(
        self,
        listen: str = "127.0.0.1:0",
        token: str | bytes | None = None,
        device: str = "cpu",
        max_region_bytes: int | None = None,
        stall_timeout: float = DEFAULT_STALL_TIMEOUT,
        handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
        share: bool = False,
        relay: bool | None = None,
    ) -> None:
        parse_device(device)
        self.share = bool(share)
        host, port = parse_address(listen)
        self.device = device
        self.max_region_bytes = (default_max_region_bytes(device) if max_region_bytes is None
                                 else int(max_region_bytes))
        self.stall_timeout = float(stall_timeout)
        self.handshake_timeout = float(handshake_timeout)
        self._key = token_key(token)
        self._token = token
        # Fan-out (tensorxfer.fanout): forward offers to the next hops the authenticated sender names,
        # with this receiver's token; without a token only when asked for explicitly.
        self._relay_allowed = relay if relay is not None else token is not None
        self._relay: Relay | None = (Relay(token, self.stall_timeout, self.handshake_timeout)
                                     if self._relay_allowed else None)
        self._version: Version | None = None
        self._fed_by_relay = False
        self._relay_ack: _RelayAck | None = None     # the last update's ack, waiting for the rest of its chain
        self._channel: Channel | None = None
        self._session_key = b""
        self._seq = 0
        self._transports: dict[str, ReceiverTransport] = {}     # this session's, by name
        self._last_manifest: tuple[int, bytes, Manifest, bytes] | None = None   # (limit, packed, parsed, digest)
        self._region: TensorRegion | None = None
        self.last_stats: TransferStats | None = None
        self._lock = threading.Lock()
        self._closing = False
        self._idle_since = 0.0              # when the current session last finished something
        self._gate: Gate | None = Gate(connections.listen(host, port=port), self._handshake,
                                       self.handshake_timeout, "control")

    @property
    def address(self) -> tuple[str, int]:
        """``(host, port)`` this receiver listens on."""
        host, port = self._open_gate().address[:2]
        return host, port

    @property
    def closed(self) -> bool:
        return self._gate is None

    @property
    def dropped_connections(self) -> int:
        """Connections dropped before they became a session (strangers, wrong tokens, port scans)."""
        gate = self._gate
        return gate.dropped if gate is not None else self._dropped_at_close

    _dropped_at_close = 0

    @property
    def version(self) -> Version | None:
        """The update :attr:`region` holds completely (landed, verified if asked); ``None`` while one is
        being written or after a failed one."""
        return self._version

    @property
    def fed_by_relay(self) -> bool:
        """Whether the last offer came from a fan-out relay (a receiver forwarding the update) rather than
        from its origin.  When such an update fails because the relay died or stalled, the hop before the
        relay sends it again over the repaired chain: a caller waiting for one update should keep
        receiving (``tensorxfer-recv --once`` does)."""
        return self._fed_by_relay

    @property
    def region(self) -> TensorRegion | None:
        """The region the last transfer landed in (reused for the next same-layout offer)."""
        return self._region

    def _open_gate(self) -> Gate:
        if self._gate is None:
            raise TransferError("this Receiver is closed")
        return self._gate

    def _handshake(self, sock: socket.socket) -> tuple[Channel, bytes]:
        """Hello + authentication of a new connection (in the gate's thread for it; it bounds the time)."""
        ch = Channel(sock)
        names = [t for t in local_transports() if t == "ipc" or not self.share]   # sharing needs ipc
        caps = {"transports": names, "device": self.device, "transport_caps": local_capabilities()}
        _, key = server_handshake(ch, self._key, caps, self.handshake_timeout)
        return ch, key

    # ------------------------------------------------------------ receiving
    def receive(self, timeout: float | None = None, progress: Progress | None = None,
                on_offer: Callable[[Manifest], None] | None = None,
                on_landed: Callable[[TensorRegion], None] | None = None) -> TensorRegion:
        """Wait for the next offer (from the current sender, or the next one) and receive it.

        Parameters
        ----------
        timeout : float, optional
            Seconds to wait for an offer to *start* (``None``: forever).
            Once data flows, ``stall_timeout`` applies instead.
        progress : callable, optional
            Called with byte counts as data lands (from stream threads).
        on_offer : callable, optional
            Called with the validated manifest before data moves (e.g. to
            size a progress bar).
        on_landed : callable, optional
            Called with the region once every byte landed (and was verified),
            *before* the sender is acknowledged: the sender's ``send()``
            succeeds only if it returns.  If it raises, the sender gets an
            error naming it instead of the ack (e.g. the CLI writes the files
            here, so a sender is never told "done" for files that were not
            written).

        Returns
        -------
        TensorRegion
            Owned by the receiver; valid until the next ``receive`` or
            ``close`` (same-layout offers overwrite it in place).

        Raises
        ------
        TransferTimeout
            No offer within ``timeout``, or the sender stalled mid-transfer.
        AuthError
            A sender presented the wrong token (it got no data path).
        ProtocolError
            A peer spoke something else (bad frames, version mismatch).
        ManifestError
            The offer was malformed or over ``max_region_bytes`` (refused
            before allocating).
        PeerLost
            The sender died mid-transfer.
        ChecksumMismatch
            ``verify`` was requested and a tensor's data differs.
        TransportUnavailable, CudaError
            The offer asked for a transport, or the receiver's device cannot
            hold the region, here (the sender is told why).

        Notes
        -----
        A fan-out relay returns as soon as its own copy is complete (and
        checked): it goes on forwarding from the region to the rest of its
        chain, and acknowledges its sender once they finished (the next
        ``receive()``, :meth:`wait_relayed` or :meth:`close` waits for that).
        Do not write into the region meanwhile.

        Every failure ends the current session (the next call accepts a new
        sender) but leaves the receiver usable.  Calling :meth:`close` from
        another thread ends a blocked ``receive`` with :class:`TransferError`.
        """
        with self._lock:
            deadline = None if timeout is None else time.monotonic() + timeout
            self._settle_relay_ack(deadline)
            while True:
                ch = self._channel
                if ch is None:
                    ch = self._accept_session(deadline)
                try:
                    frame = self._next_frame(ch, deadline)
                    if frame is None:           # an idle session yielded to a waiting sender
                        self._end_session()
                        continue
                except TransferTimeout:
                    if ch.desynced:     # timed out mid-frame: the stream is unusable
                        self._end_session()
                    raise TransferTimeout(f"no offer within {timeout} s") from None
                except PeerLost:
                    self._end_session()
                    self._check_open()          # close() from another thread wakes us this way
                    log.info("sender %s ended its session", ch.peer)
                    continue
                except TensorXferError:
                    self._end_session()
                    raise
                if frame["type"] == "bye":
                    log.info("sender %s said goodbye", ch.peer)
                    self._end_session()
                    continue
                try:
                    region = self._serve_offer(ch, frame, progress, on_offer, on_landed)
                    self._idle_since = time.monotonic()
                    return region
                except BaseException as e:
                    # After a failed transfer the control stream's state is unknown: end the session.
                    self._end_session()
                    if self._closing and not isinstance(e, KeyboardInterrupt):
                        raise TransferError(f"this Receiver was closed during the transfer ({e})") from e
                    raise

    def _next_frame(self, ch: Channel, deadline: float | None) -> dict[str, Any] | None:
        """The session's next offer (or bye), proving new connections meanwhile.

        One session is served at a time, so a session that sits idle would lock every other sender
        out (a token-less stranger needs only to say hello).  While waiting, the gate keeps proving new
        connections; once one is waiting and this session has been idle for ``handshake_timeout``, the
        session yields: None is returned and the caller ends it.  A single sender (a trainer between
        steps) is never cut off: it yields only to another sender that is actually waiting.
        """
        gate = self._open_gate()
        poller = select.poll()
        poller.register(ch.sock, select.POLLIN)
        poller.register(gate.fileno(), select.POLLIN)
        channel = ch.sock.fileno()
        while True:
            # Wake for whichever comes first, the session's next frame or a new connection: an offer is
            # noticed at once (a warm CUDA ipc update takes ~16 ms; a polling delay would show).
            events = dict(poller.poll(50))
            if events.get(channel):
                # A frame has begun: all of it must arrive within CONTROL_TIMEOUT (or the caller's deadline).
                limit = CONTROL_TIMEOUT if deadline is None else max(1e-3, min(CONTROL_TIMEOUT,
                                                                              deadline - time.monotonic()))
                return ch.recv("offer", "bye", timeout=limit)
            self._check_open()
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise TransferTimeout("no offer within the timeout")
            # A fan-out relay's session yields at once: the chain's order is the origin's to change (a hop
            # moved elsewhere in the chain leaves its old session to this receiver idle).
            if gate.ready and (self._fed_by_relay or now - self._idle_since > self.handshake_timeout):
                log.warning("session with %s idle for %.0f s while another sender waits: ending it", ch.peer,
                            now - self._idle_since)
                return None
            if events:
                gate.pump(1e-3)         # a connection is waiting: accept it and start proving it

    def _settle_relay_ack(self, deadline: float | None) -> None:
        """Let the last relayed update's ack go out before the session moves on (the sender reads nothing
        else first).  If it could not be sent, the session is over."""
        ack = self._relay_ack
        if ack is None:
            return
        if not ack.join(_remaining(deadline)):
            raise TransferTimeout("the previous update's relay ack is still waiting for the rest of its chain")
        self._relay_ack = None
        if ack.error is not None:
            log.warning("relay: the previous update's ack could not be sent (%s: %s): ending that session",
                        type(ack.error).__name__, ack.error)
            self._end_session()

    def wait_relayed(self, timeout: float | None = None) -> None:
        """Wait until the last update this receiver relayed has been acknowledged to its sender (the rest
        of its chain finished); a no-op when it relayed nothing.  :meth:`receive` returns as soon as this
        receiver's own copy is complete, so a process that is about to exit after its last update calls
        this (or :meth:`close`, which does) so that the hops after it are not left behind.

        Raises
        ------
        TransferTimeout
            The chain had not finished within ``timeout`` seconds.
        """
        with self._lock:
            self._settle_relay_ack(None if timeout is None else time.monotonic() + timeout)

    def _check_open(self) -> None:
        if self._closing:
            raise TransferError("this Receiver was closed (from another thread); receive() ended")

    def _accept_session(self, deadline: float | None) -> Channel:
        gate = self._open_gate()
        try:
            [(_, (ch, key))] = gate.admit(1, timeout=None if deadline is None else _remaining(deadline),
                                          abort=lambda: "this Receiver was closed" if self._closing else None)
        except TransferTimeout:
            why = f" ({gate.dropped} connection(s) dropped, last: {gate.last_drop})" if gate.dropped else ""
            raise TransferTimeout(f"no sender connected within the timeout{why}") from None
        self._channel, self._session_key, self._seq = ch, key, 0
        self._idle_since = time.monotonic()
        log.info("session with sender %s", ch.peer)
        return ch

    def _end_session(self) -> None:
        transports, self._transports = self._transports, {}
        for transport in transports.values():
            transport.close()
        ch, self._channel = self._channel, None
        if ch is not None:
            ch.close()

    def _transport(self, ch: Channel, name: str, streams: int | None) -> ReceiverTransport:
        """This session's transport ``name`` (made on its first use, reused by every later update)."""
        transport = self._transports.get(name)
        if transport is None:
            ctx = _context(ch, self._session_key, self.stall_timeout, streams)
            transport = self._transports[name] = TRANSPORTS[name][1](ctx)
        return transport

    def _serve_offer(self, ch: Channel, offer: dict[str, Any], progress: Progress | None,
                     on_offer: Callable[[Manifest], None] | None,
                     on_landed: Callable[[TensorRegion], None] | None) -> TensorRegion:
        t0 = time.perf_counter()
        seq = field(offer, "seq", int)
        if seq != self._seq + 1:
            raise ProtocolError(f"offer out of order: expected sequence {self._seq + 1}, got {seq}")
        self._seq = seq
        name = field(offer, "transport", str)
        streams = field(offer, "streams", int, optional=True)
        verify = field(offer, "verify", bool)
        self._fed_by_relay = offer.get("relayed") is True
        self._version = None            # the region is about to be written: no complete version in it
        try:
            if streams is not None and not 1 <= streams <= MAX_STREAMS:
                raise ProtocolError(f"offer: streams must be between 1 and {MAX_STREAMS}, got {streams}")
            manifest, digest = self._unpack_manifest(field(offer, "manifest", bytes))
            version, chain = self._offered_version(offer, digest)
            onward_transport = _chain_transport(offer, name) if chain else name
        except (ManifestError, ProtocolError) as e:
            ch.send_error("refused" if isinstance(e, ManifestError) else "protocol", str(e))
            raise
        if on_offer is not None:
            try:
                on_offer(manifest)
            except BaseException as e:
                ch.send_error("refused", f"the receiver refused the offer: {type(e).__name__}: {e}")
                raise
        # a transport this session already runs is known to work: probing again (rdma opens the device)
        # would cost every warm update more than a small one's data
        if (self.share and name != "ipc") or (name not in self._transports and name not in local_transports()):
            msg = f"transport {name!r} is not available on this receiver (it has {local_transports()}" \
                  f"{'; share=True needs ipc' if self.share else ''})"
            ch.send_error("transport", msg)
            raise TransportUnavailable(msg)
        fresh = field(offer, "fresh", bool)
        if chain and (self.share or self._relay is None):
            msg = ("this receiver does not relay (share=True)" if self.share else
                   "this receiver does not relay (it has no token; Receiver(relay=True) allows it)")
            ch.send_error("refused", msg)
            raise ManifestError(msg)
        if not chain and self._relay is not None:
            # Not (or no longer) a relay: sessions it kept to hops after it would only hold those receivers
            # (and, over rdma, their registrations).
            self._relay.close()
        if self.share:
            self._version = None
            return self._serve_shared(ch, seq, manifest, verify, fresh, progress, t0, on_landed)
        previous = self._region
        try:
            region, reallocated = self._region_for(manifest)
        except (CudaError, RegionError, MemoryError) as e:
            ch.send_error("transfer", f"the receiver cannot allocate {manifest.nbytes} bytes on "
                                      f"{self.device!r}: {e}")
            raise
        job: RelayJob | None = None
        try:
            transport = self._transport(ch, name, streams)
            if chain:
                assert self._relay is not None and version is not None
                job = self._relay.start(region, chain, version, verify, onward_transport, streams,
                                        "{}:{}".format(*self.address))
            if hasattr(transport, "on_piece"):      # tcp, ipc, rdma: a relay forwards ranges as they land
                transport.on_piece = job.landed.add if job is not None else None
            registered, used = transport.counters.registrations, transport.counters.updates
            descriptors = transport.prepare(region, seq, fresh)
            setup = setup_flag(descriptors)
            setup_seconds = time.perf_counter() - t0
            ch.send("accept", seq=seq, transport=name, descriptors=descriptors, reallocated=reallocated,
                    setup_seconds=setup_seconds)
            t1 = time.perf_counter()
            nbytes = transport.wait(progress)
            wire = time.perf_counter() - t1
            if job is not None:
                job.landed.add_all()
            setup = setup or transport.counters.registrations > registered    # ipc: handles passed with the data
            if setup and used:
                log.info("update %d: the %s transport was set up again (%s): %d registrations, %d connects so far",
                         seq, name, "the layout changed" if reallocated else "the sender's region changed",
                         transport.counters.registrations, transport.counters.connects)
            self._finish(ch, seq, region, manifest, nbytes, verify, max(self.stall_timeout, CONTROL_TIMEOUT),
                         "landed", on_landed, job)
        except BaseException as e:
            if job is not None:
                job.abort(f"{type(e).__name__}: {e}")
            if region is not previous:      # memory allocated for this offer: a vanished sender leaves none behind
                # The session's transports go first: an MR over GPU memory holds no reference to it, so the
                # memory must not be freed while remote write to it is still granted.
                self._end_session()
                self._region = None
                region.close(defer=True)
            raise
        self.last_stats = TransferStats(nbytes, time.perf_counter() - t0, name, descriptors.get("streams", 1),
                                        verified=verify, reallocated=reallocated, update=seq, setup=setup,
                                        setup_seconds=setup_seconds if setup else 0.0, wire_seconds=wire,
                                        registration=transport.registration, counters=transport.counters.as_dict(),
                                        last_byte_seconds=t1 + wire - t0)
        self._version = version
        return region

    def _unpack_manifest(self, packed: bytes) -> tuple[Manifest, bytes]:
        """The offer's manifest, validated, and its digest; an update with the same bytes as the last reuses
        both (the manifest is immutable): checking an 820-tensor layout and packing it again to hash it on
        every warm update would cost more than a small one's data."""
        last, limit = self._last_manifest, self.max_region_bytes
        if last is not None and last[0] == limit and last[1] == packed:
            return last[2], last[3]
        manifest = Manifest.unpack(packed, max_region_bytes=limit)
        digest = manifest_digest(manifest)
        self._last_manifest = (limit, packed, manifest, digest)
        return manifest, digest

    def _offered_version(self, offer: dict[str, Any], digest: bytes) -> tuple[Version | None, list[str]]:
        """The offer's version (its digest must be ``digest``, the manifest's) and the chain to forward to."""
        raw = offer.get("version")
        version = None if raw is None else Version.from_wire(raw)
        if version is not None and version.digest != digest:
            raise ProtocolError("offer: the version's digest is not the digest of the offered manifest")
        chain = parse_chain(offer.get("chain", []))
        if chain and version is None:
            raise ProtocolError("offer: a chain needs a version")
        return version, chain

    def _finish(self, ch: Channel, seq: int, region: TensorRegion, manifest: Manifest, nbytes: int, verify: bool,
                timeout: float, verb: str, on_landed: Callable[[TensorRegion], None] | None,
                job: RelayJob | None = None) -> None:
        """The end of every transfer: the sender's done frame must match, checksums if asked, the
        caller's ``on_landed``, then ack."""
        done = ch.recv("done", timeout=timeout)
        if field(done, "seq", int) != seq or field(done, "bytes", int) != nbytes or nbytes != manifest.nbytes:
            raise ProtocolError(f"done frame does not match transfer {seq}: sender says {done.get('bytes')} bytes, "
                                f"{nbytes} {verb}, the manifest has {manifest.nbytes}")
        expected = self._expected_sums(region, done) if verify else None
        if job is not None:
            # Every byte is here: the next hop may finish.  It checks its own copy against the origin's
            # checksums (passed on as they came), so it need not wait for this hop's verification.
            job.complete(done.get("checksums"))
        # Hashing a large region and the caller's on_landed (the CLI writes and fsyncs every file) can
        # take minutes, and a relay waits for the rest of its chain: "wait" frames tell the sender the
        # receiver is alive and working, so its ack wait measures a stall, not the length of the work.
        bad: str | None = None
        failure: BaseException | None = None
        busy = expected is not None or on_landed is not None
        with _KeepAlive(ch, seq) if busy else contextlib.nullcontext():    # no thread for a plain update
            if expected is not None:
                bad = first_mismatch(region, expected)
            if bad is None and on_landed is not None:
                try:
                    on_landed(region)
                except BaseException as e:
                    failure = e
        if bad is not None:
            msg = f"tensor {bad!r} arrived corrupted ({ALGORITHM} differs from the sender's)"
            ch.send_error("checksum", msg, tensor=bad)
            raise ChecksumMismatch(msg, tensor=bad)
        if failure is not None:
            ch.send_error("landed", f"the receiver failed after the data landed: {type(failure).__name__}: "
                                    f"{failure}")
            raise failure
        if job is not None:
            # This copy is complete and checked: receive() returns now; the ack, which carries the results
            # of the hops after this one, goes out when they finished.
            self._relay_ack = _RelayAck(ch, seq, nbytes, job)
            return
        ch.send("ack", seq=seq, bytes=nbytes)

    def _serve_shared(self, ch: Channel, seq: int, manifest: Manifest, verify: bool, fresh: bool,
                      progress: Progress | None, t0: float,
                      on_landed: Callable[[TensorRegion], None] | None) -> TensorRegion:
        """Share mode: the region comes from the sender's memory; the previous one is released."""
        from tensorxfer.transport.ipc import IpcReceiver

        transport = self._transport(ch, "ipc", None)
        assert isinstance(transport, IpcReceiver)
        registered = transport.counters.registrations
        descriptors = transport.prepare_shared(manifest, self.device, seq, fresh, previous=self._region)
        setup = setup_flag(descriptors)
        setup_seconds = time.perf_counter() - t0
        ch.send("accept", seq=seq, transport="ipc", descriptors=descriptors, reallocated=True,
                setup_seconds=setup_seconds)
        t1 = time.perf_counter()
        nbytes = transport.wait(progress)
        wire = time.perf_counter() - t1
        setup = setup or transport.counters.registrations > registered
        region = transport.take_shared()
        old, self._region = self._region, region
        if old is not None and old is not region:   # the same memory again: the region is reused as is
            old.close(defer=True)       # views the caller still holds keep the old mapping alive
        region.manifest = manifest      # same layout when reused; metadata and checksums may be new
        self._finish(ch, seq, region, manifest, nbytes, verify, max(self.stall_timeout, CONTROL_TIMEOUT), "mapped",
                     on_landed)
        self.last_stats = TransferStats(nbytes, time.perf_counter() - t0, "ipc", 1, verified=verify,
                                        reallocated=old is not region, update=seq, setup=setup,
                                        setup_seconds=setup_seconds if setup else 0.0, wire_seconds=wire,
                                        counters=transport.counters.as_dict(), last_byte_seconds=t1 + wire - t0)
        return region

    def _region_for(self, manifest: Manifest) -> tuple[TensorRegion, bool]:
        old = self._region
        if old is not None and not old.closed and old.manifest.same_layout(manifest):
            old.manifest = manifest     # same layout; metadata and checksums may be new
            return old, False
        if old is not None:
            log.info("offer changes the layout (%d -> %d tensors, %d -> %d bytes): re-allocating the region",
                     len(old.manifest), len(manifest), old.nbytes, manifest.nbytes)
            self._region = None
            old.close(defer=True)       # views the caller still holds keep the old memory alive
        self._region = TensorRegion.from_manifest(manifest, device=self.device)
        return self._region, old is not None

    @staticmethod
    def _expected_sums(region: TensorRegion, done: dict[str, Any]) -> list[int]:
        sums = field(done, "checksums", list)
        if len(sums) != 2 or sums[0] != ALGORITHM or not isinstance(sums[1], bytes) \
                or len(sums[1]) != 8 * len(region.manifest):
            raise ProtocolError(f"done frame: checksums must be [{ALGORITHM!r}, 8 bytes per tensor]")
        return list(np.frombuffer(sums[1], dtype="<u8").tolist())

    def send_on(self, to: str | list[str], verify: bool = False, transport: str = "auto",
                streams: int | None = None) -> FanoutStats:
        """Send the complete update this receiver holds to other receivers (a new replica pulls from a warm peer).

        Sends :attr:`region` with its :attr:`version` kept (the origin's update number), over a chain when
        ``to`` names several receivers, with this receiver's token.  Holds the receiver's lock meanwhile, so
        no ``receive()`` overwrites the region while it is being sent.

        Raises
        ------
        TransferError
            No complete version is held (nothing received yet, or the last update failed or is in flight).
        """
        targets = [to] if isinstance(to, str) else list(to)
        with self._lock:
            region, version = self._region, self._version
            if region is None or region.closed or version is None:
                raise TransferError("this receiver holds no complete update to send on (nothing received yet, "
                                    "or the last update failed)")
            with FanoutSender(targets, token=self._token, transport=transport, streams=streams,
                              stall_timeout=self.stall_timeout, connect_timeout=self.handshake_timeout) as fan:
                return fan.send(region, verify=verify, version=version)

    # ------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Close the session, the listener and the region; idempotent.

        A relay first lets its last update's ack out (:meth:`wait_relayed`: the hops after it finish).
        From another thread it also ends a blocked :meth:`receive` with :class:`TransferError`.
        """
        ack = self._relay_ack
        if ack is not None and not self._closing:
            ack.join()      # the hops after this one get their update (bounded by the chain's allowances)
        self._closing = True
        gate, self._gate = self._gate, None
        if gate is not None:
            self._dropped_at_close = gate.dropped
            gate.close()
        ch = self._channel
        if ch is not None and not ch.closed:
            try:
                ch.sock.shutdown(socket.SHUT_RDWR)     # wakes a receive() blocked on the control channel
            except (OSError, ProtocolError):
                pass    # already closed: nothing to wake
        for transport in list(self._transports.values()):
            transport.close()                       # wakes a receive() blocked in a transfer
        with self._lock:                            # the receive() in flight, if any, has ended
            self._end_session()
            region, self._region = self._region, None
        if region is not None:
            region.close(defer=True)
        relay, self._relay = self._relay, None
        if relay is not None:
            relay.close()

    def __enter__(self) -> Receiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        where = "closed" if self.closed else "{}:{}".format(*self.address)
        return f"<Receiver {where}>"


def _attach_forward(transport: SenderTransport, onward: Onward | None, nbytes: int) -> str | None:
    """A relay's send (``onward`` with hooks): give ``transport`` the hook that makes it forward bytes as they
    land, and return the attribute's name (to clear after the send).

    tcp waits for each piece (``before_piece``); ipc raises the receiver's watermark and rdma its write's
    gate as the landed prefix grows (``ready_after``).  A transport with neither gets the region only once
    all of it landed: that wait happens here (store and forward), and None is returned.
    """
    if onward is None or onward.before_piece is None:
        return None
    if hasattr(transport, "before_piece"):
        transport.before_piece = onward.before_piece
        return "before_piece"
    if hasattr(transport, "ready_after") and onward.ready_after is not None:
        transport.ready_after = onward.ready_after
        return "ready_after"
    onward.before_piece(0, nbytes)
    return None


class Sender:
    """One session to a receiver; sends regions, repeatedly.

    Parameters
    ----------
    connect : str
        The receiver's ``HOST:PORT``.
    token : str or bytes, optional
        Shared secret (must match the receiver's).
    transport : str
        ``"auto"`` or a forced transport name (``"tcp"``).
    streams : int, optional
        Parallel data streams to ask for (default: the transport's measured
        default).
    stall_timeout : float
        Seconds without progress before :class:`TransferTimeout`.

    Raises
    ------
    PeerLost
        The receiver cannot be reached.
    AuthError
        Tokens differ (no data moves).
    ProtocolError
        The receiver speaks another protocol version.
    TransportUnavailable
        A forced transport cannot run here or on the receiver.
    """

    def __init__(
        self,
        connect: str,
        token: str | bytes | None = None,
        transport: str = "auto",
        streams: int | None = None,
        stall_timeout: float = DEFAULT_STALL_TIMEOUT,
        connect_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
    ) -> None:
        check_requested(transport)
        if streams is not None and not 1 <= streams <= MAX_STREAMS:
            raise ValueError(f"streams must be between 1 and {MAX_STREAMS}, got {streams}")
        host, port = parse_address(connect)
        self.streams = streams
        self.stall_timeout = float(stall_timeout)
        self._lock = threading.Lock()
        self._seq = 0
        self._channel: Channel | None = None
        self._broken: str | None = None
        self._transports: dict[str, SenderTransport] = {}      # this session's, by name
        self._last_manifest: tuple[Manifest, bytes, bytes] | None = None   # (manifest, packed, digest)
        try:
            sock = socket.create_connection((host, port), timeout=connect_timeout)
        except OSError as e:
            raise PeerLost(f"cannot connect to a receiver at {host}:{port}: {e}") from None
        ch = Channel(sock)
        try:
            hello, self._session_key = client_handshake(
                ch, token_key(token), {"transports": local_transports(), "transport_caps": local_capabilities()},
                connect_timeout)
            caps = field(hello, "capabilities", dict)
            peer = field(caps, "transports", list)
            self.transport = choose(transport, [t for t in peer if isinstance(t, str)],
                                    field(caps, "transport_caps", dict, optional=True) or {})
        except BaseException:
            ch.close()
            raise
        self._channel = ch

    @property
    def closed(self) -> bool:
        return self._channel is None

    def ended_by_peer(self) -> bool:
        """Whether the receiver has ended this session between updates (it closed the connection, e.g. to
        serve another sender): then the next :meth:`send` would fail, and a new Sender is needed.  Does not
        block; a receiver says nothing between updates, so anything readable means the session is over."""
        ch = self._channel
        if ch is None:
            return True
        with self._lock:
            try:
                return connections.readable_now(ch.sock)
            except ProtocolError:       # closed here meanwhile
                return True

    def send(self, region: TensorRegion, verify: bool = False, progress: Progress | None = None,
             onward: Onward | None = None) -> TransferStats:
        """Send ``region`` (its manifest and payload) and wait for the receiver's ack.

        Parameters
        ----------
        region : TensorRegion
            The caller keeps it alive and unchanged until this returns.
        verify : bool
            Send per-tensor xxh3_64 checksums; the receiver checks them.
        progress : callable, optional
            Called with byte counts as data goes out (from stream threads).
        onward : Onward, optional
            Internal (:mod:`tensorxfer.fanout`): the receiver forwards to these further hops.

        Raises
        ------
        PeerLost
            The receiver died or closed the session.
        TransferTimeout
            The receiver stopped reading for ``stall_timeout`` seconds.
        ManifestError
            The receiver refused the offer (e.g. over its size limit).
        ChecksumMismatch
            ``verify`` found a tensor that arrived corrupted (``.tensor``).
        TransferError
            The session is closed, or broken by an earlier failure.
        """
        with self._lock:
            ch = self._channel
            if ch is None:
                raise TransferError(f"this Sender is closed{': ' + self._broken if self._broken else ''}; "
                                    f"open a new one")
            try:
                return self._send(ch, region, verify, progress, onward)
            except BaseException as e:
                self._broken = f"an earlier transfer failed ({type(e).__name__})"
                self.close()
                raise

    def _wire_manifest(self, manifest: Manifest) -> tuple[bytes, bytes]:
        """The packed manifest and its digest, kept while the (immutable) manifest is the same object."""
        last = self._last_manifest
        if last is None or last[0] is not manifest:
            packed = manifest.pack()
            last = self._last_manifest = (manifest, packed, packed_digest(packed))
        return last[1], last[2]

    def _send(self, ch: Channel, region: TensorRegion, verify: bool, progress: Progress | None,
              onward: Onward | None = None) -> TransferStats:
        t0 = time.perf_counter()
        self._seq += 1
        seq = self._seq
        relayed = onward is not None and onward.checksums is not None   # the region may still be landing
        checksums = ([ALGORITHM, np.array(tensor_checksums(region), dtype="<u8").tobytes()]
                     if verify and not relayed else None)
        packed, digest = self._wire_manifest(region.manifest)
        version = onward.version if onward is not None else Version(seq, digest)
        extra: dict[str, Any] = {"chain": onward.chain, "chain_transport": onward.transport} \
            if onward is not None and onward.chain else {}
        if relayed:
            extra["relayed"] = True     # the receiver learns a repaired chain may send this update again
        transport = self._transports.get(self.transport)
        if transport is None:
            ctx = _context(ch, self._session_key, self.stall_timeout, self.streams)
            transport = self._transports[self.transport] = TRANSPORTS[self.transport][0](ctx)
        ch.send("offer", seq=seq, manifest=packed, transport=self.transport,
                streams=self.streams, verify=verify, fresh=transport.needs_setup(region),
                version=version.as_wire(), **extra)
        # Control waits get at least CONTROL_TIMEOUT: a short data stall timeout must not make a busy
        # receiver's allocation (before accept) or verification (before ack) look like a stall.  The
        # receiver commits its region before accepting (MAP_POPULATE), which on fresh memory can run at
        # ~180 MB/s (measured on a 2-vCPU VM), so the accept wait also grows with the region.
        alloc_allowance = region.nbytes / ALLOCATION_FLOOR_BYTES_PER_S
        accept = ch.recv("accept", timeout=max(self.stall_timeout, CONTROL_TIMEOUT) + alloc_allowance)
        if field(accept, "seq", int) != seq or field(accept, "transport", str) != self.transport:
            raise ProtocolError(f"accept does not match offer {seq} over {self.transport!r}: {accept.get('seq')}, "
                                f"{accept.get('transport')!r}")
        descriptors = field(accept, "descriptors", dict)
        setup = setup_flag(descriptors)
        registered = transport.counters.registrations
        t1 = time.perf_counter()
        transport.connect(region, seq, descriptors)
        t2 = time.perf_counter()
        hook = _attach_forward(transport, onward, region.nbytes)
        try:
            nbytes = transport.send(region, progress)
        finally:
            if hook is not None:
                setattr(transport, hook, None)
        wire = time.perf_counter() - t2
        last_byte = t2 + wire - t0
        if onward is not None and onward.checksums is not None:
            checksums = onward.checksums()
        setup = setup or transport.counters.registrations > registered    # ipc: handles passed with the data
        ch.send("done", seq=seq, bytes=nbytes, checksums=checksums)
        # While the receiver verifies and runs its on_landed (the CLI writes the files) it sends "wait"
        # frames: each resets the stall wait, so only a receiver that stopped answering times out early.
        # The whole wait is still bounded (hashing at >= 1 GB/s, writing at >= 100 MB/s, plus a minute,
        # plus, for a fan-out, what the rest of the chain may take), so a receiver whose on_landed hangs
        # cannot hold this sender forever.
        limit = max(self.stall_timeout, CONTROL_TIMEOUT)
        waited_from = time.monotonic()
        give_up = waited_from + limit + 60.0 + nbytes / ALLOCATION_FLOOR_BYTES_PER_S \
            + (nbytes / 1e9 if verify else 0.0) + (onward.ack_allowance if onward is not None else 0.0)
        while True:
            left = give_up - time.monotonic()
            if left <= 0:
                raise TransferTimeout(f"the receiver kept working on transfer {seq} past {give_up - waited_from:.0f} s "
                                      f"without acknowledging it (its on_landed may hang)")
            ack = ch.recv("ack", "wait", timeout=min(limit, left))
            if ack["type"] == "ack":
                break
        if field(ack, "seq", int) != seq or field(ack, "bytes", int) != nbytes:
            raise ProtocolError(f"ack does not match transfer {seq} of {nbytes} bytes")
        if onward is not None:
            onward.acked(ack)
        receiver_setup = accept.get("setup_seconds")
        setup_seconds = (t2 - t1) + (receiver_setup if isinstance(receiver_setup, float) else 0.0)
        return TransferStats(nbytes, time.perf_counter() - t0, self.transport,
                             field(descriptors, "streams", int, optional=True) or 0, verified=verify,
                             reallocated=bool(accept.get("reallocated")), update=seq, setup=setup,
                             setup_seconds=setup_seconds if setup else 0.0, wire_seconds=wire,
                             registration=transport.registration, counters=transport.counters.as_dict(),
                             last_byte_seconds=last_byte)

    def close(self) -> None:
        """Say goodbye (best effort) and close the session and its transports; idempotent.

        From another thread it ends a :meth:`send` in flight (with :class:`PeerLost` or
        :class:`TransferError`): no goodbye then, the control connection is shut down, which wakes it.
        """
        idle = self._lock.acquire(blocking=False)   # False: a send() is in flight (in another thread, or failing)
        try:
            transports, self._transports = self._transports, {}
            for transport in transports.values():
                transport.close()
            ch, self._channel = self._channel, None
            if ch is None:
                return
            if idle and self._broken is None:
                try:
                    ch.sock.settimeout(1.0)
                    ch.send("bye")
                except TensorXferError:
                    pass   # the receiver is already gone; closing is all that is left
            else:
                try:
                    ch.sock.shutdown(socket.SHUT_RDWR)  # closing alone does not wake a thread blocked on it
                except (OSError, ProtocolError):
                    pass    # already reset or closed: nothing to wake
            ch.close()
        finally:
            if idle:
                self._lock.release()

    def __enter__(self) -> Sender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Sender {'closed' if self.closed else self._channel.peer if self._channel else ''}>"
