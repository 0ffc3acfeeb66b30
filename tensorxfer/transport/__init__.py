"""Data paths, and the choice between them.

Each transport implements :mod:`tensorxfer.transport.base` and is listed in
:data:`TRANSPORTS` by name.  :func:`choose` picks one for a transfer:
``"auto"`` takes the first of :data:`AUTO_ORDER` that both ends support and
that can run here, logging at INFO what it chose and why the faster ones were
skipped; a forced name that cannot run raises
:class:`~tensorxfer.errors.TransportUnavailable` — never a silent fallback.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Iterable, Mapping
from types import ModuleType
from typing import Any

from tensorxfer.errors import TransportUnavailable


def __getattr__(name: str) -> ModuleType:
    """Import the optional native ``_verbs`` module on ``from tensorxfer.transport import _verbs``.

    Without this hook, where the module was not built (no libibverbs-dev,
    or ``TENSORXFER_NO_VERBS=1``) that import inside ``rdma.py`` — which runs
    while this package is still initializing — failed with "cannot import
    name '_verbs' from partially initialized module ... (most likely due to
    a circular import)", hiding the real reason.  Importing the submodule
    by its full name raises ``ModuleNotFoundError: No module named
    'tensorxfer.transport._verbs'`` instead, which is what callers report.
    """
    if name == "_verbs":
        return importlib.import_module(f"{__name__}._verbs")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# After the hook: rdma.py's import of _verbs, run by these imports, needs it.
from tensorxfer.transport.base import (  # noqa: E402
    ReceiverTransport,
    SenderTransport,
    ShareReceiverTransport,
    TransferContext,
)
from tensorxfer.transport.ipc import IpcReceiver, IpcSender, IpcShareReceiver  # noqa: E402
from tensorxfer.transport.rdma_engine import RdmaReceiver, RdmaSender  # noqa: E402
from tensorxfer.transport.tcp import TcpReceiver, TcpSender  # noqa: E402

log = logging.getLogger(__name__)

TRANSPORTS: dict[str, tuple[type[SenderTransport], type[ReceiverTransport]]] = {
    "ipc": (IpcSender, IpcReceiver),
    "rdma": (RdmaSender, RdmaReceiver),
    "tcp": (TcpSender, TcpReceiver),
}
"""name -> (sender half, receiver half); ``available()`` says when one cannot run here (rdma: no device)."""

SHARE_RECEIVERS: dict[str, type[ShareReceiverTransport]] = {"ipc": IpcShareReceiver}
"""name -> the receiving half that maps the sender's memory instead of copying (``Receiver(share=True)``)."""

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


def local_capabilities(share: bool = False) -> dict[str, Any]:
    """Per-transport capability maps of this side, for ``hello`` (e.g. ipc's host identity); ``share``: of a
    sharing receiver, which maps memory handles and so takes no sender's files (ipc's ``files``)."""
    out = {name: caps for name in local_transports() if (caps := TRANSPORTS[name][0].capabilities())}
    if share and "ipc" in out:
        out["ipc"] = {k: v for k, v in out["ipc"].items() if k != "files"}
    return out


def peer_reasons(peer_caps: Mapping[str, Any]) -> dict[str, str]:
    """Why transports the peer offers still cannot connect the two ends (ipc on another host)."""
    out = {}
    for name in local_transports():
        caps = peer_caps.get(name)
        reason = TRANSPORTS[name][0].peer_reason(caps if isinstance(caps, dict) else None)
        if reason:
            out[name] = reason
    return out


def choose(requested: str, peer_supports: Iterable[str], peer_caps: Mapping[str, Any] | None = None) -> str:
    """The transport for one transfer, given what the receiver supports.

    ``peer_caps`` is the receiver's per-transport capability map
    (:func:`local_capabilities` on its side); a transport whose
    :meth:`~SenderTransport.peer_reason` objects is not usable (ipc with a
    receiver on another host).  ``auto`` logs its pick at INFO and each
    faster transport it skipped, with the reason, at WARNING.

    Raises
    ------
    TransportUnavailable
        A forced transport that this side or the peer cannot run, or no
        common transport at all.
    """
    peer = set(peer_supports)
    blocked = peer_reasons(peer_caps or {}) if peer_caps is not None else {}
    if requested != "auto":
        check_requested(requested)
        if requested not in peer:
            raise TransportUnavailable(f"transport {requested!r} was requested but the receiver does not support "
                                       f"it (it offers {sorted(peer)})")
        if requested in blocked:
            raise TransportUnavailable(f"transport {requested!r} was requested but cannot reach the receiver: "
                                       f"{blocked[requested]}")
        return requested
    skipped: list[str] = []
    for name in AUTO_ORDER:
        reason = unavailable_reason(name) or (None if name in peer else "the receiver does not offer it") \
            or blocked.get(name)
        if reason is None:
            why = f"; skipped {', '.join(skipped)}" if skipped else ""
            log.info("transport auto: chose %r (first usable of %s%s)", name, "/".join(AUTO_ORDER), why)
            return name
        log.warning("transport auto: %r not usable: %s", name, reason)
        skipped.append(f"{name} ({reason})")
    raise TransportUnavailable(f"no transport usable by both ends: {'; '.join(skipped)}")


__all__ = ["AUTO_ORDER", "SHARE_RECEIVERS", "TRANSPORTS", "ReceiverTransport", "SenderTransport",
           "ShareReceiverTransport", "TransferContext", "choose",
           "local_capabilities", "local_transports", "peer_reasons"]
