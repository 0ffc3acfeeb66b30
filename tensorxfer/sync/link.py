"""One (source rank, target rank) pair of a weight sync, over the session transports.

A source rank keeps one :class:`SourceLink` to every target it feeds; a target rank keeps one
:class:`TargetPort` (its listener) and, through it, one session per source that feeds it.  A pair is
authenticated once (the control handshake with the group's token; the hello names the group and the
ranks), and its data path is set up on the first step (registered, connected, handles passed) and
reused by every later one, across membership epochs too.  Each step is the session exchange -- offer,
accept, data, done, ack -- where the data is the pair's segments: the runs the plan gives it, straight
from the source's region into the target's live weights.  Every offer carries the plan digest, the
digest of the pair's runs (each end computed them, from a plan of its own part) and the step: a target
that planned otherwise refuses it with :class:`PlanError`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import select
import socket
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from tensorxfer.connections import Gate, connect_words, listen
from tensorxfer.errors import (
    LinkDropped,
    PeerLost,
    PlanError,
    ProtocolError,
    QuantizationError,
    TensorXferError,
    TransferError,
    TransferTimeout,
)
from tensorxfer.protocol import Channel, client_handshake, field, server_handshake, token_key
from tensorxfer.region import TensorRegion
from tensorxfer.session import control, recovery
from tensorxfer.session.recovery import DEFAULT_POLICY, Resumer
from tensorxfer.sync.clock import StepClock
from tensorxfer.sync.workers import Workers
from tensorxfer.transport import TRANSPORTS, choose, local_capabilities, local_transports
from tensorxfer.transport.base import setup_flag
from tensorxfer.transport.segments import Segments

log = logging.getLogger(__name__)


#: A pair's step in parts: the segments of each, landed in order.  A first part that needs nothing the source
#: computes at push time (a fused pair's quantizing tiles read the trainer's own shard:
#: :mod:`tensorxfer.sync.fusing`) is offered at once, and lands while the source makes the next part's bytes
#: (its FP8 blocks shared with other sources, after their amax round).  Each part has a transport of its own at
#: both ends -- its own ipc socket, copy lane and device tables, set up once -- so parts that alternate every
#: step set nothing up again.
Parts = tuple[Segments, ...]


def parts_of(segments: Segments | Sequence[Segments]) -> Parts:
    """``segments`` as a step's parts (one Segments: a step of one part)."""
    return (segments,) if isinstance(segments, Segments) else tuple(segments)


@dataclass
class PairStep:
    """One step of one pair between :class:`SourceLink`'s phases: what was offered, and when."""

    region: TensorRegion
    segments: Segments
    seq: int
    t0: float                   # the offer
    fresh: bool                 # the offer sets the data path up
    early: bool                 # the data goes out at post(), before the accept
    transport: Any              # the part's transport (each part of a step has its own: see Parts)
    t1: float = 0.0             # the data went out
    moved: int = 0


@dataclass(frozen=True)
class FeedStep:
    """One step of one pair on the target, between :class:`_Feed`'s phases: the offer it took."""

    seq: int
    version: int
    name: str                   # the transport
    transport: Any
    setup: bool
    runs: int
    t0: float                   # the offer arrived
    resume: bool = False        # the source follows resume frames when this pair's data streams break
    descriptors: Any = None     # the accept's, where it was not sent yet (take_offer(accept=False))


