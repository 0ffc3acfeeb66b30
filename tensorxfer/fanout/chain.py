"""A chain of receivers, seen from one place in it (the origin or a relay): :class:`Chain`.

:class:`Chain` keeps one session to the next hop across updates and sends each update to it, naming
the rest of the chain in the offer (:class:`~tensorxfer.session.ForwardHooks`); a hop that fails is
taken out and the next one tried.  :class:`Landed` tracks which ranges of a relay's own update are in
its region (the relay's send follows it), and :class:`ReceiverResult` is one receiver's outcome, as
every ack carries them back up the chain.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tensorxfer.errors import ProtocolError, TensorXferError, UpstreamFailed
from tensorxfer.protocol import MAX_CHAIN, Version
from tensorxfer.session import ForwardHooks, Sender, TransferStats
from tensorxfer.transport import TRANSPORTS

if TYPE_CHECKING:
    from tensorxfer.region import TensorRegion

log = logging.getLogger(__name__)

ORIGIN = "sender"       # ReceiverResult.via for the first hop


@dataclass(frozen=True)
class ReceiverResult:
    """One receiver's outcome in a fan-out: what it got and from whom, or why it was taken out."""

    address: str
    ok: bool
    bytes: int = 0
    seconds: float = 0.0
    transport: str = ""
    verified: bool = False
    via: str = ""               # the hop that fed it (ORIGIN for the first)
    error_type: str = ""        # e.g. "PeerLost", "TransferTimeout"
    error: str = ""
    lag_seconds: float = 0.0    # its last byte after its feeder had the whole update (see slowest_hop)

    def as_dict(self) -> dict[str, Any]:
        return {"address": self.address, "ok": self.ok, "bytes": self.bytes, "seconds": self.seconds,
                "transport": self.transport, "verified": self.verified, "via": self.via,
                "error_type": self.error_type, "error": self.error, "lag_seconds": self.lag_seconds}

    @classmethod
    def from_wire(cls, value: Any) -> ReceiverResult:
        if not isinstance(value, dict) or not isinstance(value.get("address"), str) \
                or not isinstance(value.get("ok"), bool):
            raise ProtocolError("ack: a relayed result must have 'address' and 'ok'")

        def get(name: str, kind: type, default: Any) -> Any:
            v = value.get(name, default)
            if kind is float and isinstance(v, int):
                v = float(v)
            if not isinstance(v, kind):
                raise ProtocolError(f"ack: relayed result field {name!r} must be {kind.__name__}")
            return v
        return cls(value["address"], value["ok"], get("bytes", int, 0), get("seconds", float, 0.0),
                   get("transport", str, ""), get("verified", bool, False), get("via", str, ""),
                   get("error_type", str, ""), get("error", str, ""), get("lag_seconds", float, 0.0))


class Landed:
    """Which byte ranges of the update being received are in the region (fed from stream threads)."""

    def __init__(self, nbytes: int, stall_timeout: float) -> None:
        self.nbytes = nbytes
        self.stall_timeout = stall_timeout
        self._cond = threading.Condition()
        self._by_start: dict[int, int] = {}     # disjoint landed intervals, merged as they touch
        self._by_end: dict[int, int] = {}
        self._all = False
        self.completed_at: float | None = None     # perf_counter() when every byte had landed
        self.aborted: str | None = None

    def add(self, offset: int, length: int) -> None:
        if length <= 0:
            return
        with self._cond:
            start, end = offset, offset + length
            if start in self._by_end:
                start = self._by_end.pop(start)
                del self._by_start[start]
            if end in self._by_start:
                end2 = self._by_start.pop(end)
                del self._by_end[end2]
                end = end2
            self._by_start[start], self._by_end[end] = end, start
            self._cond.notify_all()

    def add_all(self) -> None:
        with self._cond:
            if not self._all:
                self.completed_at = time.perf_counter()
            self._all = True
            self._cond.notify_all()

    def abort(self, why: str) -> None:
        with self._cond:
            if self.aborted is None:
                self.aborted = why
            self._cond.notify_all()

    def _has(self, offset: int, end: int) -> bool:
        return self._all or any(s <= offset and end <= e for s, e in self._by_start.items())

    def _prefix(self) -> int:
        return self.nbytes if self._all else self._by_start.get(0, 0)

    def _wait(self, ready: Callable[[], bool], offset: int) -> None:
        """Wait (holding the condition) until ``ready()``; raise when aborted or nothing lands for long."""
        while not ready():
            if self.aborted is not None:
                raise UpstreamFailed(f"relay: the upstream transfer failed ({self.aborted}); forwarding stopped")
            # Longer than the stall timeout: a stalled upstream fails this relay's own receive first
            # (and aborts), so the next hop is not blamed for it.
            if not self._cond.wait(1.5 * self.stall_timeout + 1.0):
                raise UpstreamFailed(f"relay: no new bytes from upstream for {1.5 * self.stall_timeout + 1.0} s "
                                     f"(waiting for region offset {offset})")
        if self.aborted is not None:
            raise UpstreamFailed(f"relay: the upstream transfer failed ({self.aborted}); forwarding stopped")

    def wait_range(self, offset: int, length: int) -> None:
        """Block until ``[offset, offset+length)`` landed (tcp: a relay's stream thread, before each piece).

        Raises
        ------
        UpstreamFailed
            The upstream transfer failed (the relay aborted), or nothing new landed for 1.5 x
            ``stall_timeout`` seconds.
        """
        end = offset + length
        with self._cond:
            self._wait(lambda: self._has(offset, end), offset)

    def wait_prefix(self, after: int) -> int:
        """Block until the bytes landed from offset 0 on reach past ``after``; return where they end.

        ipc: a relay's receiver copies in pieces (several threads: they may land out of order), and the
        next hop may copy only what is contiguous from 0 (its watermark).  Every piece that lands while
        the caller forwards the last answer is covered by the next one (one message for several pieces).

        Raises
        ------
        UpstreamFailed
            As :meth:`wait_range`.
        """
        with self._cond:
            self._wait(lambda: self._prefix() > after, after)
            return self._prefix()


