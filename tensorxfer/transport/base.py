"""The transport interface: how a data path plugs into the engine.

The engine (:mod:`tensorxfer.session`) owns the control channel — hello,
authentication, offer, accept, done, ack — and hands the data movement to a
transport.  A transport lives as long as one session (one Sender and its
Receiver) and one region: it is set up on the first update, reused by every
later update of the same region, and closed when the session ends, the
region changes, or the peer is lost.  Setup is where the expensive work is
(rdma: registering the MR, connecting QPs; ipc: exporting and importing the
memory handles; tcp: connecting the streams), so update 100 pays only for
moving data.  Each half counts what it did in :class:`Counters`, so tests and
users can see that.

- :class:`ReceiverTransport` — :meth:`~ReceiverTransport.prepare` gets the
  region the update lands in and returns *descriptors*: a msgpack-able dict
  the engine puts into the ``accept`` frame.  ``descriptors["setup"]`` says
  whether this update sets the data path up (then it also carries what the
  sender needs: a port and nonce, QP numbers and an rkey, a socket path) or
  reuses the one set up before.  :meth:`~ReceiverTransport.wait` blocks
  until every byte of the update has landed.
- :class:`SenderTransport` — :meth:`~SenderTransport.connect` sets up (or
  checks it may reuse) the data path from those descriptors,
  :meth:`~SenderTransport.send` moves the region's payload bytes
  ``[0, region.nbytes)``.

Both halves are used from plain threads and must be safe to ``close()``
twice and from another thread (that is how the engine aborts a stuck
transfer).  Errors are the engine's: :class:`~tensorxfer.errors.PeerLost`,
:class:`~tensorxfer.errors.TransferTimeout` (nothing moved for
``stall_timeout`` seconds), :class:`~tensorxfer.errors.ProtocolError`.  A
failed update ends the session.  The one exception: a transport with ``can_resume`` whose ``resumable``
hook is set for an update reports broken streams as :class:`~tensorxfer.errors.LinkDropped` (the
others finish), and the session may reconnect them within that update
(:meth:`ReceiverTransport.prepare_resume`, :meth:`ReceiverTransport.wait_resume`,
:meth:`SenderTransport.resume`; :mod:`tensorxfer.session.recovery` drives them).

Hooks a fan-out relay fills (declared here, set by the session around one
update, never discovered): a receiving half reports every range that landed
to :attr:`ReceiverTransport.on_piece`; a sending half whose region is still
landing from upstream gets a :class:`Landing` in
:attr:`SenderTransport.landing` and sends only what it says has landed (tcp
waits for each piece, ipc and rdma follow the landed prefix).  A transport
that cannot (``follows_landing`` false) is given the region only once all
of it landed.

A transport registers itself in :data:`tensorxfer.transport.TRANSPORTS`;
``available()`` says why it cannot run here (``None`` when it can), so
``transport="auto"`` can explain its choice and a forced transport can raise
:class:`~tensorxfer.errors.TransportUnavailable` with the reason.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar

from tensorxfer.errors import LinkDropped, PeerLost, ProtocolError

if TYPE_CHECKING:
    from tensorxfer.manifest import Manifest
    from tensorxfer.region import TensorRegion
    from tensorxfer.transport.segments import Segments

Progress = Callable[[int], None]
"""Called with a byte count each time that many more bytes moved (from any thread)."""

MAX_STREAMS = 64
"""The most parallel streams (tcp connections, rdma QPs) a session may ask for."""


class Landing(Protocol):
    """A region that is still landing from upstream while it is sent on (a fan-out relay's own copy).

    Both calls block until the bytes are there and raise
    :class:`~tensorxfer.errors.UpstreamFailed` when the relay's own update failed (or nothing new
    landed for longer than its stall timeout).
    """

    def wait_range(self, offset: int, length: int) -> None:
        """Return once ``[offset, offset+length)`` landed."""

    def wait_prefix(self, after: int) -> int:
        """Return once the bytes landed from offset 0 reach past ``after``; return where they end."""


@dataclass(frozen=True)
class TransferContext:
    """What both halves of a transport know about their session.

    Attributes
    ----------
    local_host, peer_host : str
        The two ends of the control connection: a receiver binds its data
        listeners on ``local_host``, a sender connects data paths to
        ``peer_host``.
    session_key : bytes
        Secret shared by the two authenticated ends of this session (derived
        from the token and both hello nonces); transports prove data
        connections with it so a stranger cannot inject bytes.
    stall_timeout : float
        Seconds without progress after which a transfer fails with
        :class:`~tensorxfer.errors.TransferTimeout`.
    streams : int or None
        The sender's requested parallelism (``None``: the transport's default).
    control_lost : callable, optional
        Whether the peer's control connection is gone (closed or reset); the
        session provides it so a setup wait notices a dead peer at once.
    """

    local_host: str
    peer_host: str
    session_key: bytes
    stall_timeout: float
    streams: int | None = None
    control_lost: Callable[[], bool] | None = None

    def setup_abort(self, name: str, closing: Callable[[], bool]) -> Callable[[], str | None]:
        """The ``abort`` of a receiver's wait for the sender's data connections
        (:meth:`~tensorxfer.connections.Gate.admit`): the transport closing ends it with
        :class:`~tensorxfer.errors.TransferError`, the sender's control connection gone with
        :class:`~tensorxfer.errors.PeerLost` -- a sender that died after its offer is noticed within
        50 ms, not after ``stall_timeout``, and the receiver is free for the next one."""
        def check() -> str | None:
            if closing():
                return f"{name}: the transport was closed (the transfer was aborted)"
            if self.control_lost is not None and self.control_lost():
                raise PeerLost(f"{name}: the sender closed its control connection before its data path connected")
            return None
        return check


@dataclass
class Counters:
    """What a transport did over its life (one session): the proof that warm updates move only data.

    ``registrations``: regions registered with a NIC (rdma) or handle sets
    exported (ipc sender) / imported (ipc receiver); ``connects``: data paths
    connected (tcp streams, QP sets, Unix sockets); ``updates``: updates moved.
    """

    registrations: int = 0
    connects: int = 0
    updates: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"registrations": self.registrations, "connects": self.connects, "updates": self.updates}


class _Half(ABC):
    name: ClassVar[str]

    def __init__(self, ctx: TransferContext) -> None:
        self.ctx = ctx
        self.counters = Counters()
        self.registration = ""      # how the region was registered ("reg_dmabuf_mr", "reg_mr"); "" when nothing is

    @classmethod
    def available(cls) -> str | None:
        """``None`` if this transport can run here, else the reason it cannot."""
        return None

    @abstractmethod
    def close(self) -> None:
        """Release everything; idempotent, callable from another thread."""

    def __enter__(self: _H) -> _H:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_H = TypeVar("_H", bound=_Half)


class ReceiverTransport(_Half):
    """The receiving half of a data path (one per session and transport).

    ``on_piece`` (hook): when set, called with ``(region offset, length)`` of every range once its bytes
    are in the region (device copies: finished, not queued), from the transport's threads, so a fan-out
    relay can forward it before the whole update landed.  Set before :meth:`prepare`.

    ``on_files`` (hook; ipc): when set, an update whose sender passes its *files* rather than memory (a
    sender on this host whose region is its model files mapped, chunk table kind ``files``) is handed to it as
    ``on_files(files, report)``: ``files`` the ``(region offset, length, fd)`` of each file (the fds valid
    during the call; read them through the kernel only -- ``copy_file_range``, ``pread`` -- never mapped: a
    file cut short would raise SIGBUS), ``report(n)`` to call as bytes are copied.  It copies the bytes
    where they go (``tensorxfer-recv``: into its output files, one copy, as ``cp`` does) and raises if it
    cannot; the region is then *not* written.  The session sets it (``Receiver.receive(on_files=...)``) only
    where nothing reads the region afterwards: a host region, no checksums to check, no relay forwarding
    it, no module bound; unset, the files are read into the region.

    ``meanwhile`` (hook): when set, :meth:`wait` calls it once, in its own thread, when the data is on its
    way and this end has nothing left to do but wait for it (ipc: the device copies queued; tcp: the
    streams receiving), so the receiver's own per-update work overlaps with the data.  A transport that
    never waits like that does not call it.
    """

    on_piece: Callable[[int, int], None] | None = None
    on_files: Callable[[Sequence[tuple[int, int, int]], Callable[[int], None]], None] | None = None
    meanwhile: Callable[[], None] | None = None
    can_resume: ClassVar[bool] = False
    resumable: bool = False     # hook: this update may resume (set by the session before wait())

    @abstractmethod
    def prepare(self, region: TensorRegion, seq: int, fresh: bool, segments: Segments | None = None) -> dict[str, Any]:
        """Get ready to receive update ``seq`` into ``region``; return msgpack-able descriptors for ``accept``.

        Sets the data path up (``descriptors["setup"]`` true) when ``fresh`` (the sender asked for it), on the
        first update, or when ``region`` is not the region the current setup serves; else reuses it.
        ``segments``: the update moves these runs (a weight sync's), not ``[0, nbytes)``; a transport that
        cannot raises :class:`~tensorxfer.errors.TransportUnavailable`.
        """

    @abstractmethod
    def wait(self, progress: Progress | None = None) -> int:
        """Block until every payload byte of the prepared update landed; return the byte count.

        Raises
        ------
        PeerLost, TransferTimeout, ProtocolError
        """

    def prepare_resume(self, dropped: LinkDropped) -> dict[str, Any]:
        """Where ``can_resume``: get ready for new connections replacing the streams ``dropped`` names (it
        came from :meth:`wait` or :meth:`wait_resume` of this update); return msgpack-able descriptors for
        the ``resume`` frame -- where to connect and, per broken stream, how many of its bytes landed."""
        raise NotImplementedError(f"{type(self).__name__} cannot resume an update")

    def wait_resume(self, progress: Progress | None = None) -> int:
        """Admit the replacement streams and receive the rest of their shares; return the bytes received.

        Raises
        ------
        LinkDropped
            A replacement stream broke too (its ``landed`` counts on from the first try).
        TransferTimeout
            The sender did not reconnect in time.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot resume an update")


class ShareReceiverTransport(_Half):
    """A receiving half that maps the sender's memory instead of copying it (``Receiver(share=True)``).

    :meth:`prepare_share` gets the offer's manifest (nothing is allocated), :meth:`wait` blocks until the
    sender's memory is mapped, :meth:`take_shared` hands that memory over as a region.
    """

    on_piece: Callable[[int, int], None] | None = None     # never called: a shared update lands at once

    @abstractmethod
    def prepare_share(self, manifest: Manifest, device: str, seq: int, fresh: bool,
                      previous: TensorRegion | None = None) -> dict[str, Any]:
        """Get ready to map update ``seq`` (``previous``: the region the last shared update returned, reused
        when the sender passes the same memory); return descriptors for ``accept``."""

    @abstractmethod
    def wait(self, progress: Progress | None = None) -> int:
        """Block until the sender's memory for the prepared update is mapped; return the byte count."""

    @abstractmethod
    def take_shared(self) -> TensorRegion:
        """The region backed by the sender's memory (now the caller's to close)."""


class SenderTransport(_Half):
    """The sending half of a data path (one per session and transport).

    ``landing`` (hook): when set for one :meth:`send`, the region is still landing from upstream and
    only what ``landing`` says has landed may be sent (see :class:`Landing`).  ``follows_landing`` says
    whether this transport honours it; the session gives a transport that does not the region only
    once all of it landed.  ``posts_early`` says whether a warm update's data may go out before the
    receiver's accept (:meth:`post_early`).
    """

    follows_landing: ClassVar[bool] = False
    posts_early: ClassVar[bool] = False
    landing: Landing | None = None
    can_resume: ClassVar[bool] = False
    resumable: bool = False     # hook: this update may resume (set by the session around send())

    @classmethod
    def capabilities(cls) -> dict[str, Any]:
        """What this side offers in ``hello`` (msgpack-able)."""
        return {}

    @classmethod
    def peer_reason(cls, peer_caps: dict[str, Any] | None) -> str | None:
        """Why the peer that advertised ``peer_caps`` (its :meth:`capabilities`) cannot be reached this way.

        ``None`` when it can (ipc: the peer is on this host, as this user).
        """
        return None

    @classmethod
    def forward_piece_bytes(cls, region: TensorRegion, streams: int | None = None) -> int:
        """The piece a fan-out relay forwarding ``region`` over this transport waits for before passing it on
        (the chain's delay per hop; ``streams``: the session's): the whole region where the transport stores and
        forwards."""
        return region.nbytes

    @abstractmethod
    def needs_setup(self, region: TensorRegion) -> bool:
        """Whether sending ``region`` needs a new setup (nothing set up yet, or set up for other memory)."""

    @abstractmethod
    def connect(self, region: TensorRegion, seq: int, descriptors: dict[str, Any],
                segments: Segments | None = None) -> None:
        """Set up the data path for ``region`` from the receiver's descriptors, or check the current one serves.
        ``segments``: the update moves these runs (the receiver plans the same ones), not the whole region.

        Raises
        ------
        ProtocolError
            The descriptors are malformed, or say "reuse" when nothing here can be reused.
        PeerLost
            The receiver cannot be reached.
        """

    @abstractmethod
    def send(self, region: TensorRegion, progress: Progress | None = None) -> int:
        """Move ``region``'s payload as update ``seq`` (given to :meth:`connect`); return the byte count.

        Raises
        ------
        PeerLost, TransferTimeout
        """

    def resume(self, region: TensorRegion, descriptors: dict[str, Any],
               progress: Progress | None = None) -> tuple[int, int]:
        """Where ``can_resume``: after :meth:`send` raised :class:`~tensorxfer.errors.LinkDropped`, reconnect
        the streams the receiver's ``resume`` descriptors name and send each from where it landed.
        Return ``(bytes sent, bytes sent again)``: the second counts what had been sent before the break.

        Raises
        ------
        LinkDropped
            A replacement stream broke too.
        ProtocolError
            The descriptors name a stream or an offset this update does not have.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot resume an update")

    def post_early(self, region: TensorRegion, seq: int, segments: Segments | None = None) -> int:
        """Where ``posts_early``: start update ``seq`` of ``region`` (``segments``: only these runs, as for
        :meth:`connect`) right behind its offer, before the accept (only when :meth:`needs_setup` is false and
        the region is complete); return the bytes it will move.
        The receiver takes the data once it accepted; a refusal ends the session, and the data with it.
        :meth:`collect` finishes the update.  This saves a warm update the wait for the accept (ipc: the
        chunk table needs nothing from it)."""
        raise NotImplementedError(f"{type(self).__name__} does not post early")

    def collect(self, progress: Progress | None = None) -> int:
        """Finish what :meth:`post_early` started; return the byte count (raises as :meth:`send`)."""
        raise NotImplementedError(f"{type(self).__name__} does not post early")


def setup_flag(descriptors: dict[str, Any]) -> bool:
    """``descriptors["setup"]``, checked (a receiver must always say)."""
    value = descriptors.get("setup")
    if not isinstance(value, bool):
        raise ProtocolError("accept descriptors must say whether this update sets the data path up ('setup')")
    return value


class PrefixFollower:
    """A fan-out relay's forward: follows its own copy's landed prefix and passes each new end on.

    A relay's sender may send only what already landed in the relay's region.  ``ready_after(offset)``
    (:meth:`Landing.wait_prefix`) blocks until the landed prefix reaches past ``offset``
    and returns its end; a thread calls it from ``start`` on and gives each new end to ``publish``
    (ipc: a watermark message to the receiver; rdma: the nogil write loop's gate).  ``sent`` is the last
    end published and ``since`` when (a receiver that took all it may is waiting for the relay, not
    stalled).  A failure -- :class:`~tensorxfer.errors.UpstreamFailed` when the relay's own update fails
    -- ends the thread: it is kept in ``error`` and given to ``on_error`` unless the forward was stopped.
    """

    def __init__(self, start: int, nbytes: int, ready_after: Callable[[int], int], publish: Callable[[int], None],
                 name: str, on_error: Callable[[BaseException], None] | None = None) -> None:
        self.sent = start
        self.since = time.monotonic()
        self.error: BaseException | None = None
        self._stopped = False
        self._thread = threading.Thread(target=self._run, args=(nbytes, ready_after, publish, on_error), name=name,
                                        daemon=True)
        self._thread.start()

    def _run(self, nbytes: int, ready_after: Callable[[int], int], publish: Callable[[int], None],
             on_error: Callable[[BaseException], None] | None) -> None:
        try:
            while self.sent < nbytes and not self._stopped:
                end = min(ready_after(self.sent), nbytes)
                if self._stopped:
                    return
                publish(end)
                self.since = time.monotonic()
                self.sent = end
        except BaseException as e:
            self.error = e
            if on_error is not None and not self._stopped:
                on_error(e)

    def join(self) -> None:
        """Wait for the last end to be published (call once the receiver has all of it)."""
        self._thread.join()

    def stop(self) -> None:
        """The forward ended (done or failed): publish nothing more.  Not joined: the thread may wait in
        ``ready_after`` until the relay's copy moves or aborts; it holds nothing of its own."""
        self._stopped = True