@dataclass(frozen=True)
class PairStats:
    """What one step moved between one source and one target; ``retries``, ``resent_bytes`` and
    ``recovery_seconds`` say what recovering this pair's broken data streams cost (as for
    :class:`~tensorxfer.session.TransferStats`; a pair whose streams held shows zeros).  A step in parts
    (:data:`Parts`) also says when each part ended, in seconds from the first part's offer
    (``part_seconds``; one part: empty, ``seconds`` says it)."""

    source: int
    target: int
    bytes: int
    seconds: float
    wire_seconds: float
    runs: int
    transport: str
    setup: bool
    retries: int = 0
    resent_bytes: int = 0
    recovery_seconds: float = 0.0
    part_seconds: tuple[float, ...] = ()

    @property
    def gbps(self) -> float:
        return self.bytes * 8 / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def then(self, later: PairStats, seconds: float) -> PairStats:
        """This part of a step followed by ``later`` (the next part): one pair's stats, ``seconds`` from the
        first part's offer to the last part's end."""
        return replace(self, bytes=self.bytes + later.bytes, seconds=seconds,
                       wire_seconds=self.wire_seconds + later.wire_seconds, runs=self.runs + later.runs,
                       setup=self.setup or later.setup, retries=self.retries + later.retries,
                       resent_bytes=self.resent_bytes + later.resent_bytes,
                       recovery_seconds=self.recovery_seconds + later.recovery_seconds,
                       part_seconds=(self.part_seconds or (self.seconds,)) + (seconds,))

    def as_dict(self) -> dict[str, Any]:
        return {"source": self.source, "target": self.target, "bytes": self.bytes, "seconds": self.seconds,
                "wire_seconds": self.wire_seconds, "gbps": self.gbps, "runs": self.runs, "transport": self.transport,
                "setup": self.setup, "retries": self.retries, "resent_bytes": self.resent_bytes,
                "recovery_seconds": self.recovery_seconds, "part_seconds": list(self.part_seconds)}


def _sync_caps(group: str, role: str, rank: int) -> dict[str, Any]:
    return {"transports": local_transports(), "transport_caps": local_capabilities(),
            "sync": {"group": group, "role": role, "rank": rank}}


