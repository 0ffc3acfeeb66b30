"""The receiving end: :class:`Receiver` listens, admits senders one after another, and keeps the region.

What outlives one sender lives here: the listener and its :class:`~tensorxfer.connections.Gate`
(connections authenticated concurrently, strangers dropped and counted), the yield policy (an idle
session gives way to a sender that waits), the :class:`~tensorxfer.session.targets.RegionSlot`, the
version the region holds and the last stats.  What ends with a sender is its
:class:`~tensorxfer.session.server.ServerSession`.
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from tensorxfer import connections
from tensorxfer.binding import Names
from tensorxfer.connections import Gate
from tensorxfer.errors import PeerLost, ProtocolError, TensorXferError, TransferError, TransferTimeout
from tensorxfer.manifest import Manifest, default_max_region_bytes
from tensorxfer.protocol import Channel, Version, parse_address, server_handshake, token_key
from tensorxfer.region import TensorRegion, parse_device
from tensorxfer.session import control
from tensorxfer.session.hooks import Forwarder
from tensorxfer.session.partial import Holder
from tensorxfer.session.recovery import DEFAULT_POLICY, RecoveryPolicy
from tensorxfer.session.server import OnFiles, OnLanded, OnPiece, ServerSession, State
from tensorxfer.session.stats import TransferStats
from tensorxfer.session.targets import CopyTarget, RegionSlot, ShareTarget, Target
from tensorxfer.transport import SHARE_RECEIVERS, TRANSPORTS, local_capabilities, local_transports
from tensorxfer.transport.base import Progress, TransferContext

log = logging.getLogger(__name__)


class Receiver:
    """Listens for senders and receives their regions.

    Parameters
    ----------
    listen : str
        ``HOST:PORT`` to bind (port 0 picks a free one; see :attr:`address`).
    token : str or bytes, optional
        Shared secret; senders must present the same one (without one, only token-less senders get in).
    device : str
        Where received regions live (``"cpu"``, ``"cuda:N"``).
    max_region_bytes : int, optional
        Larger offers are refused before anything is allocated (default: half the memory the region lives in).
    stall_timeout, recovery : float, RecoveryPolicy or None
        Seconds without progress before a stream fails (:class:`TransferTimeout`); how often and how long a broken
        tcp stream is resumed within its update (:mod:`tensorxfer.session.recovery`; ``None``: never).
    share : bool
        Same host only (``ipc``): the region *is* the sender's memory (hosts: copy-on-write, SharedWeightsWarning).
    forwarder : Forwarder, optional
        Passes updates on to the receivers an offer's chain names (:mod:`tensorxfer.fanout` fills it;
        without one, chains are refused with ``no_forward`` as the reason).
    require_verify : bool
        Refuse offers sent without per-tensor checksums (``send(verify=True)``), before any byte moves.
    prefault : bool
        Commit a new host region's pages before accepting (a clear ``MemoryError`` up front).  ``False``:
        the receiving threads commit them as data lands (a one-shot receive: ``tensorxfer-recv``).
    private_memory : bool
        Host regions in this process's own memory (:meth:`HostRegion.allocate` ``private``): cheaper to fill
        and free, not sendable over ipc (a relay's stays shareable).

    Raises
    ------
    ValueError
        A malformed address or device.
    OSError
        The address cannot be bound.
    """

    def __init__(self, listen: str | tuple[str, int] = "127.0.0.1:0", token: str | bytes | None = None,
                 device: str = "cpu", max_region_bytes: int | None = None,
                 stall_timeout: float = control.DEFAULT_STALL_TIMEOUT,
                 handshake_timeout: float = control.DEFAULT_HANDSHAKE_TIMEOUT, share: bool = False,
                 forwarder: Forwarder | None = None, no_forward: str = "this receiver does not relay",
                 require_verify: bool = False, prefault: bool = True, private_memory: bool = False,
                 recovery: RecoveryPolicy | None = DEFAULT_POLICY) -> None:
        parse_device(device)
        host, port = parse_address(listen)
        self.share = bool(share)
        self.device = device
        self.max_region_bytes = default_max_region_bytes(device) if max_region_bytes is None else int(max_region_bytes)
        self.stall_timeout, self.handshake_timeout = control.seconds(stall_timeout=stall_timeout,
                                                                     handshake_timeout=handshake_timeout)
        self._token = token
        self._forwarder = None if self.share else forwarder
        self._no_forward = "this receiver does not relay (share=True)" if self.share else no_forward
        self.require_verify, self.recovery = bool(require_verify), recovery
        self._slot = RegionSlot(device, prefault, private_memory)
        self._version: Version | None = None
        self._fed_by_relay = False
        self._session: ServerSession | None = None
        self.last_stats: TransferStats | None = None
        self._lock, self._closing, self._dropped_at_close = threading.Lock(), False, 0
        self._admission: Admission | None = Admission(host, port, token_key(token), self._capabilities,
                                                      self.handshake_timeout)

    # ------------------------------------------------------------ what it holds
    @property
    def address(self) -> tuple[str, int]:
        """``(host, port)`` this receiver listens on."""
        return tuple(self._door().gate.address[:2])

    @property
    def closed(self) -> bool:
        return self._admission is None

    @property
    def token(self) -> str | bytes | None:
        """The shared secret this receiver authenticates senders with (a warm peer sends on with it)."""
        return self._token

    @property
    def dropped_connections(self) -> int:
        """Connections dropped before they became a session (strangers, wrong tokens, port scans)."""
        door = self._admission
        return door.gate.dropped if door is not None else self._dropped_at_close

    @property
    def version(self) -> Version | None:
        """The update :attr:`region` holds completely (landed, verified if asked); ``None`` while one is being
        written or after a failed one."""
        return self._version

    @property
    def fed_by_relay(self) -> bool:
        """Whether the last offer came from a fan-out relay rather than from its origin.  When such an update
        fails because the relay died or stalled, the hop before the relay sends it again over the repaired
        chain: a caller waiting for one update should keep receiving (``tensorxfer-recv --once`` does)."""
        return self._fed_by_relay

    @property
    def region(self) -> TensorRegion | None:
        """The region the last transfer landed in (reused for the next same-layout offer)."""
        return self._slot.region

    @contextmanager
    def lend(self) -> Iterator[tuple[TensorRegion, Version]]:
        """The complete update held, with this receiver's lock held: no ``receive()`` writes the region until
        the block is left (``with rx.lend() as (region, version): ...``; a warm peer sends it on).

        Raises
        ------
        TransferError
            No complete version is held (nothing received yet, or the last update failed or is in flight).
        """
        with self._lock:
            region, version = self._slot.region, self._version
            if region is None or region.closed or version is None:
                raise TransferError("this receiver holds no complete update to lend (nothing received yet, or "
                                    "the last update failed)")
            yield region, version

    # ------------------------------------------------------------ receiving
    def receive(self, timeout: float | None = None, progress: Progress | None = None,
                on_offer: Callable[[Manifest], None] | None = None, on_landed: OnLanded | None = None,
                into: Any = None, names: Names = None, on_piece: OnPiece | None = None,
                held: Holder | None = None, on_files: OnFiles | None = None) -> TensorRegion:
        """Wait for the next offer (from the current sender, or the next one) and receive it.

        ``timeout`` bounds the wait for an offer to *start* (``None``: forever; then ``stall_timeout``);
        ``progress`` gets byte counts as data lands; ``on_offer`` the validated manifest before data moves;
        ``on_piece(region, offset, length)`` ranges of a host region as they land (from transport threads:
        quick, never writing the region; ``tensorxfer-recv`` writes files then); ``on_landed`` the region
        once every byte landed (and was verified), *before* the ack -- if it raises, the sender gets an
        error naming it instead.  ``held``: pieces already here, not sent again (:mod:`~.session.partial`);
        ``on_files``: :attr:`~tensorxfer.transport.base.ReceiverTransport.on_files`.

        Returns the region, owned by the receiver, valid until the next ``receive`` or ``close`` (same-layout
        offers overwrite it in place).  A fan-out relay returns once its own copy is complete and checked, and
        acks its sender once the rest of its chain finished (the next ``receive()``, :meth:`wait_relayed` or
        :meth:`close` waits for that): do not write into the region meanwhile.

        ``into`` (a ``torch.nn.Module``): the update lands in the module's own tensors, which become views
        of the received region (no copy; later updates land in place; with ``share=True`` views of the
        sender's memory).  The offer must fit the module exactly (``state_dict`` names, or ``names``:
        :data:`~tensorxfer.binding.Names`; None leaves a tensor out), else it is refused before any byte
        moves (:class:`~tensorxfer.errors.LayoutError`); a failed update leaves weights partly written.

        A failure ends the session, not the receiver; :meth:`close` ends a blocked ``receive`` (TransferError).

        Raises
        ------
        TransferTimeout
            No offer within ``timeout`` (naming a sender that came and left without one), or the sender
            stalled mid-transfer.
        AuthError, ProtocolError
            A sender presented the wrong token, or spoke something else.
        ManifestError, PeerLost, ChecksumMismatch
            The offer was malformed or over ``max_region_bytes`` (refused before allocating); the sender died
            mid-transfer; ``verify`` was requested and a tensor's data differs.
        TransportUnavailable, CudaError, LayoutError
            The offer asked for a transport or a region this receiver cannot have, or does not fit the module
            given as ``into`` (the sender is told).
        """
        with self._lock:
            deadline = None if timeout is None else time.monotonic() + timeout
            self._slot.bind(into, names, copies_files=on_files is not None)
            self._settle(deadline)
            left: list[str] = []            # senders that came and went without an offer, for the timeout's message
            while True:
                with _naming(left):
                    session = self._session or self._admit(deadline)
                try:
                    frame = self._door().next_frame(session, deadline, self._fed_by_relay, self._check_open)
                except TransferTimeout:
                    if session.channel.desynced:     # timed out mid-frame: the stream is unusable
                        self._end_session()
                    raise TransferTimeout(f"no offer within {timeout} s") from None
                except PeerLost:
                    self._end_session()
                    self._check_open()       # close() from another thread wakes us this way
                    log.info("sender %s ended its session", session.peer)
                    left.append(f"{session.peer} connected and left")
                    continue
                except TensorXferError:
                    self._end_session()
                    raise
                if frame is None or frame["type"] == "bye":     # yielded to a waiting sender, or goodbye
                    self._end_session()
                    left += [f"{session.peer} connected and said goodbye"] if frame is not None else []
                    continue
                try:
                    return self._update(session, frame, progress, (on_offer, on_landed, on_piece, held, on_files))
                except BaseException as e:
                    # After a failed transfer the control stream's state is unknown: end the session.
                    self._end_session()
                    if self._closing and not isinstance(e, KeyboardInterrupt):
                        raise TransferError(f"this Receiver was closed during the transfer ({e})") from e
                    raise

    def _update(self, session: ServerSession, frame: dict[str, Any], progress: Progress | None,
                hooks: tuple) -> TensorRegion:
        """One update; ``hooks``: receive()'s, in :meth:`ServerSession.run_update`'s order."""
        self._fed_by_relay = frame.get("relayed") is True
        self._version = None            # the region is about to be written: no complete version in it
        offer = session.offer(frame, self.max_region_bytes)
        target: Target = ShareTarget(self._slot) if self.share else CopyTarget(self._slot)
        region, self.last_stats = session.run_update(offer, target, "{}:{}".format(*self.address), progress, *hooks)
        self._version = offer.version
        return region

    def _admit(self, deadline: float | None) -> ServerSession:
        ch, key = self._door().admit(deadline, lambda: self._closing)
        self._session = ServerSession(ch, key, self.stall_timeout, self._make_transport, self._unavailable,
                                      self._forwarder, self._no_forward, self.require_verify, self.recovery)
        log.info("session with sender %s", ch.peer)
        return self._session

    def _capabilities(self) -> dict[str, Any]:
        """What this receiver offers in its hello (asked anew for each connection)."""
        names = [t for t in local_transports() if t in SHARE_RECEIVERS or not self.share]
        return {"transports": names, "device": self.device, "transport_caps": local_capabilities(self.share)}

    def _make_transport(self, name: str, ctx: TransferContext) -> Any:
        return SHARE_RECEIVERS[name](ctx) if self.share else TRANSPORTS[name][1](ctx)

    def _unavailable(self, name: str) -> str | None:
        if self.share and name not in SHARE_RECEIVERS:
            return f"share=True needs {'/'.join(SHARE_RECEIVERS)}"
        return None if name in local_transports() else f"it has {local_transports()}"

    def _settle(self, deadline: float | None) -> None:
        session = self._session
        if session is not None and session.state is State.ACKING:
            session.settle_ack(deadline)
            if session.state is State.CLOSED:
                self._session = None

    def wait_relayed(self, timeout: float | None = None) -> None:
        """Wait until the last update this receiver relayed was acked to its sender (its chain finished); a
        no-op when it relayed nothing.  Call it (or :meth:`close`) before exiting after a last update.

        Raises
        ------
        TransferTimeout
            The chain had not finished within ``timeout`` seconds.
        """
        with self._lock:
            self._settle(None if timeout is None else time.monotonic() + timeout)

    def _check_open(self) -> None:
        if self._closing:
            raise TransferError("this Receiver was closed (from another thread); receive() ended")

    def _door(self) -> Admission:
        if self._admission is None:
            raise TransferError("this Receiver is closed")
        return self._admission

    def _end_session(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            session.close()

    # ------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Close the session, the listener and the region; idempotent.

        A relay first lets its last update's ack out (:meth:`wait_relayed`).  From another thread it also
        ends a blocked :meth:`receive` with :class:`TransferError`.
        """
        session = self._session
        if session is not None and session.state is State.ACKING and not self._closing:
            session.join_ack()      # the hops after this one get their update (bounded by the chain's allowances)
        self._closing = True
        door, self._admission = self._admission, None
        if door is not None:
            self._dropped_at_close = door.gate.dropped
            door.close()
        if session is not None:
            try:
                session.channel.sock.shutdown(socket.SHUT_RDWR)     # wakes a receive() blocked on the channel
            except (OSError, ProtocolError):
                pass    # already closed: nothing to wake
            session.close_transports()                          # wakes a receive() blocked in a transfer
        with self._lock:                                        # the receive() in flight, if any, has ended
            self._end_session()
            self._slot.release()
        forwarder, self._forwarder = self._forwarder, None
        if forwarder is not None:
            forwarder.close()

    def __enter__(self) -> Receiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Receiver {'closed' if self.closed else '{}:{}'.format(*self.address)}>"


class Admission:
    """Admits senders: the listener, each connection's hello and authentication (concurrently, in the
    :class:`~tensorxfer.connections.Gate`), and the policy by which an idle session yields to a sender that
    waits."""

    def __init__(self, host: str, port: int, key: bytes | None, capabilities: Callable[[], dict[str, Any]],
                 handshake_timeout: float) -> None:
        self._key = key
        self._caps = capabilities
        self.handshake_timeout = handshake_timeout
        self.gate = Gate(connections.listen(host, port=port), self._handshake, handshake_timeout, "control")
        # A doorman answers hellos while no receive() runs (a Sender made before the first receive(), or
        # between two), so a sender's handshake never waits on the application's loop.
        self._stop = threading.Event()
        self._doorman = threading.Thread(target=self._pump, name="tensorxfer-doorman", daemon=True)
        self._doorman.start()

    def _pump(self) -> None:
        while not self._stop.is_set():
            try:
                self.gate.pump(0.05)
            except (OSError, TransferError):
                if self._stop.is_set():
                    return
                self._stop.wait(0.05)      # a transient accept error: the next turn tries again

    def close(self) -> None:
        """Stop answering and close the listener (proven connections not yet admitted are closed too)."""
        self._stop.set()
        self.gate.close()
        self._doorman.join()

    def _handshake(self, sock: socket.socket) -> tuple[Channel, bytes]:
        """Hello + authentication of a new connection (in the gate's thread for it; it bounds the time)."""
        ch = Channel(sock)
        _, key = server_handshake(ch, self._key, self._caps(), self.handshake_timeout)
        return ch, key

    def admit(self, deadline: float | None, closing: Callable[[], bool]) -> tuple[Channel, bytes]:
        """The next authenticated sender's channel and session key.

        Raises
        ------
        TransferTimeout
            None connected by ``deadline`` (the message counts the connections dropped meanwhile).
        """
        try:
            [(_, (ch, key))] = self.gate.admit(1, timeout=control.remaining(deadline),
                                               abort=lambda: "this Receiver was closed" if closing() else None)
        except TransferTimeout:
            gate = self.gate
            why = f" ({gate.dropped} connection(s) dropped, last: {gate.last_drop})" if gate.dropped else ""
            raise TransferTimeout(f"no sender connected within the timeout{why}") from None
        return ch, key

    def next_frame(self, session: ServerSession, deadline: float | None, from_relay: bool,
                   check_open: Callable[[], None]) -> dict[str, Any] | None:
        """The session's next offer or bye; None when the session yields to a sender that waits.

        One session is served at a time, so an idle one would lock every other sender out (a token-less
        stranger needs only to say hello).  While waiting, the gate keeps proving new connections; once one
        is waiting and this session has been idle for ``handshake_timeout`` (fed by a relay: at once -- the
        chain's order is the origin's to change), it yields.  A single sender (a trainer between steps) is
        never cut off.
        """
        gate = self.gate
        poller = select.poll()
        poller.register(session.channel.sock, select.POLLIN)
        poller.register(gate.fileno(), select.POLLIN)
        channel = session.channel.sock.fileno()
        while True:
            # Wake for whichever comes first, the session's next frame or a new connection: an offer is
            # noticed at once (a warm CUDA ipc update takes ~16 ms; a polling delay would show).
            events = dict(poller.poll(50))
            if events.get(channel):
                # A frame has begun: all of it must arrive within CONTROL_TIMEOUT (or the caller's deadline).
                limit = control.CONTROL_TIMEOUT
                if deadline is not None:
                    limit = max(1e-3, min(limit, deadline - time.monotonic()))
                return session.next_frame(limit)
            check_open()
            if deadline is not None and time.monotonic() >= deadline:
                raise TransferTimeout("no offer within the timeout")
            if gate.ready and (from_relay or session.idle_for() > self.handshake_timeout):
                log.warning("session with %s idle for %.0f s while another sender waits: ending it", session.peer,
                            session.idle_for())
                return None
            if events:
                gate.pump(1e-3)         # a connection is waiting: accept it and start proving it


@contextlib.contextmanager
def _naming(left: list[str]) -> Iterator[None]:
    """A wait for a sender that times out names the last one that came and went without an offer."""
    try:
        yield
    except TransferTimeout as e:
        if not left:
            raise
        raise TransferTimeout(f"{e}; before that, sender {left[-1]} without an offer (its side failed before it "
                              f"offered -- a BindingError, say -- or it was stopped)") from None
