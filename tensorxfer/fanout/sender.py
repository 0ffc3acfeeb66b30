"""The origin of a fan-out: :class:`FanoutSender`, and :func:`send_on` for a warm peer passing its update on."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tensorxfer.errors import TransferError
from tensorxfer.fanout.chain import MAX_CHAIN, ORIGIN, Chain, ReceiverResult, forward_piece_bytes
from tensorxfer.protocol import Version, manifest_digest, parse_address
from tensorxfer.region import TensorRegion
from tensorxfer.session import TransferStats

if TYPE_CHECKING:
    from tensorxfer.session import Receiver

log = logging.getLogger(__name__)

# A receiver is moved only when that clearly pays: moving it sets its hop's sessions up again (rdma
# registers the region anew), and hops that share one resource (a host's CPUs or memory bus, the
# Soft-RoCE VM's two CPUs) make the first hop after the head lag by up to about the head's own time --
# the lag of a position, not of a receiver.  Measured there: 0.1-0.15 s lags at 4 MiB in the VM, flagged
# with the thresholds 0.5 / 0.05 s / 2 and churning the chain.
SLOW_LAG = 1.0          # a hop finishing more than the first hop's whole time after its feeder is slow
SLOW_MIN_LAG = 0.25     # seconds: a smaller lag is not worth setting sessions up again
SLOW_STRIKES = 3        # updates in a row a receiver must hold the chain back before it is moved


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
        targets = ["{}:{}".format(*parse_address(a)) if isinstance(a, tuple | list) else a for a in to]
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


def send_on(receiver: Receiver, to: str | list[str], verify: bool = False, transport: str = "auto",
            streams: int | None = None) -> FanoutStats:
    """Send the complete update ``receiver`` holds to other receivers (a new replica pulls from a warm peer).

    Sends its region with its version kept (the origin's update number), over a chain when ``to`` names
    several receivers, with the receiver's token.  The receiver lends its region under its lock meanwhile
    (:meth:`~tensorxfer.session.Receiver.lend`), so no ``receive()`` overwrites it while it is sent.

    Raises
    ------
    TransferError
        No complete version is held (nothing received yet, or the last update failed or is in flight).
    """
    targets = [to] if isinstance(to, str | tuple) else list(to)
    with receiver.lend() as (region, version), \
            FanoutSender(targets, token=receiver.token, transport=transport, streams=streams,
                         stall_timeout=receiver.stall_timeout, connect_timeout=receiver.handshake_timeout) as fan:
        return fan.send(region, verify=verify, version=version)
