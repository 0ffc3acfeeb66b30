"""A receiver that passes each update on while it lands: :class:`Relay` and its :class:`RelayJob`.

The session layer declares what a receiver's forwarding looks like (:class:`~tensorxfer.session.Forwarder`,
:class:`~tensorxfer.session.ForwardJob`); this module implements it with a :class:`~.chain.Chain` whose
sends follow the relay's own copy as it lands (:class:`~.chain.Landed`).
"""

from __future__ import annotations

import threading
from typing import Any

from tensorxfer.errors import TransferError, UpstreamFailed
from tensorxfer.fanout.chain import Chain, Landed, ReceiverResult
from tensorxfer.protocol import Version
from tensorxfer.region import TensorRegion
from tensorxfer.session.hooks import ForwardJob


class RelayJob:
    """A receiver forwarding one update to the rest of its chain while it lands (in its own thread).

    Implements :class:`~tensorxfer.session.ForwardJob`.
    """

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

    def on_piece(self, offset: int, length: int) -> None:
        """A range of this relay's copy landed (from the receiving transport's threads)."""
        self.landed.add(offset, length)

    def all_landed(self) -> None:
        self.landed.add_all()

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
    """A receiver's onward sessions, kept across its updates and senders (closed with the receiver).

    Implements :class:`~tensorxfer.session.Forwarder`.
    """

    def __init__(self, token: str | bytes | None, stall_timeout: float, connect_timeout: float) -> None:
        self.token = token
        self.stall_timeout = stall_timeout
        self.connect_timeout = connect_timeout
        self._chain: Chain | None = None

    def start(self, region: TensorRegion, targets: list[str], version: Version, verify: bool, transport: str,
              streams: int | None, me: str) -> ForwardJob:
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