class SourceLink:
    """A source rank's session to one target rank (see the module docstring).

    Raises (on construction)
    ------------------------
    PeerLost
        The target cannot be reached.
    AuthError
        The tokens differ.
    ProtocolError
        The listener is not that target rank of this group.
    TransportUnavailable
        A forced transport cannot connect the two.
    """

    def __init__(self, address: tuple[str, int], token: str | bytes | None, group: str, source: int, target: int,
                 transport: str, streams: int | None, stall_timeout: float,
                 connect_timeout: float) -> None:
        self.source, self.target = source, target
        self.stall_timeout = stall_timeout
        self.clock = StepClock(stall_timeout)
        # One stream per pair unless asked: a step runs every pair at once, which is parallel enough.
        self.streams = streams or 1
        self._seq = 0
        self._transports: dict[int, Any] = {}      # part -> its transport (one part: just 0)
        try:
            sock = socket.create_connection(address, timeout=connect_timeout)
        except OSError as e:
            raise PeerLost(f"sync: source {source} cannot reach target rank {target} at {address[0]}:{address[1]}: "
                           f"{connect_words(e, address[0])}") from None
        ch = Channel(sock)
        try:
            hello, self._key = client_handshake(ch, token_key(token), _sync_caps(group, "source", source),
                                                connect_timeout)
            caps = field(hello, "capabilities", dict)
            theirs = field(caps, "sync", dict)
            if theirs.get("rank") != target or theirs.get("group") != group or theirs.get("role") != "target":
                raise ProtocolError(f"sync: {address[0]}:{address[1]} is {theirs!r}, not target rank {target} of "
                                    f"group {group!r} (a stale address in the store?)")
            self.transport = choose(transport, [t for t in field(caps, "transports", list) if isinstance(t, str)],
                                    field(caps, "transport_caps", dict, optional=True) or {})
        except BaseException:
            ch.close()
            raise
        self._ch = ch

    def offer(self, region: TensorRegion, segments: Segments, version: int, digest: str, part: int = 0) -> PairStep:
        """Phase 1 of a step: offer this pair's segments of ``region`` for ``version`` (planned as ``digest``).

        A step is :meth:`offer`, then :meth:`post` once ``region`` holds the step's bytes, then :meth:`finish`:
        the source offers every target first, packs its region while they take the offers in, and posts
        every warm ipc pair's data before it waits for any (no thread handoff between the phases).  An
        offer that is never posted stays unanswered: the caller must then close this link.

        A step in parts (:data:`Parts`) offers each ``part`` in order, the next one once the region holds its
        bytes and the part before it was posted early (:attr:`PairStep.early`: its data and done are on their
        way) or finished, and finishes them in the same order.

        Raises (each phase, the message naming the target rank)
        ------
        PeerLost, TransferTimeout
            The target died or stalled.
        TransferError, ProtocolError
            The target refused or failed the step.
        """
        with self._named():
            self._seq += 1
            t0 = time.perf_counter()
            transport = self._transports.get(part)
            if transport is None:
                ctx = control.transfer_context(self._ch, self._key, self.stall_timeout, self.streams)
                transport = self._transports[part] = TRANSPORTS[self.transport][0](ctx)
            if self.transport != "ipc":
                segments.without_tiles()
            fresh = transport.needs_setup(region)
            self._ch.send("offer", seq=self._seq, transport=self.transport, fresh=fresh, version=version,
                          bytes=segments.total_bytes, streams=self.streams, digest=digest, runs=segments.digest,
                          resume=transport.can_resume, part=part)
            # as Sender: a warm ipc step's data goes right behind the offer, before the accept
            return PairStep(region, segments, self._seq, t0, fresh, transport.posts_early and not fresh, transport)

    def post(self, step: PairStep) -> None:
        """Phase 2: where the pair is warm and its transport posts early (ipc), pass the data now (the
        target copies it once it took the offer in); else nothing (:meth:`finish` sends it)."""
        if step.early:
            with self._named():
                step.t1 = time.perf_counter()
                step.moved = step.transport.post_early(step.region, step.seq, step.segments)
                self._ch.send("done", seq=step.seq, bytes=step.moved)

    def finish(self, step: PairStep) -> PairStats:
        """Phase 3: take the target's accept (and send the data, unless it was posted), its ack; the pair's
        stats."""
        with self._named():
            ch, transport, seq = self._ch, step.transport, step.seq
            accept = ch.recv("accept", timeout=self.clock.reply(step.fresh))
            if field(accept, "seq", int) != seq:
                raise ProtocolError(f"sync: accept for step {accept.get('seq')}, expected {seq}")
            descriptors = field(accept, "descriptors", dict)
            setup = setup_flag(descriptors)
            if step.early:
                if setup:
                    raise ProtocolError(f"sync: the target set the {self.transport} data path up again (step {seq}), "
                                        f"but this warm step's data was already on its way")
                transport.collect()
            resumer = Resumer(transport, step.region, seq, DEFAULT_POLICY, None)
            if not step.early:
                transport.connect(step.region, seq, descriptors, segments=step.segments)
                step.t1 = time.perf_counter()
                transport.resumable = resumer.enabled
                try:
                    step.moved = transport.send(step.region)
                except LinkDropped as e:    # the target knows what landed: it asks for the rest after our done
                    step.moved = resumer.broke(e)
                finally:
                    transport.resumable = False
                ch.send("done", seq=seq, bytes=step.moved)
            wire = time.perf_counter() - step.t1
            while True:
                try:
                    ack = ch.recv("ack", "resume", timeout=resumer.wait_limit(self.clock.reply(setup),
                                                                                self.stall_timeout))
                except TensorXferError as e:
                    raise resumer.failed(e) from None
                if ack["type"] == "ack":
                    break
                resumer.follow(ack)
            if field(ack, "seq", int) != seq or field(ack, "bytes", int) != step.moved:
                raise ProtocolError(f"sync: ack does not match step {seq} of {step.moved} bytes")
        rec = resumer.recovery
        return PairStats(self.source, self.target, step.moved, time.perf_counter() - step.t0, wire,
                         step.segments.num_runs, self.transport, setup, rec.retries, rec.resent_bytes, rec.seconds)

    def push(self, region: TensorRegion, segments: Segments | Parts, version: int, digest: str) -> PairStats:
        """The three phases at once: one pair's whole step, every part of it in turn (raises as :meth:`offer`)."""
        steps = parts_of(segments)
        t0 = time.perf_counter()
        stats: PairStats | None = None
        for part, seg in enumerate(steps):
            step = self.offer(region, seg, version, digest, part)
            self.post(step)
            done = self.finish(step)
            stats = done if stats is None else stats.then(done, time.perf_counter() - t0)
        assert stats is not None
        return stats

    def refuse(self, code: str, message: str, tensor: str | None = None) -> None:
        """Answer the target's wait for this step with an error instead of an offer (``tensor``: the one at
        fault); the caller closes this link (the target drops its side)."""
        extra = {"tensor": tensor} if tensor is not None else {}
        self._ch.send_error(code, f"source {self.source}: {message}", **extra)

    @contextlib.contextmanager
    def _named(self) -> Iterator[None]:
        try:
            yield
        except TensorXferError as e:
            e.args = (f"sync: source {self.source} -> target rank {self.target}: {e}", *e.args[1:])
            raise

    def close(self) -> None:
        transports, self._transports = self._transports, {}
        for transport in transports.values():
            transport.close()
        self._ch.close()


