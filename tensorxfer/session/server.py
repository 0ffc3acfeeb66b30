"""One admitted sender, as the receiver serves it: :class:`ServerSession`.

A :class:`~tensorxfer.session.Receiver` admits senders one after another; everything that ends with one
sender lives here: its control channel and session key, the update sequence, the data-path transports
(set up on the first update, reused by every later one), the idle clock, and a relay's pending ack.
Its lifecycle is one field, :class:`State`, changed only through :meth:`ServerSession._enter`, which
refuses an illegal transition.

:meth:`ServerSession.run_update` is the one update sequence -- counters, prepare, accept, wait, finish,
ack, stats -- for both the copy and the share path (the :mod:`~tensorxfer.session.targets` differ only
in where the bytes land).
"""

from __future__ import annotations

import contextlib
import enum
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from tensorxfer.checksum import ALGORITHM, first_mismatch
from tensorxfer.errors import (
    BindingError,
    ChecksumMismatch,
    CudaError,
    LayoutError,
    ManifestError,
    ProtocolError,
    RegionError,
    TransferError,
    TransferTimeout,
    TransportUnavailable,
)
from tensorxfer.manifest import Manifest
from tensorxfer.protocol import Channel, field
from tensorxfer.region import TensorRegion
from tensorxfer.session import control, partial, recovery
from tensorxfer.session.hooks import Forwarder, ForwardJob
from tensorxfer.session.offer import ManifestCache, Offer
from tensorxfer.session.partial import Holder
from tensorxfer.session.recovery import DEFAULT_POLICY, RecoveryPolicy
from tensorxfer.session.stats import TransferStats, UpdateClock
from tensorxfer.session.targets import Target
from tensorxfer.transport.base import Progress, TransferContext, setup_flag

log = logging.getLogger(__name__)

OnLanded = Callable[[TensorRegion], None]
OnPiece = Callable[[TensorRegion, int, int], None]     # (region, offset, length) of a landed host range
#: (files, report): a same-host sender's files, copied by the caller instead of landing in the region
#: (:attr:`~tensorxfer.transport.base.ReceiverTransport.on_files`)
OnFiles = Callable[[Sequence[tuple[int, int, int]], Callable[[int], None]], None]


class State(enum.Enum):
    IDLE = "idle"           # between updates: the next frame is an offer or a bye
    UPDATING = "updating"   # an update is in flight
    ACKING = "acking"       # a relayed update is complete here; its ack waits for the rest of its chain
    CLOSED = "closed"


_TRANSITIONS = {State.IDLE: {State.UPDATING, State.CLOSED}, State.UPDATING: {State.IDLE, State.ACKING, State.CLOSED},
                State.ACKING: {State.IDLE, State.CLOSED}, State.CLOSED: {State.CLOSED}}


