"""Fan-out: one update to N receivers by chain pipelining.

:class:`FanoutSender` sends a region to a list of receivers ``[R1, ..., RN]``
by sending it to ``R1`` only, and telling ``R1`` (in the authenticated
``offer``) the rest of the chain.  ``R1`` opens its own session to ``R2``
(a plain :class:`~tensorxfer.session.Sender`, kept for as long as the chain
keeps that hop: connected and set up once) and *forwards bytes as they
land*: over tcp the receiving stream threads report every range that landed
(``TcpReceiver.on_piece``) and the forwarding stream threads wait for each
piece before sending it (``TcpSender.before_piece``), so ``R1`` sends piece
k-1 to ``R2`` while piece k arrives from the sender.  Over ipc the receiver
pulls: ``R1``'s copy reports each piece once its bytes are in the region
(``IpcReceiver.on_piece``; device pieces once the stream finished them),
and ``R1``'s sender raises ``R2``'s *watermark* as the contiguous landed
prefix grows (``IpcSender.ready_after`` over :meth:`Landed.wait_prefix`),
so ``R2`` copies piece k-1 from ``R1`` while ``R1`` copies piece k.  Over
rdma one-sided writes tell ``R1`` nothing until the last immediate per QP,
so ``R1``'s receiver asks its sender for *piece marks* (an immediate every
few requests per QP: ``RdmaReceiver.on_piece`` reports the contiguous
prefix they prove), and ``R1``'s sender posts no request past that prefix
(``RdmaSender.ready_after`` over :meth:`Landed.wait_prefix`, feeding the
nogil write loop's gate).  The total time is about one transfer plus (N-1)
pieces (:attr:`FanoutStats.piece_bytes`: ``tcp.FORWARD_PIECE_BYTES`` per
stream, ``ipc.RELAY_PIECE_BYTES`` / ``RELAY_CUDA_PIECE_BYTES``,
``rdma_engine.RELAY_PIECE_BYTES`` rounded to whole requests per QP), not N
transfers.  tcp for GPU regions forwards once the whole update landed
(store and forward: correct, not pipelined).

Trust: a receiver forwards only to the addresses the *authenticated* sender
named in its offer, with the token it was itself authenticated with, so the
next hop must share the token; a receiver without a token refuses to relay
unless built with ``Receiver(relay=True)``, and ``relay=False`` refuses
always.  A chain holds at most :data:`MAX_CHAIN` addresses, no duplicates.

Versions: every offer carries its :class:`Version` (the origin's update
number and the SHA-256 of the packed manifest); the receiver checks the
digest against the manifest it unpacked, clears :attr:`Receiver.version`
while a region is being written, and sets it only once every byte landed
(and verified, with ``verify``).  A relay sends ``done`` downstream (and so
lets the next hop acknowledge) only once every byte of its own copy landed
and its upstream said ``done``; with ``verify`` the ``done`` carries the
*origin's* checksums, so every hop checks its own copy against the source
(in parallel, not one hop after another).  A relay whose upstream fails
aborts its forward, so the next hop never acknowledges a half-written
version.

Failures: when a hop fails (killed: ``PeerLost``; stalled for
``stall_timeout``: ``TransferTimeout``; refused), the hop *before* it takes
it out of the chain and sends to the next address instead, with the rest of
the chain (pipelined from what has landed when it is a relay, whole when it
is the origin).  The failed receiver is named in the result with its error
type and message; the others complete.  A receiver downstream of the failed
one sees its own session end (its ``receive()`` raises) and receives the
update again over the repaired chain on its next ``receive()``.  The
:class:`FanoutSender` leaves failed receivers out of later updates
(:attr:`FanoutSender.chain`).

Slow receivers: the hop feeding a receiver measures, on its own clock, how
long after its own copy was complete that receiver's last byte went out or
landed (``ReceiverResult.lag_seconds``; the origin's copy is complete from
the start).  A receiver whose lag stands out while the ones after it follow
it closely is the one holding the chain back (:func:`slowest_hop`).
:class:`FanoutSender` names it (:attr:`FanoutStats.slow`, logged) and, once
it held the chain back :data:`SLOW_STRIKES` updates in a row, moves it to
the tail, where it delays no one else's bytes.  A relay's ``receive()``
returns as soon as its own copy is complete and checked; its ack, which
carries the results of the hops after it, goes out once they finished
(:meth:`~tensorxfer.session.Receiver.wait_relayed`).

Results: every hop's ``ack`` carries the results of the hops after it, so
:class:`FanoutStats` has one :class:`ReceiverResult` per receiver (bytes,
seconds, transport, verified, which hop fed it, or the error).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tensorxfer.errors import ProtocolError, TensorXferError, TransferError, UpstreamFailed
from tensorxfer.protocol import parse_address

if TYPE_CHECKING:
    from tensorxfer.manifest import Manifest
    from tensorxfer.region import TensorRegion
    from tensorxfer.session import Sender, TransferStats

log = logging.getLogger(__name__)

MAX_CHAIN = 64
ORIGIN = "sender"       # ReceiverResult.via for the first hop
# A receiver is moved only when that clearly pays: moving it sets its hop's sessions up again (rdma
# registers the region anew), and hops that share one resource (a host's CPUs or memory bus, the
# Soft-RoCE VM's two CPUs) make the first hop after the head lag by up to about the head's own time --
# the lag of a position, not of a receiver.  Measured there: 0.1-0.15 s lags at 4 MiB in the VM, flagged
# with the thresholds 0.5 / 0.05 s / 2 and churning the chain.
SLOW_LAG = 1.0          # a hop finishing more than the first hop's whole time after its feeder is slow
SLOW_MIN_LAG = 0.25     # seconds: a smaller lag is not worth setting sessions up again
SLOW_STRIKES = 3        # updates in a row a receiver must hold the chain back before it is moved


def manifest_digest(manifest: Manifest) -> bytes:
    """SHA-256 of the packed manifest: the layout half of a :class:`Version`."""
    return packed_digest(manifest.pack())


def packed_digest(packed: bytes) -> bytes:
    """:func:`manifest_digest` of the manifest whose ``pack()`` is ``packed`` (for a caller that has packed it)."""
    return hashlib.sha256(packed).digest()


@dataclass(frozen=True)
class Version:
    """Which update a region holds: the origin sender's update number and its manifest's digest."""

    update: int
    digest: bytes

    def as_wire(self) -> dict[str, Any]:
        return {"update": self.update, "digest": self.digest}

    @classmethod
    def from_wire(cls, value: Any) -> Version:
        if (not isinstance(value, dict) or not isinstance(value.get("update"), int) or value["update"] < 1
                or not isinstance(value.get("digest"), bytes) or len(value["digest"]) != 32):
            raise ProtocolError("offer: 'version' must be {update: int >= 1, digest: 32 bytes}")
        return cls(value["update"], value["digest"])


def parse_chain(value: Any) -> list[str]:
    """The ``chain`` of an offer, checked: a list of at most MAX_CHAIN distinct ``HOST:PORT`` strings."""
    if not isinstance(value, list) or len(value) > MAX_CHAIN or not all(isinstance(a, str) for a in value):
        raise ProtocolError(f"offer: 'chain' must be a list of at most {MAX_CHAIN} HOST:PORT strings")
    if len(set(value)) != len(value):
        raise ProtocolError("offer: 'chain' names an address twice")
    for address in value:
        try:
            parse_address(address)
        except ValueError as e:
            raise ProtocolError(f"offer: bad chain address {address!r}: {e}") from None
    return list(value)


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


def slowest_hop(results: Sequence[ReceiverResult]) -> tuple[ReceiverResult, float] | None:
    """The receiver that held a pipelined chain back and its lag in seconds, or None when no hop stands out.

    In a chain every receiver gets its bytes as fast as the slowest receiver before it, so a slow one
    shows as a *lag*: its last byte came long after its feeder had the whole update, while the receivers
    after it follow it closely.  Each lag is measured by the feeder on its own clock (``lag_seconds``);
    the first receiver's is its whole transfer.  A receiver after the first is slow when its lag is more
    than :data:`SLOW_LAG` of the first one's (and more than :data:`SLOW_MIN_LAG`) *and* more than twice
    every other lag after the first -- so a chain whose hops all contend for one memory bus (each lags
    about the same) has none.  The head of the chain has no lag to judge (the origin has the update
    from the start): a slow head is found only once it is not first.
    """
    ok = [r for r in results if r.ok]
    if len(ok) < 2:
        return None
    head, rest = ok[0], ok[1:]
    worst = max(rest, key=lambda r: r.lag_seconds)
    others = [r.lag_seconds for r in rest if r is not worst]
    if worst.lag_seconds > max(SLOW_MIN_LAG, SLOW_LAG * head.lag_seconds) \
            and all(worst.lag_seconds > 2 * other for other in others):
        return worst, worst.lag_seconds
    return None


@dataclass(frozen=True)
class FanoutStats:
    """What one fan-out update did: the chain order, the piece size, one :class:`ReceiverResult` each.

    ``piece_bytes``: the piece a relay waits for before passing it on over the transport the first hop
    used (the chain's delay per hop; the whole region where that transport stores and forwards; 0 when
    no hop succeeded).
    """

    bytes: int
    seconds: float
    version: Version
    chain: tuple[str, ...]
    piece_bytes: int
    receivers: tuple[ReceiverResult, ...]
    head: TransferStats | None = None          # the first successful hop's own stats
    slow: str = ""          # the receiver that held the chain back in this update (see FanoutSender)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.receivers)

    @property
    def failed(self) -> list[ReceiverResult]:
        return [r for r in self.receivers if not r.ok]

    @property
    def gbps(self) -> float:
        return self.bytes * 8 / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"bytes": self.bytes, "seconds": self.seconds, "gbps": self.gbps,
                "version": {"update": self.version.update, "digest": self.version.digest.hex()},
                "chain": list(self.chain), "piece_bytes": self.piece_bytes, "ok": self.ok,
                "receivers": [r.as_dict() for r in self.receivers], "slow": self.slow,
                "head": self.head.as_dict() if self.head is not None else None}


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


@dataclass
class Onward:
    """What a :class:`~tensorxfer.session.Sender` send needs to start the rest of a chain (internal).

    ``chain``: the addresses after the receiver this send goes to; ``before_piece``: blocks until a
    range is in the region (relays; the tcp hook); ``ready_after``: blocks until the landed prefix
    reaches past an offset and returns its end (relays; the ipc hook); ``checksums``: the done frame's
    checksums, called at done time (relays pass on their upstream's, only once their own copy is
    complete); ``relayed``: filled from the ack; ``transport``: how the next hops choose theirs (the
    origin's request, ``auto`` or a name).
    """

    chain: list[str]
    version: Version
    before_piece: Callable[[int, int], None] | None = None
    checksums: Callable[[], Any] | None = None
    ack_allowance: float = 0.0
    relayed: list[ReceiverResult] = field(default_factory=list)
    ready_after: Callable[[int], int] | None = None
    transport: str = "auto"

    def acked(self, ack: dict[str, Any]) -> None:
        value = ack.get("relayed", [])
        if not isinstance(value, list) or len(value) > MAX_CHAIN:
            raise ProtocolError("ack: 'relayed' must be a list of results")
        self.relayed = [ReceiverResult.from_wire(v) for v in value]
        named = [r.address for r in self.relayed]
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
        from tensorxfer.session import Sender

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
            onward = Onward(rest, version, landed.wait_range if landed is not None else None, checksums,
                            chain_allowance(len(rest), region.nbytes, self.stall_timeout),
                            ready_after=landed.wait_prefix if landed is not None else None, transport=self.transport)
            t0 = time.perf_counter()
            try:
                sender = self._session(address)
                started = time.perf_counter()
                head = sender.send(region, verify=verify, progress=progress if i == 0 else None, onward=onward)
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
            results.extend(onward.relayed)
            return results, head
        return results, head

    def close(self) -> None:
        for address in list(self._sessions):
            self._drop(address)


class RelayJob:
    """A receiver forwarding one update to the rest of its chain while it lands (in its own thread)."""

    def __init__(self, chain: Chain, region: TensorRegion, targets: list[str], version: Version,
                 verify: bool, stall_timeout: float) -> None:
        self.targets = targets
        self.landed = Landed(region.nbytes, stall_timeout)
        self._ready = threading.Event()
        self._checksums: Any = None
        self._wait_allowance = stall_timeout + 10.0 + region.nbytes / 1e9
        self.results: list[ReceiverResult] | None = None
        self.error: BaseException | None = None
        self._chain = chain
        self._thread = threading.Thread(target=self._run, args=(chain, region, version, verify),
                                        name="tensorxfer-relay", daemon=True)
        self._thread.start()

    def _run(self, chain: Chain, region: TensorRegion, version: Version, verify: bool) -> None:
        try:
            self.results, _ = chain.send(region, self.targets, version, verify, landed=self.landed,
                                         checksums=self._wait_checksums)
        except BaseException as e:
            self.error = e

    def _wait_checksums(self) -> Any:
        if not self._ready.wait(self._wait_allowance):
            raise UpstreamFailed("relay: the upstream update did not complete in time")
        if self.landed.aborted is not None:
            raise UpstreamFailed(f"relay: the upstream transfer failed ({self.landed.aborted})")
        return self._checksums

    def complete(self, checksums: Any) -> None:
        """Every byte of this relay's copy landed and upstream said done: the hop after it may finish."""
        self.landed.add_all()
        self._checksums = checksums
        self._ready.set()

    def finish(self) -> list[dict[str, Any]]:
        """Wait for the forward; the results to put into this relay's ack."""
        self._thread.join()
        if self.results is None:
            why = self.error if self.error is not None else TransferError("relay ended without a result")
            return [ReceiverResult(a, False, error_type=type(why).__name__, error=str(why)).as_dict()
                    for a in self.targets]
        return [r.as_dict() for r in self.results]

    def abort(self, why: str) -> None:
        """This relay's own update failed: stop forwarding (the next hop's session ends with it)."""
        self.landed.abort(why)
        self._ready.set()
        self._thread.join(timeout=1.0)
        if self._thread.is_alive():
            # Blocked in a control wait (connecting, waiting for accept): closing the sessions wakes it, so
            # the next update never shares the chain with this one.  The forward session is lost anyway: a
            # Sender ends its session on any failure.
            self._chain.close()
            self._thread.join()


class Relay:
    """A receiver's onward sessions, kept across its updates and senders (closed with the receiver)."""

    def __init__(self, token: str | bytes | None, stall_timeout: float, connect_timeout: float) -> None:
        self.token = token
        self.stall_timeout = stall_timeout
        self.connect_timeout = connect_timeout
        self._chain: Chain | None = None

    def start(self, region: TensorRegion, targets: list[str], version: Version, verify: bool, transport: str,
              streams: int | None, me: str) -> RelayJob:
        chain = self._chain
        if chain is None or (chain.transport, chain.streams) != (transport, streams):
            if chain is not None:
                chain.close()
            chain = self._chain = Chain(self.token, transport, streams, self.stall_timeout, self.connect_timeout, me)
        return RelayJob(chain, region, targets, version, verify, self.stall_timeout)

    def close(self) -> None:
        chain, self._chain = self._chain, None
        if chain is not None:
            chain.close()


def forward_piece_bytes(head: TransferStats | None, region: TensorRegion) -> int:
    """The piece relays forwarded in over the transport the first hop used (0: no hop succeeded)."""
    from tensorxfer.transport import TRANSPORTS

    if head is None or head.transport not in TRANSPORTS:
        return 0
    return TRANSPORTS[head.transport][0].forward_piece_bytes(region, head.streams)


class FanoutSender:
    """Sends a region to several receivers at once, by chain pipelining (see the module docstring).

    Parameters
    ----------
    to : list of str
        The receivers' ``HOST:PORT``, in chain order (at most MAX_CHAIN + 1, distinct).
    token, transport, streams, stall_timeout, connect_timeout
        As for :class:`~tensorxfer.session.Sender`; every hop uses them (a relay forwards over the
        transport and streams its offer named, with its own token).

    A receiver that fails is taken out: it is named in that update's :class:`FanoutStats` and left
    out of later updates (:attr:`chain`).  A receiver that holds the chain back is named
    (:attr:`FanoutStats.slow`) and, after :data:`SLOW_STRIKES` such updates in a row, moved to the tail
    for later updates.  ``close()`` is idempotent.
    """

    def __init__(self, to: Sequence[str], token: str | bytes | None = None, transport: str = "auto",
                 streams: int | None = None, stall_timeout: float = 30.0, connect_timeout: float = 10.0) -> None:
        targets = list(to)
        if not targets:
            raise ValueError("fan-out needs at least one receiver")
        if len(targets) > MAX_CHAIN + 1:
            raise ValueError(f"fan-out to at most {MAX_CHAIN + 1} receivers, got {len(targets)}")
        if len(set(targets)) != len(targets):
            raise ValueError("fan-out: a receiver address is named twice")
        for a in targets:
            parse_address(a)
        self.chain: list[str] = targets
        self.removed: list[ReceiverResult] = []
        self._strikes: tuple[str, int] = ("", 0)    # the receiver that held the chain back, updates in a row
        self._update = 0
        self._lock = threading.Lock()
        self._chain: Chain | None = Chain(token, transport, streams, float(stall_timeout), float(connect_timeout),
                                          ORIGIN)

    @property
    def closed(self) -> bool:
        return self._chain is None

    def send(self, region: TensorRegion, verify: bool = False, progress: Any = None,
             version: Version | None = None) -> FanoutStats:
        """Deliver ``region`` to every receiver still in the chain; wait for all of them.

        ``version``: the update this is (default: this FanoutSender's next update number and the manifest's
        digest); a warm peer passing on what it received keeps the origin's (:meth:`Receiver.send_on`).

        Returns
        -------
        FanoutStats
            One :class:`ReceiverResult` per receiver; failed ones have ``ok=False`` and the error.

        Raises
        ------
        TransferError
            This FanoutSender is closed, or no receiver is left in the chain.
        """
        with self._lock:
            chain = self._chain
            if chain is None:
                raise TransferError("this FanoutSender is closed")
            if not self.chain:
                raise TransferError("fan-out: every receiver was taken out of the chain: "
                                    + "; ".join(f"{r.address}: {r.error_type}" for r in self.removed))
            self._update += 1
            digest = manifest_digest(region.manifest)
            if version is None:
                version = Version(self._update, digest)
            elif version.digest != digest:
                raise ValueError("fan-out: the version's digest is not the region's manifest digest")
            t0 = time.perf_counter()
            order = tuple(self.chain)
            results, head = chain.send(region, order, version, verify, progress)
            seconds = time.perf_counter() - t0
            failed = {r.address for r in results if not r.ok}
            self.removed.extend(r for r in results if not r.ok)
            self.chain = [a for a in self.chain if a not in failed]
            slow = slowest_hop(results)
            self._strikes = ("", 0) if slow is None else \
                (slow[0].address, self._strikes[1] + 1 if self._strikes[0] == slow[0].address else 1)
            if slow is not None and self.chain[-1] != slow[0].address:
                # Everyone after it got its bytes at its pace: at the tail it holds back no one else.  Only
                # when it does so again and again: moving a hop sets up sessions anew (rdma: registers).
                moving = self._strikes[1] >= SLOW_STRIKES
                log.warning("fan-out: %s held the chain back (its last byte came %.3f s after its feeder had the "
                            "update; %d update(s) in a row)%s", slow[0].address, slow[1], self._strikes[1],
                            "; it is last from the next update on" if moving else "")
                if moving:
                    self.chain.remove(slow[0].address)
                    self.chain.append(slow[0].address)
                    self._strikes = ("", 0)
            return FanoutStats(region.nbytes, seconds, version, order, forward_piece_bytes(head, region),
                               tuple(results), head, slow[0].address if slow is not None else "")

    def close(self) -> None:
        chain, self._chain = self._chain, None
        if chain is not None:
            chain.close()

    def __enter__(self) -> FanoutSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<FanoutSender {'closed' if self.closed else ' -> '.join(self.chain)}>"