class _Feed:
    """A target's session with one source: its channel, key and transports (one per transport name)."""

    def __init__(self, ch: Channel, key: bytes, source: int, stall_timeout: float,
                 copy_host: tuple[str, bytes | None] | None = None) -> None:
        self.ch, self.key, self.source, self.stall_timeout = ch, key, source, stall_timeout
        self.copy_host = copy_host      # where this target's ipc copies go (None: copied in this process)
        self.seq = 0
        self.transports: dict[str, Any] = {}       # by name ("ipc"; a later part of a step: "ipc#1")
        self._landing = Workers(f"tensorxfer-sync-part-{source}")     # a step's earlier parts, landing (land_parts)

    def take_offer(self, region: TensorRegion, segments: Segments, digest: str, step: int | None,
                   part: int = 0, accept: bool = True) -> FeedStep:
        """Phase 1 of a step from this source (planned as ``digest``; ``step``: the version it must carry, if
        known; ``part``: which part of the step, :data:`Parts`): take its offer (its first bytes are here),
        check it, get the data path ready and accept (unless not ``accept``: the caller sends it later,
        :meth:`_accept`)."""
        ch = self.ch
        offer = ch.recv("offer", timeout=self.stall_timeout)
        t0 = time.perf_counter()
        seq = field(offer, "seq", int)
        if seq != self.seq + 1:
            raise ProtocolError(f"sync: step {seq} from source {self.source}, expected {self.seq + 1}")
        self.seq = seq
        name = field(offer, "transport", str)
        version = field(offer, "version", int)
        theirs = field(offer, "digest", str)
        msg = ""
        if theirs != digest:
            msg = (f"source {self.source} planned this step as {theirs[:16]}, this target as {digest[:16]}: the "
                   f"ranks disagree on the group's members or shard descriptions")
        elif offer.get("part", 0) != part:
            msg = (f"source {self.source} offers part {offer.get('part')!r} of its step where this target expects "
                   f"part {part}: the ranks cut the pair's step differently (versions?)")
        elif step is not None and version != step:
            msg = f"source {self.source} sends version {version} for step {step}: the sources are out of step"
        elif field(offer, "bytes", int) != segments.total_bytes:
            msg = (f"source {self.source} offers {offer.get('bytes')} bytes, this target planned "
                   f"{segments.total_bytes} from it: the ranks planned differently")
        elif field(offer, "runs", str) != segments.digest:
            msg = (f"source {self.source} computed other runs for this pair ({str(offer.get('runs'))[:16]}) than "
                   f"this target ({segments.digest[:16]}): their planners differ (versions?)")
        if msg:
            ch.send_error("protocol", msg)
            raise PlanError(f"sync: {msg}")
        if name != "ipc":
            segments.without_tiles()
        if name not in self.transports and name not in local_transports():
            msg = f"transport {name!r} is not available on this target (it has {local_transports()})"
            ch.send_error("transport", msg)
            raise TransferError(f"sync: {msg}")
        key = name if not part else f"{name}#{part}"       # each part its own transport (Parts)
        transport = self.transports.get(key)
        if transport is None:
            streams = field(offer, "streams", int, optional=True)
            ctx = control.transfer_context(ch, self.key, self.stall_timeout,
                                           max(1, min(streams or 1, 64)))
            transport = self.transports[key] = TRANSPORTS[name][1](ctx)
            if self.copy_host is not None and hasattr(transport, "copy_host"):
                transport.copy_host = self.copy_host
        descriptors = transport.prepare(region, seq, field(offer, "fresh", bool), segments=segments)
        fs = FeedStep(seq, version, name, transport, setup_flag(descriptors), segments.num_runs, t0,
                      offer.get("resume") is True and transport.can_resume, None if accept else descriptors)
        if accept:
            self._accept(fs, descriptors)
        return fs

    def _accept(self, fs: FeedStep, descriptors: Any) -> None:
        self.ch.send("accept", seq=fs.seq, transport=fs.name, descriptors=descriptors)

    def land(self, fs: FeedStep) -> tuple[int, PairStats]:
        """Phase 2: the data (landed by the transport), the source's done, the ack: (the version it carried,
        its stats)."""
        moved, rec, wire = self._data(fs)
        return fs.version, self._ack(fs, self._done(fs, moved), rec, wire)

    def overlaps(self, fs: FeedStep) -> bool:
        """Whether the part after ``fs`` may be taken in while ``fs`` lands (:meth:`land_parts`): its data comes
        beside the channel (a warm ipc step, posted with its done before the accept) and no resume of its
        streams can need the channel."""
        return fs.name == "ipc" and not fs.setup and not fs.resume

    def land_parts(self, region: TensorRegion, first: FeedStep, later: Sequence[Segments], digest: str,
                   step: int | None) -> tuple[int, PairStats]:
        """Phase 2 of a step in parts (:data:`Parts`) whose parts :meth:`overlaps`: each later part's offer is
        taken, and its data landing, while the parts before it still land -- on the channel its offer follows
        the done of the part before at once, and each part has a transport of its own.  The accepts and acks
        go out in the order the source reads them (part 0's accept and ack, then part 1's, ...), each ack once
        its part landed.  (Taking a part in only once the part before had landed and been
        acked ended a fused pair's second part -- its shared blocks, ~0.3 ms of GPU work -- 2.5-3 ms after
        its first on the H100.)  Returns as :meth:`land`, the stats of every part added up."""
        taken: list[tuple[FeedStep, int]] = []      # each part, and the bytes its done says it moved
        outcome: dict[int, Any] = {}                # each part's landing: (bytes, recovery, seconds) or its error

        def data(k: int, fs: FeedStep) -> None:
            try:
                outcome[k] = self._data(fs, tell=False)
            except BaseException as e:
                outcome[k] = e
        batch = self._landing.batch(len(later))
        fs = first
        try:
            for k, segments in enumerate([*later, None]):
                if segments is not None and self.overlaps(fs):
                    batch.submit(functools.partial(data, k, fs))        # lands while the next part is taken in
                else:       # the last part (or one that sets its data path up: it lands before the next is taken)
                    data(k, fs)
                    if isinstance(outcome[k], BaseException):
                        break
                taken.append((fs, self._done(fs, None)))
                if segments is None:
                    break
                # (its accept waits for the acks of the parts before it: the source reads them in order)
                fs = self.take_offer(region, segments, digest, step, k + 1, accept=False)
                if fs.version != first.version:
                    raise ProtocolError(f"sync: source {self.source} sent part {k + 1} of its step as version "
                                        f"{fs.version}, its part 0 as {first.version}")
        finally:
            batch.join()
        stats: PairStats | None = None
        for k in range(len(outcome)):
            got = outcome[k]
            if isinstance(got, BaseException):
                if isinstance(got, QuantizationError):      # the source hears why (as land() tells it)
                    self.ch.send_error("quantization", str(got), tensor=got.tensor)
                raise got
            fs, said = taken[k]
            if k:
                self._accept(fs, fs.descriptors)
            moved, rec, wire = got
            if said != moved:
                raise ProtocolError(f"sync: done from source {self.source} does not match step {fs.seq} of {moved} "
                                    f"bytes")
            done = self._ack(fs, moved, rec, wire)
            stats = done if stats is None else stats.then(done, time.perf_counter() - first.t0)
        assert stats is not None
        return first.version, stats

    def _data(self, fs: FeedStep, tell: bool = True) -> tuple[int, Any, float]:
        """The step's data, landed by its transport: (bytes, what recovery did, seconds).  A pair that met a NaN
        as it quantized tells the source why (``tell``), then raises QuantizationError."""
        t1 = time.perf_counter()
        fs.transport.resumable = fs.resume
        try:
            moved, rec = recovery.receive(fs.transport, self.ch, fs.seq, DEFAULT_POLICY, None)
        except QuantizationError as e:      # the pair quantized on the way and met a NaN: the source hears why
            if tell:
                self.ch.send_error("quantization", str(e), tensor=e.tensor)
            raise
        finally:
            fs.transport.resumable = False
        return moved, rec, time.perf_counter() - t1

    def _done(self, fs: FeedStep, moved: int | None) -> int:
        """The source's done of step ``fs`` (the bytes it says it moved: ``moved``, where known, is checked)."""
        done = self.ch.recv("done", timeout=StepClock(self.stall_timeout).reply(fs.setup))
        said = field(done, "bytes", int)
        if field(done, "seq", int) != fs.seq or (moved is not None and said != moved):
            raise ProtocolError(f"sync: done from source {self.source} does not match step {fs.seq} of {moved} bytes")
        return said

    def _ack(self, fs: FeedStep, moved: int, rec: Any, wire: float) -> PairStats:
        self.ch.send("ack", seq=fs.seq, bytes=moved)
        return PairStats(self.source, -1, moved, time.perf_counter() - fs.t0, wire, fs.runs, fs.name, fs.setup,
                         rec.retries, rec.resent_bytes, rec.seconds)

    def close(self) -> None:
        for transport in self.transports.values():
            transport.close()
        self.transports = {}
        self.ch.close()
        self._landing.close()


