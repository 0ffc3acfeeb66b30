"""The transport interface: how a data path plugs into the engine.

The engine (:mod:`tensorxfer.session`) owns the control channel — hello,
authentication, offer, accept, done, ack — and hands the data movement to a
transport.  A transport has two halves:

- :class:`ReceiverTransport` — :meth:`~ReceiverTransport.prepare` gets the
  region the offer will land in and returns *descriptors*: a msgpack-able
  dict the engine puts into the ``accept`` frame (TCP: a stream port and a
  nonce; RDMA: address, rkey and QP info of one MR over the region; IPC: a
  Unix socket path).  :meth:`~ReceiverTransport.wait` blocks until every
  byte has landed, :meth:`~ReceiverTransport.close` releases what
  ``prepare`` set up.
- :class:`SenderTransport` — :meth:`~SenderTransport.connect` uses those
  descriptors, :meth:`~SenderTransport.send` moves the region's payload
  bytes ``[0, region.nbytes)``, :meth:`~SenderTransport.close` releases.

Both halves are created per transfer with a :class:`TransferContext`, are
used from plain threads, and must be safe to ``close()`` twice and from
another thread (that is how the engine aborts a stuck transfer).  Errors are
the engine's: :class:`~tensorxfer.errors.PeerLost`,
:class:`~tensorxfer.errors.TransferTimeout` (nothing moved for
``stall_timeout`` seconds), :class:`~tensorxfer.errors.ProtocolError`.

A transport registers itself in :data:`tensorxfer.transport.TRANSPORTS`;
``available()`` says why it cannot run here (``None`` when it can), so
``transport="auto"`` can explain its choice and a forced transport can raise
:class:`~tensorxfer.errors.TransportUnavailable` with the reason.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from tensorxfer.region import TensorRegion

Progress = Callable[[int], None]
"""Called with a byte count each time that many more bytes moved (from any thread)."""


@dataclass(frozen=True)
class TransferContext:
    """What both halves of a transport know about one transfer.

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
    transfer_id : int
        The offer's sequence number in the session.
    stall_timeout : float
        Seconds without progress after which a transfer fails with
        :class:`~tensorxfer.errors.TransferTimeout`.
    streams : int or None
        The sender's requested parallelism (``None``: the transport's default).
    session_state : dict
        Scratch space that lives as long as the receiver's session (the same
        dict for every transfer of one sender): transports keep what can be
        reused by the next update there (ipc: the mapping of the sender's
        handles).  When the session ends the engine calls ``close()`` on every
        value that has one.
    """

    local_host: str
    peer_host: str
    session_key: bytes
    transfer_id: int
    stall_timeout: float
    streams: int | None = None
    session_state: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)


class ReceiverTransport(ABC):
    """The receiving half of a data path (one per transfer)."""

    name: ClassVar[str]

    def __init__(self, ctx: TransferContext) -> None:
        self.ctx = ctx

    @classmethod
    def available(cls) -> str | None:
        """``None`` if this transport can run here, else the reason it cannot."""
        return None

    @abstractmethod
    def prepare(self, region: TensorRegion) -> dict[str, Any]:
        """Get ready to receive into ``region``; return msgpack-able descriptors for ``accept``."""

    @abstractmethod
    def wait(self, progress: Progress | None = None) -> int:
        """Block until every payload byte landed; return the byte count.

        Raises
        ------
        PeerLost, TransferTimeout, ProtocolError
        """

    @abstractmethod
    def close(self) -> None:
        """Release every resource ``prepare`` created; idempotent, callable from another thread."""

    def __enter__(self) -> ReceiverTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SenderTransport(ABC):
    """The sending half of a data path (one per transfer)."""

    name: ClassVar[str]

    def __init__(self, ctx: TransferContext) -> None:
        self.ctx = ctx

    @classmethod
    def available(cls) -> str | None:
        """``None`` if this transport can run here, else the reason it cannot."""
        return None

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

    @abstractmethod
    def connect(self, descriptors: dict[str, Any]) -> None:
        """Set up the data path from the receiver's ``accept`` descriptors.

        Raises
        ------
        ProtocolError
            The descriptors are malformed.
        PeerLost
            The receiver cannot be reached.
        """

    @abstractmethod
    def send(self, region: TensorRegion, progress: Progress | None = None) -> int:
        """Move ``region``'s payload; return the byte count once every byte is out.

        Raises
        ------
        PeerLost, TransferTimeout
        """

    @abstractmethod
    def close(self) -> None:
        """Release everything ``connect`` created; idempotent, callable from another thread."""

    def __enter__(self) -> SenderTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
