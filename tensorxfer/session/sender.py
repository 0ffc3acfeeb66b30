"""The sending end: :class:`Sender`, one session to a receiver that sends regions, repeatedly.

A Sender opens one control connection (hello, mutual HMAC authentication when a token is set) and keeps
it for its lifetime; every :meth:`Sender.send` is one offer -> accept -> data -> done -> ack exchange
(``docs/protocol.md``).  The transport is set up on the first update and reused by every later one, so
a training step's update registers and connects nothing (:class:`TransferStats` shows it).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from tensorxfer import connections
from tensorxfer.checksum import ALGORITHM, tensor_checksums
from tensorxfer.errors import (
    LayoutError,
    LinkDropped,
    PeerLost,
    ProtocolError,
    TensorXferError,
    TransferError,
    TransferTimeout,
)
from tensorxfer.manifest import Manifest
from tensorxfer.protocol import Channel, Version, client_handshake, field, packed_digest, parse_address, token_key
from tensorxfer.region import TensorRegion
from tensorxfer.session import control, partial
from tensorxfer.session.hooks import ForwardHooks
from tensorxfer.session.partial import Checker
from tensorxfer.session.recovery import DEFAULT_POLICY, RecoveryPolicy, Resumer
from tensorxfer.session.stats import TransferStats, UpdateClock
from tensorxfer.transport import TRANSPORTS, check_requested, choose, local_capabilities, local_transports
from tensorxfer.transport.base import MAX_STREAMS, Progress, SenderTransport, setup_flag


class Sender:
    """One session to a receiver; sends regions, repeatedly.

    Parameters
    ----------
    connect : str or (str, int)
        The receiver's ``HOST:PORT`` (or ``(host, port)``, as :attr:`Receiver.address` gives it).
    token : str or bytes, optional
        Shared secret (must match the receiver's).
    transport : str
        ``"auto"`` or a forced transport name (``"tcp"``).
    streams : int, optional
        Parallel data streams to ask for (default: the transport's measured default).
    stall_timeout : float
        Seconds without progress before :class:`TransferTimeout`.
    connect_timeout : float
        Seconds to keep trying to reach a receiver that is not listening yet (a receiver process still
        starting), and to complete the handshake.
    recovery : RecoveryPolicy or None
        How many resume rounds (and how late) this sender follows when data streams break within an
        update (:mod:`tensorxfer.session.recovery`; tcp); ``None``: a broken stream fails the update.

    Raises
    ------
    PeerLost
        No receiver answered at the address within ``connect_timeout``.
    AuthError
        Tokens differ (no data moves).
    ProtocolError
        The receiver speaks another protocol version.
    TransportUnavailable
        A forced transport cannot run here or on the receiver.
    """

    def __init__(self, connect: str | tuple[str, int], token: str | bytes | None = None, transport: str = "auto",
                 streams: int | None = None, stall_timeout: float = control.DEFAULT_STALL_TIMEOUT,
                 connect_timeout: float = control.DEFAULT_HANDSHAKE_TIMEOUT,
                 recovery: RecoveryPolicy | None = DEFAULT_POLICY) -> None:
        check_requested(transport)
        if streams is not None and not 1 <= streams <= MAX_STREAMS:
            raise ValueError(f"streams must be between 1 and {MAX_STREAMS}, got {streams}")
        host, port = parse_address(connect)
        self.streams = streams
        self.stall_timeout, connect_timeout = control.seconds(stall_timeout=stall_timeout,
                                                              connect_timeout=connect_timeout)
        self.recovery = recovery
        self._lock = threading.Lock()
        self._seq = 0
        self._channel: Channel | None = None
        self._broken: str | None = None
        self._transports: dict[str, SenderTransport] = {}      # this session's, by name
        self._last_manifest: tuple[Manifest, bytes, bytes] | None = None   # (manifest, packed, digest)
        self._packed: TensorRegion | None = None     # where a mapping passed to send() is packed
        sock = _connect(host, port, connect_timeout)
        ch = Channel(sock)
        try:
            hello, self._session_key = client_handshake(
                ch, token_key(token), {"transports": local_transports(), "transport_caps": local_capabilities()},
                connect_timeout)
            caps = field(hello, "capabilities", dict)
            peer = field(caps, "transports", list)
            transport_caps = field(caps, "transport_caps", dict, optional=True) or {}
            self.transport = choose(transport, [t for t in peer if isinstance(t, str)], transport_caps)
            #: what the receiver said of the chosen transport in its hello (ipc: ``files`` when it takes a
            #: sender's files, :attr:`TensorRegion.source_files`); untrusted, only a hint for what to send
            self.peer_caps: dict[str, Any] = dict(transport_caps.get(self.transport) or {}) \
                if isinstance(transport_caps.get(self.transport), dict) else {}
        except BaseException:
            ch.close()
            raise
        self._channel = ch

    @property
    def closed(self) -> bool:
        return self._channel is None

    def ended_by_peer(self) -> bool:
        """Whether the receiver has ended this session between updates (it closed the connection, e.g. to
        serve another sender): then the next :meth:`send` would fail, and a new Sender is needed.  Does not
        block; a receiver says nothing between updates, so anything readable means the session is over."""
        ch = self._channel
        if ch is None:
            return True
        with self._lock:
            try:
                return connections.readable_now(ch.sock)
            except ProtocolError:       # closed here meanwhile
                return True

    def send(self, region: TensorRegion | Mapping[str, Any], verify: bool = False,
             progress: Progress | None = None, forward: ForwardHooks | None = None,
             pieces: Checker | None = None) -> TransferStats:
        """Send ``region`` (its manifest and payload) and wait for the receiver's ack.

        Parameters
        ----------
        region : TensorRegion or mapping of str to tensor
            The caller keeps it alive and unchanged until this returns.  A mapping (numpy, torch, ... as
            for :meth:`TensorRegion.from_tensors`) is packed into a region this Sender keeps: one copy per
            send (a region made once -- :meth:`TensorRegion.from_module` -- needs none).
        verify : bool
            Send per-tensor xxh3_64 checksums; the receiver checks them.
        progress : callable, optional
            Called with byte counts as data goes out (from stream threads).
        forward : ForwardHooks, optional
            Makes this send a hop of a fan-out (:mod:`tensorxfer.fanout` fills it).
        pieces : Checker, optional
            Offer a partial update (:mod:`tensorxfer.session.partial`): pieces the receiver already holds
            and this checker confirms are not sent (``tensorxfer-send`` resuming an interrupted transfer).

        Raises
        ------
        PeerLost
            The receiver died or closed the session.
        TransferTimeout
            The receiver stopped reading for ``stall_timeout`` seconds.
        ManifestError
            The receiver refused the offer (e.g. over its size limit).
        ChecksumMismatch
            ``verify`` found a tensor that arrived corrupted (``.tensor``).
        TransferError
            The session is closed, or broken by an earlier failure.
        TypeError
            ``region`` is neither a region nor a mapping of tensors (nothing is sent; the session stays).
        BindingError
            A tensor of the module the region was adopted from was replaced (nothing is sent).
        """
        with self._lock:
            ch = self._channel
            if ch is None:
                raise TransferError(f"this Sender is closed{': ' + self._broken if self._broken else ''}; "
                                    f"open a new one")
            # Argument errors come before anything is sent: they leave the session as it was.
            region = self._region_of(region)
            region.ensure_current()
            try:
                return self._send(ch, region, verify, progress, forward or ForwardHooks(), pieces)
            except BaseException as e:
                self._broken = f"an earlier transfer failed ({type(e).__name__})"
                self.close()
                raise

    def _region_of(self, obj: Any) -> TensorRegion:
        """``obj`` if it is a region; a mapping of tensors packed into the region this Sender keeps for them
        (the same layout as last time: copied in place).

        Raises
        ------
        TypeError
            Anything else (a module: adopt it with ``TensorRegion.from_module``).
        """
        if isinstance(obj, TensorRegion):
            return obj
        if isinstance(obj, Mapping):
            packed = self._packed
            if packed is not None and not packed.closed:
                try:
                    packed.update_from(obj)
                    return packed
                except LayoutError:
                    packed.close()      # another layout: packed anew below
            self._packed = TensorRegion.from_tensors(obj)
            return self._packed
        hint = (" (adopt it once with tensorxfer.TensorRegion.from_module(module); then send that region)"
                if hasattr(obj, "named_parameters") else "")
        raise TypeError(f"send() takes a TensorRegion or a mapping of name -> tensor, got {type(obj).__name__}"
                        f"{hint}")

    def _wire_manifest(self, manifest: Manifest) -> tuple[bytes, bytes]:
        """The packed manifest and its digest, kept while the (immutable) manifest is the same object."""
        last = self._last_manifest
        if last is None or last[0] is not manifest:
            packed = manifest.pack()
            last = self._last_manifest = (manifest, packed, packed_digest(packed))
        return last[1], last[2]

    def _transport(self, ch: Channel) -> SenderTransport:
        """This session's transport (made on its first use, reused by every later update)."""
        transport = self._transports.get(self.transport)
        if transport is None:
            ctx = control.transfer_context(ch, self._session_key, self.stall_timeout, self.streams)
            transport = self._transports[self.transport] = TRANSPORTS[self.transport][0](ctx)
        return transport

    def _send(self, ch: Channel, region: TensorRegion, verify: bool, progress: Progress | None,
              forward: ForwardHooks, pieces: Checker | None = None) -> TransferStats:
        clock = UpdateClock()
        self._seq += 1
        seq = self._seq
        relayed = forward.relayed     # the region may still be landing: checksums come from upstream
        still_landing = forward.landing is not None       # relayed, or still being read from files here
        checksums = ([ALGORITHM, np.array(tensor_checksums(region), dtype="<u8").tobytes()]
                     if verify and not still_landing else None)
        packed, digest = self._wire_manifest(region.manifest)
        version = forward.version or Version(seq, digest)
        extra: dict[str, Any] = {"chain": list(forward.chain), "chain_transport": forward.chain_transport} \
            if forward.chain else {}
        if relayed:
            extra["relayed"] = True     # the receiver learns a repaired chain may send this update again
        transport = self._transport(ch)
        # a transport that does not follow a still-landing region got it whole (_send_payload): nothing to follow
        resumer = Resumer(transport, region, seq, self.recovery, progress,
                          forward.landing if transport.follows_landing else None)
        fresh = transport.needs_setup(region)
        # A warm plain update over a transport that needs nothing from the accept (ipc) sends its data and
        # done right behind the offer: the receiver finds them waiting once it accepted, so an update costs
        # one round trip of the control channel instead of three.
        early = transport.posts_early and not fresh and not forward.chain and forward.landing is None \
            and pieces is None
        partial_offer = pieces is not None and not forward.chain and self.transport in partial.PARTIAL_TRANSPORTS
        ch.send("offer", seq=seq, manifest=packed, transport=self.transport, streams=self.streams, verify=verify,
                fresh=fresh, version=version.as_wire(), resume=resumer.enabled and not early, partial=partial_offer,
                **extra)
        registered = transport.counters.registrations
        segments, kept = None, 0
        if partial_offer:
            assert pieces is not None
            segments, kept = partial.sender_settle(ch, seq, pieces, region, self.stall_timeout)
        if early:
            posted = time.perf_counter()
            nbytes = transport.post_early(region, seq)
            ch.send("done", seq=seq, bytes=nbytes, checksums=checksums)
        # The receiver commits its region before accepting (MAP_POPULATE), which on fresh memory can run at
        # ~180 MB/s (measured on a 2-vCPU VM), so the accept wait also grows with the region.
        accept = ch.recv("accept", timeout=control.control_timeout(self.stall_timeout)
                         + region.nbytes / control.ALLOCATION_FLOOR_BYTES_PER_S)
        if field(accept, "seq", int) != seq or field(accept, "transport", str) != self.transport:
            raise ProtocolError(f"accept does not match offer {seq} over {self.transport!r}: {accept.get('seq')}, "
                                f"{accept.get('transport')!r}")
        descriptors = field(accept, "descriptors", dict)
        setup = setup_flag(descriptors)
        if early:
            if setup:
                raise ProtocolError(f"the receiver set the {self.transport} data path up again (accept of update "
                                    f"{seq}), but this warm update's data was already on its way")
            with clock.wire(since=posted):
                transport.collect(progress)
        else:
            t1 = time.perf_counter()
            if segments is None:
                transport.connect(region, seq, descriptors)
            else:
                transport.connect(region, seq, descriptors, segments=segments)
            receiver_setup = accept.get("setup_seconds")
            clock.setup_seconds = time.perf_counter() - t1 + (receiver_setup if isinstance(receiver_setup, float)
                                                              else 0.0)
            transport.resumable = resumer.enabled
            with clock.wire():
                try:
                    nbytes = self._send_payload(transport, region, progress, forward, segments is not None)
                except LinkDropped as e:    # the receiver knows what landed: it asks for the rest after our done
                    nbytes = resumer.broke(e)
                finally:
                    transport.resumable = False
            if relayed and forward.checksums is not None:
                checksums = forward.checksums()
            elif verify and still_landing:      # the payload went out as it was read: every byte is here now
                if resumer.dropped is not None and forward.landing is not None:
                    forward.landing.wait_range(0, region.nbytes)    # unless a broken stream stopped short of it
                checksums = [ALGORITHM, np.array(tensor_checksums(region), dtype="<u8").tobytes()]
            ch.send("done", seq=seq, bytes=nbytes, checksums=checksums)
        setup = setup or transport.counters.registrations > registered    # ipc: handles passed with the data
        ack = self._wait_ack(ch, seq, nbytes, verify, forward, resumer)
        if forward.on_ack is not None:
            forward.on_ack(ack)
        return clock.stats(nbytes, self.transport, field(descriptors, "streams", int, optional=True) or 0,
                           transport.counters, transport.registration, verified=verify,
                           reallocated=bool(accept.get("reallocated")), update=seq, setup=setup,
                           recovery=resumer.recovery, kept_bytes=kept)

    @staticmethod
    def _send_payload(transport: SenderTransport, region: TensorRegion, progress: Progress | None,
                      forward: ForwardHooks, segmented: bool = False) -> int:
        """Move the payload; a relay's region goes only as far as it landed (see ``SenderTransport.landing``).
        A partial update's segments go once the whole region landed (they follow no landing)."""
        landing = forward.landing
        if landing is None:
            return transport.send(region, progress)
        if not transport.follows_landing or segmented:
            landing.wait_range(0, region.nbytes)    # store and forward
            return transport.send(region, progress)
        transport.landing = landing
        try:
            return transport.send(region, progress)
        finally:
            transport.landing = None

    def _wait_ack(self, ch: Channel, seq: int, nbytes: int, verify: bool, forward: ForwardHooks,
                  resumer: Resumer) -> dict[str, Any]:
        """The receiver's ack.  While it verifies and runs its on_landed (the CLI writes the files) it sends
        "wait" frames: each resets the stall wait, so only a receiver that stopped answering times out early.
        The whole wait is still bounded (hashing at >= 1 GB/s, writing at >= 100 MB/s, plus a minute, plus,
        for a fan-out, what the rest of the chain may take), so a hanging on_landed cannot hold this sender
        forever.  A ``resume`` frame (the receiver lost data streams) is followed (:class:`Resumer`) and
        starts the wait anew."""
        limit = control.control_timeout(self.stall_timeout)
        waited_from = time.monotonic()
        give_up = waited_from + limit + 60.0 + nbytes / control.ALLOCATION_FLOOR_BYTES_PER_S \
            + (nbytes / 1e9 if verify else 0.0) + forward.ack_allowance
        while True:
            left = give_up - time.monotonic()
            if left <= 0:
                raise TransferTimeout(f"the receiver kept working on transfer {seq} past {give_up - waited_from:.0f} s "
                                      f"without acknowledging it (its on_landed may hang)")
            try:
                ack = ch.recv("ack", "wait", "resume", timeout=resumer.wait_limit(min(limit, left), self.stall_timeout))
            except TensorXferError as e:
                raise resumer.failed(e) from None
            if ack["type"] == "resume":
                resumer.follow(ack)
                give_up += time.monotonic() - waited_from
                waited_from = time.monotonic()
            elif ack["type"] == "ack":
                break
        if field(ack, "seq", int) != seq or field(ack, "bytes", int) != nbytes:
            raise ProtocolError(f"ack does not match transfer {seq} of {nbytes} bytes")
        return ack

    def close(self) -> None:
        """Say goodbye (best effort) and close the session and its transports; idempotent.

        From another thread it ends a :meth:`send` in flight (with :class:`PeerLost` or
        :class:`TransferError`): no goodbye then, the control connection is shut down, which wakes it.
        """
        idle = self._lock.acquire(blocking=False)   # False: a send() is in flight (in another thread, or failing)
        try:
            packed, self._packed = self._packed, None
            if packed is not None:
                packed.close()
            transports, self._transports = self._transports, {}
            for transport in transports.values():
                transport.close()
            ch, self._channel = self._channel, None
            if ch is None:
                return
            if idle and self._broken is None:
                try:
                    ch.sock.settimeout(1.0)
                    ch.send("bye")
                except TensorXferError:
                    pass   # the receiver is already gone; closing is all that is left
            else:
                try:
                    ch.sock.shutdown(socket.SHUT_RDWR)  # closing alone does not wake a thread blocked on it
                except (OSError, ProtocolError):
                    pass    # already reset or closed: nothing to wake
            ch.close()
        finally:
            if idle:
                self._lock.release()

    def __enter__(self) -> Sender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Sender {'closed' if self.closed else self._channel.peer if self._channel else ''}>"


def _connect(host: str, port: int, timeout: float) -> socket.socket:
    """A connection to ``host:port``, retried while nothing listens there yet (a receiver still starting), up
    to ``timeout`` seconds -- as torch.distributed's store clients wait for their server.

    Raises
    ------
    PeerLost
        Still nothing listening (or the host unreachable) when the time is up; the message says which.
    """
    deadline = time.monotonic() + timeout
    pause = 0.05
    while True:
        try:
            return socket.create_connection((host, port), timeout=max(0.1, deadline - time.monotonic()))
        except (ConnectionRefusedError, ConnectionResetError) as e:
            if time.monotonic() + pause >= deadline:
                raise PeerLost(f"no receiver is listening at {host}:{port} (tried for {timeout:g} s: {e.strerror}); "
                               f"start tensorxfer-recv (or the Receiver) there first, or give it longer "
                               f"(connect_timeout / --connect-timeout)") from None
            time.sleep(pause)
            pause = min(pause * 2, 0.5)
        except OSError as e:
            why = connections.connect_words(e, host)
            raise PeerLost(f"cannot connect to a receiver at {host}:{port}: {why}") from None