class TargetPort:
    """A target rank's listener and its sessions with the sources that feed it (see the module docstring)."""

    def __init__(self, host: str, token: str | bytes | None, group: str, rank: int, stall_timeout: float,
                 handshake_timeout: float) -> None:
        self._key = token_key(token)
        self.group, self.rank = group, rank
        self.stall_timeout = stall_timeout
        self.handshake_timeout = handshake_timeout
        self._expected: set[int] = set()
        self._feeds: dict[int, _Feed] = {}
        self._workers = Workers(f"tensorxfer-sync-feed-{rank}")     # one step's feeds at once
        #: (socket path, key) of the copy host this target hands its ipc copies to (set by the sync), or None
        self.copy_host: tuple[str, bytes | None] | None = None
        self.gate = Gate(listen(host), self._handshake, handshake_timeout, "sync")

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.gate.address[:2]
        return host, port

    def expect(self, sources: set[int]) -> None:
        """The source ranks this rank's plan feeds it from: :meth:`admit` waits for them, and the sessions
        of the others are closed (a new epoch no longer plans them here)."""
        self._expected = set(sources)
        for source in [s for s in self._feeds if s not in self._expected]:
            self.drop(source)

    def _handshake(self, sock: socket.socket) -> tuple[Channel, bytes, int] | None:
        ch = Channel(sock)
        try:
            hello, key = server_handshake(ch, self._key, _sync_caps(self.group, "target", self.rank),
                                          self.handshake_timeout)
            theirs = field(field(hello, "capabilities", dict), "sync", dict)
            source = theirs.get("rank")
            # any source of the group: the one a later epoch plans may connect before this rank planned it
            if theirs.get("group") != self.group or theirs.get("role") != "source" or type(source) is not int:
                log.warning("sync: target %d refused a connection claiming %r", self.rank, theirs)
                ch.close()
                return None
            return ch, key, int(source)
        except BaseException:
            ch.close()
            raise

    def admit(self, timeout: float, closing: Callable[[], bool] = lambda: False) -> None:
        """Wait until every expected source connected (each once; a source connecting again replaces itself;
        one connecting early for a later epoch is kept).

        Raises
        ------
        TransferTimeout
            A source did not connect in time (named).
        """
        while not self._expected <= set(self._feeds):
            deadline = time.monotonic() + timeout
            try:
                [(_, (ch, key, source))] = self.gate.admit(
                    1, timeout=control.remaining(deadline),
                    abort=lambda: "the sync was closed" if closing() else None)
            except TransferTimeout:
                missing = sorted(self._expected - set(self._feeds))
                raise TransferTimeout(f"sync: target {self.rank}: source rank(s) {missing} did not connect "
                                              f"within {timeout:.0f} s") from None
            old = self._feeds.pop(source, None)
            if old is not None:
                old.close()
            self._feeds[source] = _Feed(ch, key, source, self.stall_timeout, self.copy_host)

    def step(self, region: TensorRegion, segments: Mapping[int, Segments | Parts], deadline: float | None, digest: str,
             step: int | None) -> dict[int, Any]:
        """Receive one step from every source in ``segments``: source rank -> (version, PairStats) or the
        exception that ended its part (the caller decides what the step is).  A source's step in parts
        (:data:`Parts`) lands them in order on one thread: each later offer within the stall timeout of the
        part before it.

        The offers must come by ``deadline`` (``time.monotonic()``; None: the first may take as long as the
        trainer does), and the rest within the stall timeout of the first: a source that stalled before it
        offered is named then.

        This thread takes the offers as they arrive and accepts each at once; each pair's data (and its done
        and ack) then runs on a thread of its own.  With a thread per pair from the offer on, four pairs'
        offers and chunk tables took turns for the GIL: on the H200 machine the copies were launched
        0.75-1.0 ms into a step, 0.2-0.5 ms after their chunk tables had arrived (this way: not yet measured)."""
        results: dict[int, Any] = {}
        parts = {s: parts_of(seg) for s, seg in segments.items()}

        def land(source: int, fs: FeedStep) -> None:
            try:
                feed = self._feeds[source]
                if len(parts[source]) > 1 and feed.overlaps(fs):
                    results[source] = feed.land_parts(region, fs, parts[source][1:], digest, step)
                    return
                version, stats = feed.land(fs)
                for part, later in enumerate(parts[source][1:], 1):
                    got, more = feed.land(feed.take_offer(region, later, digest, step, part))
                    if got != version:
                        raise ProtocolError(f"sync: source {source} sent part {part} of its step as version {got}, "
                                            f"its part 0 as {version}")
                    stats = stats.then(more, time.perf_counter() - fs.t0)
                results[source] = (version, stats)
            except BaseException as e:
                results[source] = e
        for s in sorted(set(segments) - set(self._feeds)):
            results[s] = PeerLost(f"source rank {s} is not connected (its session failed and it did not come back)")
        waiting = {self._feeds[s].ch.sock.fileno(): s for s in sorted(segments) if s in self._feeds}
        batch = self._workers.batch(len(waiting))
        try:
            poller = select.poll()
            for fd in waiting:
                poller.register(fd, select.POLLIN)
            start, since = time.monotonic(), "it began"
            while waiting:
                left = None if deadline is None else max(0, math.ceil((deadline - time.monotonic()) * 1000))
                ready = poller.poll(left)
                if not ready:
                    for s in waiting.values():
                        results[s] = TransferTimeout(
                            f"no offer from source {s} within {time.monotonic() - start:.1f} s of this step ({since}): "
                            f"it stalled or died before sending (stall timeout {self.stall_timeout:g} s)")
                    break
                now = time.monotonic()
                since = "another source offered at once"
                deadline = now + self.stall_timeout if deadline is None else min(deadline, now + self.stall_timeout)
                for fd, _ in ready:
                    source = waiting.pop(fd)
                    poller.unregister(fd)
                    try:
                        fs = self._feeds[source].take_offer(region, parts[source][0], digest, step)
                    except BaseException as e:
                        results[source] = e
                        continue
                    if waiting:
                        batch.submit(functools.partial(land, source, fs))
                    else:   # the last offer: its data on this thread, which has nothing else to do (a handoff
                        land(source, fs)    # wakes a thread: ~0.1-0.3 ms on the H200 machine)
        finally:
            batch.join()
        return results

    def drop(self, source: int) -> None:
        feed = self._feeds.pop(source, None)
        if feed is not None:
            feed.close()

    def close(self) -> None:
        for source in list(self._feeds):
            self.drop(source)
        self.gate.close()
        self._workers.close()
