"""Data paths, and the choice between them.

Each transport implements :mod:`tensorxfer.transport.base` and is listed in
:data:`TRANSPORTS` by name.  :func:`choose` picks one for a transfer:
``"auto"`` takes the first of :data:`AUTO_ORDER` that both ends support and
that can run here, logging at INFO what it chose and why the faster ones were
skipped; a forced name that cannot run raises
:class:`~tensorxfer.errors.TransportUnavailable` — never a silent fallback.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from tensorxfer.errors import TransportUnavailable
from tensorxfer.transport.base import ReceiverTransport, SenderTransport, TransferContext
from tensorxfer.transport.tcp import TcpReceiver, TcpSender

log = logging.getLogger(__name__)

TRANSPORTS: dict[str, tuple[type[SenderTransport], type[ReceiverTransport]]] = {
    "tcp": (TcpSender, TcpReceiver),
}
"""name -> (sender half, receiver half).  ``ipc`` and ``rdma`` register here when built."""

AUTO_ORDER = ("ipc", "rdma", "tcp")
"""Preference of ``transport="auto"``: fastest first."""

KNOWN = frozenset(AUTO_ORDER)


def local_transports() -> list[str]:
    """Names of the transports that can run on this machine."""
    return [name for name, (s, r) in TRANSPORTS.items() if s.available() is None and r.available() is None]


def unavailable_reason(name: str) -> str | None:
    """Why ``name`` cannot run here (``None`` if it can)."""
    if name not in TRANSPORTS:
        return f"the {name!r} transport is not part of this build of tensorxfer"
    sender, receiver = TRANSPORTS[name]
    return sender.available() or receiver.available()


def check_requested(requested: str) -> None:
    """Validate a transport name on the sender before connecting.

    Raises
    ------
    ValueError
        Not ``"auto"`` or a known transport name.
    TransportUnavailable
        A forced transport cannot run here (the message says why).
    """
    if requested != "auto" and requested not in KNOWN:
        raise ValueError(f"transport must be 'auto' or one of {sorted(KNOWN)}, got {requested!r}")
    if requested != "auto":
        reason = unavailable_reason(requested)
        if reason:
            raise TransportUnavailable(f"transport {requested!r} was requested but cannot run: {reason}")


def choose(requested: str, peer_supports: Iterable[str]) -> str:
    """The transport for one transfer, given what the receiver supports.

    Raises
    ------
    TransportUnavailable
        A forced transport that this side or the peer cannot run, or no
        common transport at all.
    """
    peer = set(peer_supports)
    if requested != "auto":
        check_requested(requested)
        if requested not in peer:
            raise TransportUnavailable(f"transport {requested!r} was requested but the receiver does not support "
                                       f"it (it offers {sorted(peer)})")
        return requested
    skipped: list[str] = []
    for name in AUTO_ORDER:
        reason = unavailable_reason(name) or (None if name in peer else "the receiver does not offer it")
        if reason is None:
            why = f"; skipped {', '.join(skipped)}" if skipped else ""
            log.info("transport auto: chose %r (first usable of %s%s)", name, "/".join(AUTO_ORDER), why)
            return name
        skipped.append(f"{name} ({reason})")
    raise TransportUnavailable(f"no transport usable by both ends: {'; '.join(skipped)}")


__all__ = ["AUTO_ORDER", "TRANSPORTS", "ReceiverTransport", "SenderTransport", "TransferContext", "choose",
           "local_transports"]