class _PendingAck:
    """A relay's ack, sent from a thread once the rest of its chain finished (``wait`` frames meanwhile).

    Only this thread uses the session until it ends; the session settles it before its next frame.
    """

    def __init__(self, ch: Channel, seq: int, nbytes: int, job: ForwardJob) -> None:
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(ch, seq, nbytes, job), name="tensorxfer-relay-ack",
                                        daemon=True)
        self._thread.start()

    def _run(self, ch: Channel, seq: int, nbytes: int, job: ForwardJob) -> None:
        try:
            with control.KeepAlive(ch, seq):
                relayed = job.finish()
            ch.send("ack", seq=seq, bytes=nbytes, relayed=relayed)
        except BaseException as e:
            self.error = e

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the ack to go out (or fail); False if still waiting after ``timeout`` seconds."""
        self._thread.join(timeout)
        return not self._thread.is_alive()


class ServerSession:
    """One admitted sender: channel, key, sequence, transports, idle clock, pending ack (see the module).

    ``make_transport(name, ctx)`` makes this session's receiving half of transport ``name``;
    ``available(name)`` says why a transport this session does not run yet cannot (None: it can).
    """

    def __init__(self, ch: Channel, session_key: bytes, stall_timeout: float,
                 make_transport: Callable[[str, TransferContext], Any], available: Callable[[str], str | None],
                 forwarder: Forwarder | None = None, no_forward: str = "", require_verify: bool = False,
                 recovery: RecoveryPolicy | None = DEFAULT_POLICY) -> None:
        self.channel = ch
        self._recovery = recovery
        self._require_verify = require_verify
        self._key = session_key
        self.stall_timeout = stall_timeout
        self._make_transport = make_transport
        self._available = available
        self._forwarder = forwarder
        self._no_forward = no_forward       # why chains are refused when there is no forwarder
        self._seq = 0
        self._transports: dict[str, Any] = {}
        self._ack: _PendingAck | None = None
        self._state = State.IDLE
        self.idle_since = time.monotonic()
        self.manifests = ManifestCache()

    @property
    def state(self) -> State:
        return self._state

    @property
    def peer(self) -> str:
        return self.channel.peer

    def _enter(self, state: State) -> None:
        if state not in _TRANSITIONS[self._state]:
            raise TransferError(f"session with {self.peer}: {self._state.value} -> {state.value} is not allowed")
        self._state = state

    def idle_for(self) -> float:
        """Seconds since this session last finished something."""
        return time.monotonic() - self.idle_since

    # ------------------------------------------------------------ frames
    def next_frame(self, timeout: float | None) -> dict[str, Any]:
        """The sender's next frame: an offer or a bye (raises as :meth:`Channel.recv`)."""
        return self.channel.recv("offer", "bye", timeout=timeout)

    def offer(self, frame: dict[str, Any], max_region_bytes: int) -> Offer:
        """The offer in ``frame``, checked; a refusal is told to the sender and raised.

        Raises
        ------
        ProtocolError
            Out of sequence or malformed.
        ManifestError
            The manifest is malformed or over ``max_region_bytes``.
        """
        seq = field(frame, "seq", int)
        if seq != self._seq + 1:
            raise ProtocolError(f"offer out of order: expected sequence {self._seq + 1}, got {seq}")
        self._seq = seq
        try:
            return Offer.parse(frame, self.manifests, max_region_bytes)
        except (ManifestError, ProtocolError) as e:
            self.channel.send_error("refused" if isinstance(e, ManifestError) else "protocol", str(e),
                                    error_type=type(e).__name__)
            raise

    def refuse(self, code: str, error: BaseException) -> BaseException:
        """Tell the sender why its update is refused; return ``error`` to raise."""
        self.channel.send_error(code, _in_words(error), error_type=type(error).__name__)
        return error

    # ------------------------------------------------------------ one update
    def run_update(self, offer: Offer, target: Target, me: str, progress: Progress | None = None,
                   on_offer: Callable[[Manifest], None] | None = None,
                   on_landed: OnLanded | None = None, on_piece: OnPiece | None = None,
                   holder: Holder | None = None,
                   on_files: OnFiles | None = None) -> tuple[TensorRegion, TransferStats]:
        """Receive ``offer`` into ``target``: the update sequence of the module docstring.

        Raises whatever ended the update (the sender was told when it still listens); the caller ends
        the session then.  ``me`` is this receiver's address (a relay names itself to the next hops).
        """
        self._enter(State.UPDATING)
        clock = UpdateClock()
        if on_offer is not None:
            try:
                on_offer(offer.manifest)
            except BaseException as e:
                self.channel.send_error("refused", _in_words(e), error_type=type(e).__name__)
                raise
        # a transport this session already runs is known to work: probing again (rdma opens the device)
        # would cost every warm update more than a small one's data
        reason = None if offer.transport in self._transports else self._available(offer.transport)
        if reason is not None:
            raise self.refuse("transport", TransportUnavailable(
                f"transport {offer.transport!r} is not available on this receiver ({reason})"))
        if self._require_verify and not offer.verify:
            raise self.refuse("refused", ManifestError(
                "this receiver accepts only verified transfers: send with verify=True (tensorxfer-send --verify)"))
        if offer.chain and self._forwarder is None:
            raise self.refuse("refused", ManifestError(self._no_forward))
        if not offer.chain and self._forwarder is not None:
            # Not (or no longer) a relay: sessions it kept to hops after it would only hold those receivers
            # (and, over rdma, their registrations).
            self._forwarder.close()
        try:
            target.begin(offer.manifest, shareable=bool(offer.chain))     # a relay passes its region on
        except (LayoutError, BindingError) as e:    # the offer does not fit the module the caller bound
            raise self.refuse("refused", e) from None
        except (CudaError, RegionError, MemoryError) as e:
            self.channel.send_error("transfer", f"the receiver cannot allocate {offer.nbytes} bytes on "
                                                f"{target.device!r}: {e}")
            raise
        job: ForwardJob | None = None
        try:
            transport = self._transport(offer)
            if offer.chain:
                assert self._forwarder is not None and offer.version is not None and target.region is not None
                job = self._forwarder.start(target.region, offer.chain, offer.version, offer.verify,
                                            offer.chain_transport, offer.streams, me)
            transport.on_piece = _pieces_to(job, on_piece, target.region)
            # broken data streams are resumed within the update when the sender follows resume frames; set before
            # prepare, where a transport may ask for what resuming needs (rdma: a mark on every request)
            transport.resumable = (offer.resume and getattr(transport, "can_resume", False) and not offer.chain
                                   and self._recovery is not None)
            # the caller copies a sender's files itself only where nothing reads the region afterwards: no
            # relay forwarding it, no checksums to check over it, a host region (a module binding is refused
            # by Receiver.receive)
            transport.on_files = (on_files if job is None and not offer.verify and target.region is not None
                                  and not target.region.is_cuda else None)
            registered, used = transport.counters.registrations, transport.counters.updates
            # a partial update: the receiver's held pieces the sender confirmed do not move
            segments, kept = partial.receiver_settle(self.channel, offer.seq, offer.partial, holder, target.region,
                                                     self.stall_timeout)
            descriptors = target.prepare(transport, offer.seq, offer.fresh, segments)
            setup = setup_flag(descriptors)
            clock.setup_seconds = clock.elapsed()
            self.channel.send("accept", seq=offer.seq, transport=offer.transport, descriptors=descriptors,
                              reallocated=target.reallocated, setup_seconds=clock.setup_seconds)
            transport.meanwhile = target.while_landing
            try:
                with clock.wire():
                    nbytes, recovered = recovery.receive(transport, self.channel, offer.seq, self._recovery, progress)
            finally:
                transport.meanwhile = None      # the target (and its region) is this update's only
                transport.resumable = False
            if job is not None:
                job.all_landed()
            region = target.landed(transport)
            setup = setup or transport.counters.registrations > registered    # ipc: handles passed with the data
            if setup and used:
                log.info("update %d: the %s transport was set up again (%s): %d registrations, %d connects so far",
                         offer.seq, offer.transport, "the layout changed" if target.reallocated else
                         "the sender's region changed", transport.counters.registrations, transport.counters.connects)
            self._finish(offer, region, nbytes, target.verb, on_landed, job,
                         segments.total_bytes if segments is not None else offer.nbytes)
        except BaseException as e:
            if job is not None:
                job.abort(f"{type(e).__name__}: {e}")
            if target.failed():     # memory allocated for this offer: the transports go first (see CopyTarget)
                self.close()
                target.discard()
            raise
        stats = clock.stats(nbytes, offer.transport, descriptors.get("streams", 1), transport.counters,
                            transport.registration, verified=offer.verify, reallocated=target.reallocated,
                            update=offer.seq, setup=setup, recovery=recovered, kept_bytes=kept)
        self.idle_since = time.monotonic()
        return region, stats

    def _transport(self, offer: Offer) -> Any:
        """This session's transport for the offer (made on its first use, reused by every later update)."""
        transport = self._transports.get(offer.transport)
        if transport is None:
            ctx = control.transfer_context(self.channel, self._key, self.stall_timeout, offer.streams)
            transport = self._transports[offer.transport] = self._make_transport(offer.transport, ctx)
        return transport

    def _finish(self, offer: Offer, region: TensorRegion, nbytes: int, verb: str, on_landed: OnLanded | None,
                job: ForwardJob | None, expected_bytes: int) -> None:
        """The end of every update: the sender's done frame must match (``expected_bytes``: the manifest's,
        or a partial update's segments'), checksums if asked, the caller's ``on_landed``, then ack (a relay's
        once the rest of its chain finished)."""
        ch, seq = self.channel, offer.seq
        done = ch.recv("done", timeout=control.control_timeout(self.stall_timeout))
        if field(done, "seq", int) != seq or field(done, "bytes", int) != nbytes or nbytes != expected_bytes:
            raise ProtocolError(f"done frame does not match transfer {seq}: sender says {done.get('bytes')} bytes, "
                                f"{nbytes} {verb}, {expected_bytes} expected (the manifest has {offer.nbytes})")
        expected = _expected_sums(region, done) if offer.verify else None
        if job is not None:
            # Every byte is here: the next hop may finish.  It checks its own copy against the origin's
            # checksums (passed on as they came), so it need not wait for this hop's verification.
            job.complete(done.get("checksums"))
        # Hashing a large region and the caller's on_landed (the CLI writes and fsyncs every file) can take
        # minutes: "wait" frames tell the sender the receiver is alive and working, so its ack wait measures
        # a stall, not the length of the work.
        bad: str | None = None
        failure: BaseException | None = None
        busy = expected is not None or on_landed is not None
        with control.KeepAlive(ch, seq) if busy else contextlib.nullcontext():  # no thread for a plain update
            if expected is not None:
                bad = first_mismatch(region, expected)
            if bad is None and on_landed is not None:
                try:
                    on_landed(region)
                except BaseException as e:
                    failure = e
        if bad is not None:
            msg = f"tensor {bad!r} arrived corrupted ({ALGORITHM} differs from the sender's)"
            ch.send_error("checksum", msg, tensor=bad)
            raise ChecksumMismatch(msg, tensor=bad)
        if failure is not None:
            ch.send_error("landed", f"the receiver failed after the data landed: {type(failure).__name__}: "
                                    f"{failure}")
            raise failure
        if job is not None:
            # This copy is complete and checked: the update returns now; the ack, which carries the results
            # of the hops after this one, goes out when they finished.
            self._ack = _PendingAck(ch, seq, nbytes, job)
            self._enter(State.ACKING)
            return
        ch.send("ack", seq=seq, bytes=nbytes)
        self._enter(State.IDLE)

    def settle_ack(self, deadline: float | None) -> None:
        """Let a relayed update's ack out before the session moves on (the sender reads nothing else first).

        If the ack could not be sent, the session is over: it is closed (:attr:`state` says so).

        Raises
        ------
        TransferTimeout
            The rest of the chain had not finished by ``deadline``.
        """
        ack = self._ack
        if ack is None:
            return
        if not ack.join(control.remaining(deadline)):
            raise TransferTimeout("the previous update's relay ack is still waiting for the rest of its chain")
        self._ack = None
        self._enter(State.IDLE)
        if ack.error is not None:
            log.warning("relay: the previous update's ack could not be sent (%s: %s): ending that session",
                        type(ack.error).__name__, ack.error)
            self.close()

    def join_ack(self) -> None:
        """Wait for a pending relay ack to go out (or fail), changing nothing (:meth:`settle_ack` does)."""
        ack = self._ack
        if ack is not None:
            ack.join()

    def close_transports(self) -> None:
        """Close the data paths (from another thread too: wakes an update blocked in one)."""
        for transport in list(self._transports.values()):
            transport.close()

    def close(self) -> None:
        """End the session: its transports, then its channel; idempotent."""
        self._state = State.CLOSED
        transports, self._transports = self._transports, {}
        for transport in transports.values():
            transport.close()
        self.channel.close()


