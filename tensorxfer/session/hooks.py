"""What a session offers the layers above it: forward hooks on the send side, a forwarder on the receive side.

The session knows nothing of chains.  A fan-out (:mod:`tensorxfer.fanout`) turns a plain send into one
hop of a chain by filling :class:`ForwardHooks`, and lets a receiver pass each update on while it lands
by implementing :class:`Forwarder`; the session calls them at fixed points of its update sequence.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from tensorxfer.protocol import Version
    from tensorxfer.region import TensorRegion
    from tensorxfer.transport.base import Landing


@dataclass
class ForwardHooks:
    """What turns one :meth:`~tensorxfer.session.Sender.send` into a hop of a fan-out.

    Attributes
    ----------
    version : Version, optional
        The update this is (the origin's); ``None``: the Sender numbers its own updates.
    chain, chain_transport
        The receivers after the one this send goes to, and how they choose their transport (the
        origin's request: ``"auto"`` or a name); offered to the receiver, which forwards to them.
    landing : Landing, optional
        Set by a relay: the region is still landing from upstream; only what landed is sent.  The
        ``done`` frame then carries ``checksums()`` (the origin's, passed on) instead of checksums
        computed here.  Also set, with ``loading``, by a sender whose own region is still being read
        from files (``tensorxfer-send``): the checksums are then computed once the payload went out.
    loading : bool
        ``landing`` is this process's own loader, not an upstream hop (the send is no relay).
    checksums : callable, optional
        Called at ``done`` time for a relayed send.
    ack_allowance : float
        Extra seconds the ack may take (the rest of the chain finishing).
    on_ack : callable, optional
        Called with the ``ack`` frame (it carries the results of the hops after the receiver).
    """

    version: Version | None = None
    chain: Sequence[str] = ()
    chain_transport: str = "auto"
    landing: Landing | None = None
    checksums: Callable[[], Any] | None = None
    ack_allowance: float = 0.0
    on_ack: Callable[[dict[str, Any]], None] | None = None
    loading: bool = False

    @property
    def relayed(self) -> bool:
        """Whether this send passes on an update still landing here from upstream (a relay's)."""
        return self.landing is not None and not self.loading


class ForwardJob(Protocol):
    """One update a receiver forwards while it lands (created by :meth:`Forwarder.start`)."""

    def on_piece(self, offset: int, length: int) -> None:
        """``[offset, offset+length)`` of the update landed in the region (from transport threads)."""

    def all_landed(self) -> None:
        """Every byte of the update landed."""

    def complete(self, checksums: Any) -> None:
        """Every byte landed and the sender said ``done`` (with these checksums, passed on as they came)."""

    def abort(self, why: str) -> None:
        """This receiver's own update failed: stop forwarding it."""

    def finish(self) -> list[dict[str, Any]]:
        """Wait for the rest of the chain; the results to put into this receiver's ack."""


class Forwarder(Protocol):
    """Where a receiver's forwarding comes from (a fan-out relay); lives as long as the receiver."""

    def start(self, region: TensorRegion, chain: list[str], version: Version, verify: bool, transport: str,
              streams: int | None, me: str) -> ForwardJob:
        """Begin forwarding the update landing in ``region`` to ``chain`` (``me``: this receiver's address)."""

    def close(self) -> None:
        """Release the onward sessions; idempotent."""