class _Relayed:
    """The results of the hops after one receiver, from its ack."""

    def __init__(self, chain: list[str]) -> None:
        self.chain = chain
        self.results: list[ReceiverResult] = []

    def acked(self, ack: dict[str, Any]) -> None:
        value = ack.get("relayed", [])
        if not isinstance(value, list) or len(value) > MAX_CHAIN:
            raise ProtocolError("ack: 'relayed' must be a list of results")
        self.results = [ReceiverResult.from_wire(v) for v in value]
        named = [r.address for r in self.results]
        if sorted(named) != sorted(self.chain):
            raise ProtocolError(f"ack: relayed results name {named}, the chain was {self.chain}")


def chain_allowance(hops: int, nbytes: int, stall_timeout: float) -> float:
    """Extra seconds an ack may take when ``hops`` receivers come after the one acknowledging:
    each may fail after a stall (then the next gets the whole update again)."""
    return hops * (2 * stall_timeout + 10.0 + nbytes / 100e6)


class Chain:
    """Sessions from one place (the origin or a relay) to the next hop, kept across updates.

    ``send`` tries the first target with the rest as its chain; a target that fails is named and the
    next one is tried with the rest after it.
    """

    def __init__(self, token: str | bytes | None, transport: str, streams: int | None,
                 stall_timeout: float, connect_timeout: float, origin: str) -> None:
        self.token = token
        self.transport = transport
        self.streams = streams
        self.stall_timeout = stall_timeout
        self.connect_timeout = connect_timeout
        self.origin = origin
        self._sessions: dict[str, Sender] = {}

    def _session(self, address: str) -> Sender:
        for other in [a for a in self._sessions if a != address]:
            self._drop(other)           # one session per hop: a hop no longer next is released first
        sender = self._sessions.get(address)
        if sender is not None and sender.ended_by_peer():
            self._drop(address)         # the receiver ended it while idle (the chain's order changed)
            sender = None
        if sender is None or sender.closed:
            sender = Sender(address, token=self.token, transport=self.transport, streams=self.streams,
                            stall_timeout=self.stall_timeout, connect_timeout=self.connect_timeout)
            self._sessions[address] = sender
        return sender

    def _drop(self, address: str) -> None:
        sender = self._sessions.pop(address, None)
        if sender is not None:
            sender.close()

    def send(self, region: TensorRegion, targets: Sequence[str], version: Version, verify: bool,
             progress: Any = None, landed: Landed | None = None,
             checksums: Callable[[], Any] | None = None) -> tuple[list[ReceiverResult], TransferStats | None]:
        """Deliver ``region`` to every target (through the chain); one result per target.

        Raises only when ``landed`` was aborted (this relay's own update failed: nothing to repair).
        """
        results: list[ReceiverResult] = []
        head: TransferStats | None = None
        for i, address in enumerate(targets):
            rest = list(targets[i + 1:])
            relayed = _Relayed(rest)
            forward = ForwardHooks(version, rest, self.transport, landed, checksums,
                                   chain_allowance(len(rest), region.nbytes, self.stall_timeout), relayed.acked)
            t0 = time.perf_counter()
            try:
                sender = self._session(address)
                started = time.perf_counter()
                head = sender.send(region, verify=verify, progress=progress if i == 0 else None, forward=forward)
            except (TensorXferError, OSError) as e:
                self._drop(address)
                if isinstance(e, UpstreamFailed) or (landed is not None and landed.aborted is not None):
                    raise       # this relay's own update failed: the next hop is not to blame
                log.warning("fan-out: %s taken out of the chain (%s: %s)%s", address, type(e).__name__, e,
                            f"; sending to {rest[0]} instead" if rest else "")
                results.append(ReceiverResult(address, False, seconds=time.perf_counter() - t0, via=self.origin,
                                              error_type=type(e).__name__, error=str(e)))
                continue
            # The lag on this hop's clock: its last byte after this hop had the whole update (a relay: once its
            # own copy landed; the origin: from the start).
            last_byte = started + head.last_byte_seconds
            lag = head.last_byte_seconds if landed is None else max(0.0, last_byte - (landed.completed_at or last_byte))
            results.append(ReceiverResult(address, True, head.bytes, head.seconds, head.transport, head.verified,
                                          via=self.origin, lag_seconds=lag))
            results.extend(relayed.results)
            return results, head
        return results, head

    def close(self) -> None:
        for address in list(self._sessions):
            self._drop(address)


def forward_piece_bytes(head: TransferStats | None, region: TensorRegion) -> int:
    """The piece relays forwarded in over the transport the first hop used (0: no hop succeeded)."""
    if head is None or head.transport not in TRANSPORTS:
        return 0
    return TRANSPORTS[head.transport][0].forward_piece_bytes(region, head.streams)
