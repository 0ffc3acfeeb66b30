"""What one update of a session did (:class:`TransferStats`), and the one place both ends build it."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tensorxfer.session.recovery import Recovery
    from tensorxfer.transport.base import Counters


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
    shows which hop held the others back.  ``retries``, ``resent_bytes`` and
    ``recovery_seconds`` say what recovering broken data streams within the
    update cost (:mod:`tensorxfer.session.recovery`): reconnect rounds, the
    bytes the sender sent twice (0 on a receiver: it never takes a landed
    byte again), and the seconds the resume rounds took (from the first round,
    once every stream that held had finished, to the last byte).
    ``kept_bytes``: tensor bytes that did not move because the receiver
    already held them, confirmed by the sender (a resumed
    ``tensorxfer-send``: :mod:`tensorxfer.session.partial`); ``bytes`` is
    then what moved.
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
    retries: int = 0
    resent_bytes: int = 0
    recovery_seconds: float = 0.0
    kept_bytes: int = 0

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
                "counters": dict(self.counters), "last_byte_seconds": self.last_byte_seconds,
                "retries": self.retries, "resent_bytes": self.resent_bytes, "recovery_seconds": self.recovery_seconds,
                "kept_bytes": self.kept_bytes}


class UpdateClock:
    """The times of one update, from the offer on: both ends turn them into :class:`TransferStats` here.

    ``setup_seconds`` is what setting the data path up cost (each end adds its part), :meth:`wire` times
    the bytes moving, and the last byte is when that ended.
    """

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.setup_seconds = 0.0
        self.wire_seconds = 0.0
        self.last_byte_seconds = 0.0

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    @contextmanager
    def wire(self, since: float | None = None) -> Iterator[None]:
        """Time the block as the bytes moving (sent, or waited for until landed); ``since``: they began to
        move earlier (a ``perf_counter`` time: data posted before the accept)."""
        t = time.perf_counter() if since is None else since
        yield
        end = time.perf_counter()
        self.wire_seconds = end - t
        self.last_byte_seconds = end - self.start

    def stats(self, nbytes: int, transport: str, streams: int, counters: Counters, registration: str = "", *,
              verified: bool, reallocated: bool, update: int, setup: bool,
              recovery: Recovery | None = None, kept_bytes: int = 0) -> TransferStats:
        """The update's :class:`TransferStats`, with the transport's counters as they are now (and what
        ``recovery`` did, if anything)."""
        return TransferStats(nbytes, self.elapsed(), transport, streams, verified=verified, reallocated=reallocated,
                             update=update, setup=setup, setup_seconds=self.setup_seconds if setup else 0.0,
                             wire_seconds=self.wire_seconds, registration=registration, counters=counters.as_dict(),
                             last_byte_seconds=self.last_byte_seconds,
                             retries=recovery.retries if recovery else 0,
                             resent_bytes=recovery.resent_bytes if recovery else 0,
                             recovery_seconds=recovery.seconds if recovery else 0.0, kept_bytes=kept_bytes)