def _in_words(e: BaseException) -> str:
    """An error as the sender reads it: its message; an OS error's in words, without ``[Errno 28]``."""
    if isinstance(e, OSError) and e.strerror:
        return f"{e.strerror}: {e.filename}" if e.filename else e.strerror
    return str(e)


def _expected_sums(region: TensorRegion, done: dict[str, Any]) -> list[int]:
    sums = field(done, "checksums", list)
    if len(sums) != 2 or sums[0] != ALGORITHM or not isinstance(sums[1], bytes) \
            or len(sums[1]) != 8 * len(region.manifest):
        raise ProtocolError(f"done frame: checksums must be [{ALGORITHM!r}, 8 bytes per tensor]")
    return list(np.frombuffer(sums[1], dtype="<u8").tolist())


def _pieces_to(job: ForwardJob | None, on_piece: OnPiece | None,
               region: TensorRegion | None) -> Callable[[int, int], None] | None:
    """The transport's ``on_piece`` hook: a relay's forwarding job and the caller's hook (host regions
    only: a device piece is not readable from here), either, both or neither."""
    mine = on_piece if region is not None and not region.is_cuda else None
    if mine is None:
        return job.on_piece if job is not None else None
    assert region is not None
    if job is None:
        return lambda off, n: mine(region, off, n)

    def both(off: int, n: int) -> None:
        job.on_piece(off, n)
        mine(region, off, n)
    return both
