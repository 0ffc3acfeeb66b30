"""RDMA transport endpoints: one-sided RDMA WRITE of a whole region over RC QPs.

The receiver registers its region once (REMOTE_WRITE, for as long as the endpoint is open), the sender
registers its own region once (local access only), and each update is one :meth:`RdmaSenderEndpoint.write`:
the region is striped over several RC QPs, the last request on every QP carries an immediate, and
:meth:`RdmaReceiverEndpoint.wait_complete` returns only when every QP's immediate for that update arrived.

Wiring (the engine's control channel carries the dicts; both are plain
msgpack-able values: ints, strs, bytes, lists, dicts)::

    rx = RdmaReceiverEndpoint(region_rx, qps=4)       # receiver
    tx = RdmaSenderEndpoint(region_tx, qps=4)         # sender
    tx.connect(rx.descriptors())                      # receiver → sender
    rx.connect(tx.descriptors())                      # sender → receiver
    stats = tx.write(timeout=30)                      # per update …
    rx.wait_complete(timeout=30)                      # … and its completion
    tx.close(); rx.close()

A region is anything with ``resolve_extent(offset, length)`` (HostRegion, CudaRegion) or a
:class:`~tensorxfer.region.TensorRegion`.  CUDA regions that offer ``export_dmabuf()`` are registered with
``ibv_reg_dmabuf_mr``, falling back to ``ibv_reg_mr`` on the device address (nvidia-peermem); the path taken
is logged and reported in ``descriptors()['mr_path']``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from array import array
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tensorxfer.errors import (
    PeerLost,
    ProtocolError,
    TransferError,
    TransferTimeout,
    TransportUnavailable,
    VerbsError,
)
from tensorxfer.transport.rdma_mr import register_region
from tensorxfer.transport.rdma_wire import PROTOCOL_VERSION, qp_requests, scatter_table, share_bytes
from tensorxfer.transport.rdma_wire import check_peer as _check_peer

log = logging.getLogger("tensorxfer.rdma")

try:
    from tensorxfer.transport import _verbs
except ImportError as exc:  # built without libibverbs-dev, or TENSORXFER_NO_VERBS=1
    _verbs = None  # type: ignore[assignment]
    _IMPORT_ERROR: str | None = str(exc)
else:
    _IMPORT_ERROR = None

#: QPs per peer.  On Soft-RoCE 2–4 QPs beat 1 (the kernel's per-QP tasklets
#: run in parallel); on ConnectX-7 4 QPs saturate 400 Gbps with 1 MiB WRs.
#: benchmarks/bench_rdma.py sweeps this; see docs/rdma.md.
DEFAULT_QPS = 4
DEFAULT_WR_SIZE = 1 << 20
DEFAULT_MAX_OUTSTANDING = 32
#: Threads a sender posts from, each with its own group of QPs and its own CQ.  A software provider
#: (Soft-RoCE's rdma_rxe, siw) does the protocol work (packets, copy, ICRC) inside the thread that rings
#: the doorbell, so one posting thread caps it at one CPU: in the Soft-RoCE VM (2 vCPUs) a 64 MiB warm
#: update reached 0.91x ib_write_bw from one thread, 1.91x from two, 1.67x from four (docs/rdma.md).  A
#: hardware NIC does that work itself; the second thread then sleeps on its CQ's completion channel.
DEFAULT_POST_THREADS = 2
#: Receives posted per QP.  Each WRITE_WITH_IMM consumes one, and a relay's sender marks up to every
#: request (``max_outstanding`` in flight per QP) while the receiver may be off reporting a piece; a
#: missing receive is not an error (RNR retries forever) but costs a retry timer each.
DEFAULT_RECV_DEPTH = 2 * DEFAULT_MAX_OUTSTANDING
#: Requests chained per ibv_post_send.  Measured on Soft-RoCE: chaining 1 MiB
#: requests halves throughput (each post is a syscall that runs rxe's requester
#: inline, so one post per request gives it more process-context time).  On
#: hardware NICs a post is a userspace doorbell; at >= 64 KiB per request one
#: doorbell each is noise, while small requests gain from chaining.
DEFAULT_POST_BATCH_LARGE = 1
DEFAULT_POST_BATCH_SMALL = 32


def default_post_batch(wr_size: int) -> int:
    """Requests chained per post: 1 for requests of 64 KiB and more, else 32."""
    return DEFAULT_POST_BATCH_LARGE if wr_size >= 64 << 10 else DEFAULT_POST_BATCH_SMALL
_POLL_SLICE = 0.05


def rdma_available(device: str | None = None, port: int = 1) -> tuple[bool, str]:
    """Can this process use RDMA?  ``(True, 'rxe0 port 1 ACTIVE, RoCE v2 …')`` or ``(False, why)``."""
    if _verbs is None:
        return False, (f"tensorxfer.transport._verbs is not built ({_IMPORT_ERROR}); install libibverbs-dev "
                       f"and reinstall tensorxfer")
    missing = _verbs.library_error()
    if missing is not None:     # the module is there, rdma-core is not (it is loaded at run time)
        return False, missing
    names = _verbs.device_names()
    if not names:
        return False, ("no RDMA devices (ibv_get_device_list is empty): no NIC/driver, or for Soft-RoCE "
                       "`modprobe rdma_rxe && rdma link add rxe0 type rxe netdev ETH`")
    if device is not None and device not in names:
        return False, f"RDMA device {device!r} not found; devices here: {names}"
    name = device or names[0]
    try:
        with _verbs.Context.open(name) as ctx:
            pa = ctx.query_port(port)
            if not pa["active"]:
                return False, f"{name} port {port} is {pa['state']}, not ACTIVE (check the link / `rdma link`)"
            idx, _gid = ctx.choose_gid(port)
    except VerbsError as exc:
        return False, f"{name}: {exc}"
    return True, f"{name} port {port} ACTIVE, {pa['link_layer']}, MTU {pa['active_mtu']}, GID index {idx}"


def _require_verbs() -> Any:
    if _verbs is None:
        raise TransportUnavailable(f"the RDMA transport is not built: {_IMPORT_ERROR}; install libibverbs-dev "
                                   f"and reinstall tensorxfer (TENSORXFER_NO_VERBS must be unset)")
    missing = _verbs.library_error()
    if missing is not None:
        raise TransportUnavailable(missing)
    return _verbs


def _raw_region(region: Any) -> tuple[Any, int]:
    """(memory region object, payload bytes) for a HostRegion/CudaRegion or a TensorRegion."""
    inner = getattr(region, "region", None)
    if inner is not None and hasattr(region, "manifest"):
        return inner, max(int(region.nbytes), 1)
    if not hasattr(region, "resolve_extent"):
        raise TypeError(f"expected a HostRegion, CudaRegion or TensorRegion, got {type(region).__name__}")
    return region, int(region.size)


class _Endpoint:
    """Shared setup: context, PD, CQ, QPs, one MR over the region; children closed first."""

    _role = ""
    _access = 0

    def __init__(self, region: Any, device: str | None, port: int, gid_index: int | None, qps: int,
                 max_send_wr: int, max_recv_wr: int, _first_chunk_only: bool = False, cq_groups: int = 1) -> None:
        v = _require_verbs()
        if not isinstance(qps, int) or not 1 <= qps <= 256:
            raise ValueError(f"qps must be an int in [1, 256], got {qps!r}")
        self._region, self.nbytes = _raw_region(region)
        self._closed = True  # until fully built: a failed __init__ leaves nothing to warn about
        self._broken: BaseException | None = None
        self._peer: dict[str, Any] | None = None
        self.port = port
        names = v.device_names()
        if not names:
            raise TransportUnavailable("no RDMA devices (ibv_get_device_list is empty): no NIC/driver here; run "
                                       "`tensorxfer doctor` for what is missing")
        if device is not None and device not in names:
            raise TransportUnavailable(f"RDMA device {device!r} not found; devices here: {names}")
        self._ctx = v.Context.open(device)
        try:
            self._pa = self._ctx.query_port(port)
            if not self._pa["active"]:
                raise TransportUnavailable(f"{self._ctx.name} port {port} is {self._pa['state']}, not ACTIVE")
            self.gid_index, self._gid = self._ctx.choose_gid(port, gid_index)
            self._pd = self._ctx.alloc_pd()
            self._mr = register_region(self._pd, self._region, self.nbytes, self._access,
                                       _first_chunk_only=_first_chunk_only)
            # QPs [first, first + count) share the CQ of their group (one group per posting thread)
            cq_groups = min(cq_groups, qps)
            self._groups = [(g * qps // cq_groups, (g + 1) * qps // cq_groups - g * qps // cq_groups)
                            for g in range(cq_groups)]
            self._wr_depth = (max_send_wr, max_recv_wr)
            self._make_qps()
        except BaseException:
            self._ctx.close()  # closes children first: QPs, MR, CQ, PD
            raise
        self._closed = False

    def _make_qps(self) -> None:
        """CQs (one per group) and QPs in INIT, under the PD and MR this endpoint keeps for its life."""
        max_send_wr, max_recv_wr = self._wr_depth
        self._cqs = [self._ctx.create_cq(count * (max(max_send_wr, max_recv_wr) + 1) + 16)
                     for _, count in self._groups]
        self._cq = self._cqs[0]
        self._qps = [self._pd.create_qp(cq, cq, max_send_wr, max_recv_wr)
                     for cq, (_, count) in zip(self._cqs, self._groups) for _ in range(count)]
        self._psns = [int.from_bytes(os.urandom(3), "little") for _ in self._qps]
        for qp in self._qps:
            qp.to_init(self.port, self._remote_access())

    def qp_index(self, qp_num: int) -> int | None:
        """The index of this endpoint's QP numbered ``qp_num`` (None: not one of ours)."""
        for i, qp in enumerate(self._qps):
            if not qp.closed and qp.qp_num == qp_num:
                return i
        return None

    def break_qp(self, index: int) -> None:
        """Move QP ``index`` to the error state now (a test's fault, made for real; see ``rdma_engine.Fault``)."""
        self._qps[index % len(self._qps)].to_error()

    def faulted(self, index: int) -> bool:
        """Whether QP ``index`` is already in the error state (a test's fault or :meth:`halt` moved it there;
        :meth:`renew` makes new ones): a fault does not break it again."""
        return bool(self._qps) and self._qps[index % len(self._qps)].state == "ERR"

    def halt(self) -> None:
        """Move every QP to the error state: nothing more is sent or lands through them (a broken update)."""
        self._check_open()
        for qp in self._qps:
            if not qp.closed:
                qp.to_error()

    def renew(self) -> None:
        """New QPs (and CQs: no completion of the old QPs can be mistaken for a new one's) after a broken
        update, under the same PD and MR: the registration is kept, only the connection is made again.
        :meth:`connect` to the peer's new descriptors next.  On failure the endpoint is closed (nothing
        half-built is left) and the error raised."""
        self._check_open()
        old_qps, old_cqs = self._qps, self._cqs
        self._qps, self._cqs, self._peer, self._broken = [], [], None, None
        try:
            for obj in (*old_qps, *old_cqs):    # children first: a CQ is not destroyed under its QPs
                obj.close()
            self._make_qps()
        except BaseException:
            self.close()
            raise

    def _remote_access(self) -> int:
        return 0

    @property
    def ready(self) -> bool:
        """Whether every QP is ready to send (none was moved to the error state by :meth:`halt` or a fault)."""
        return all(not qp.closed and qp.state == "RTS" for qp in self._qps)

    def mark_broken(self, why: BaseException) -> None:
        self._broken = why

    @property
    def broken(self) -> bool:
        """Whether a failed update left the QPs unusable (:meth:`renew` or a new endpoint)."""
        return self._broken is not None

    @property
    def device(self) -> str:
        return str(self._ctx.name)

    @property
    def mr_path(self) -> str:
        return str(self._mr.path)

    @property
    def qp_count(self) -> int:
        return len(self._qps)

    @property
    def max_message_bytes(self) -> int:
        """The port's largest message: no work request may be larger."""
        return int(self._pa["max_msg_sz"])

    def descriptors(self) -> dict[str, Any]:
        """What the peer needs to connect, as a msgpack-able dict."""
        self._check_open()
        d: dict[str, Any] = {
            "transport": "rdma", "version": PROTOCOL_VERSION, "role": self._role,
            "device": self._ctx.name, "port": self.port, "lid": int(self._pa["lid"]), "gid": self._gid,
            "gid_index": self.gid_index, "mtu": int(self._pa["active_mtu"]), "link_layer": self._pa["link_layer"],
            "qps": [{"qp_num": int(qp.qp_num), "psn": psn} for qp, psn in zip(self._qps, self._psns)],
            "nbytes": self.nbytes, "mr_path": self._mr.path,
        }
        return d

    def _connect_qps(self, peer: dict[str, Any]) -> None:
        if len(peer["qps"]) != len(self._qps):
            raise ProtocolError(f"peer has {len(peer['qps'])} QPs, this endpoint {len(self._qps)}: use the same qps=")
        if self._peer is not None:
            raise ValueError("endpoint is already connected")
        is_global = self._pa["link_layer"] == "Ethernet" or peer["link_layer"] == "Ethernet" or peer["lid"] == 0
        mtu = min(int(self._pa["active_mtu"]), int(peer["mtu"]))
        for qp, psn, rq in zip(self._qps, self._psns, peer["qps"]):
            qp.to_rtr(self.port, rq["qp_num"], rq["psn"], mtu, peer["lid"], peer["gid"], self.gid_index, is_global)
            qp.to_rts(psn)
        self._peer = peer

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"operation on a closed {type(self).__name__}")

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Destroy QPs, deregister the MR (revoking remote access), free PD, CQ, device; idempotent."""
        if self._closed:
            return
        self._closed = True
        first: VerbsError | None = None
        for obj in (*getattr(self, "_qps", ()), self._mr, *getattr(self, "_cqs", ()), self._pd, self._ctx):
            try:
                obj.close()
            except VerbsError as exc:  # keep releasing the rest; report the first failure
                first = first or exc
        if first is not None:
            raise first

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            import warnings

            warnings.warn(f"unclosed {type(self).__name__}; call close()", ResourceWarning, stacklevel=2)
            self.close()


class RdmaReceiverEndpoint(_Endpoint):
    """The receiving side: grants REMOTE_WRITE on its region while open.

    Parameters
    ----------
    region : HostRegion, CudaRegion or TensorRegion
        Where updates land.  The caller keeps it open until :meth:`close`
        (a HostRegion refuses to close while registered).
    device : str, optional
        RDMA device name (``mlx5_0``, ``rxe0``); the first device when None.
    port, gid_index : int
        Port number; GID index (chosen automatically when None: RoCE v2
        IPv4-mapped on Ethernet, index 0 on InfiniBand).
    qps : int
        QPs per peer; the sender must use the same count.
    recv_depth : int
        Receives kept posted per QP (each update consumes one).
    """

    _role = "receiver"

    def __init__(self, region: Any, device: str | None = None, *, port: int = 1, gid_index: int | None = None,
                 qps: int = DEFAULT_QPS, recv_depth: int = DEFAULT_RECV_DEPTH) -> None:
        v = _require_verbs()
        self._access = v.ACCESS_LOCAL_WRITE | v.ACCESS_REMOTE_WRITE
        self._recv_depth = recv_depth
        super().__init__(region, device, port, gid_index, qps, max_send_wr=1, max_recv_wr=recv_depth)
        try:
            self._arm()
        except BaseException:
            self.close()
            raise
        self.updates = 0

    def _arm(self) -> None:
        for i, qp in enumerate(self._qps):
            qp.post_recv(self._recv_depth, i)
        self._waiter = _verbs.ImmWaiter(self._qps, self._cq)

    def renew(self) -> None:
        """As :meth:`_Endpoint.renew`, with the new QPs' receives posted."""
        super().renew()
        try:
            self._arm()
        except BaseException:
            self.close()
            raise

    def landed_requests(self) -> list[int]:
        """Per QP, its requests of the update under way known to have landed (marks)."""
        return list(self._waiter.landed())

    def halt_and_count(self, timeout: float = 2.0) -> list[int]:
        """A broken update: stop every QP (error state), take what landed before, and return per QP how many
        of its requests landed (exact when every QP's receives flushed within ``timeout``; a lower bound,
        and logged, otherwise)."""
        self.halt()
        if not self._waiter.drain(timeout):
            log.warning("rdma: not every QP flushed its receives within %.1f s; counting what landed from "
                        "the marks taken so far (some landed bytes will be sent again)", timeout)
        return list(self._waiter.landed())

    def _remote_access(self) -> int:
        return int(_verbs.ACCESS_REMOTE_WRITE | _verbs.ACCESS_LOCAL_WRITE)

    def descriptors(self) -> dict[str, Any]:
        """Adds ``addr``, ``rkey`` and ``length``: where and how the sender may write."""
        d = super().descriptors()
        d.update(addr=int(self._mr.addr), rkey=int(self._mr.rkey), length=int(self._mr.length))
        return d

    def connect(self, peer: dict[str, Any]) -> None:
        """Connect to the sender's descriptors (its QP numbers, PSNs, GID/LID, MTU).

        Raises
        ------
        ProtocolError
            ``peer`` is malformed or has a different QP count.
        """
        self._check_open()
        self._connect_qps(_check_peer(peer, "sender"))

    def wait_complete(self, timeout: float = 60.0, peer_alive: Callable[[], bool] | None = None,
                      update: int | None = None, *, marks: int = 0, wr_size: int = 0,
                      on_piece: Callable[[int, int], None] | None = None,
                      starts: list[int] | None = None) -> dict[str, Any]:
        """Block until the next update fully landed (every QP's immediate arrived).

        ``marks`` > 0 (the sender writes with the same ``marks`` and ``wr_size``): ``on_piece(offset,
        length)`` is called, in this thread, for each newly landed range of the contiguous prefix, as the
        sender's piece marks arrive (and once more for the rest when the update completes); ``timeout``
        then counts from the last progress.

        ``peer_alive`` (e.g. a check of the control connection) is called
        every 50 ms; False raises :class:`PeerLost` at once.

        ``update`` is the number the sender's immediates carry (default: this
        endpoint's count of updates + 1; the engine passes its offer's number).

        ``starts`` (with ``marks``): the update resumes after a break on new QPs, QP ``q``'s first
        ``starts[q]`` requests having landed before (:meth:`halt_and_count`); the sender writes the rest.

        Raises
        ------
        TransferTimeout
            Not complete within ``timeout`` seconds (names the QPs still missing).
        PeerLost
            ``peer_alive()`` returned False.
        VerbsError
            A receive completion failed.
        TransferError
            A piece mark the sender should not have sent (it stripes otherwise than asked).
        """
        self._check_open()
        if self._peer is None:
            raise ValueError("connect() first")
        if self._broken is not None:
            raise TransportUnavailable(f"this RDMA session is broken ({self._broken}); open a new one")
        seq = (self.updates + 1 if update is None else update) & _verbs.IMM_MASK
        self._waiter.reset(seq, marks, wr_size, self.nbytes, starts)
        t0 = time.perf_counter()
        deadline = t0 + timeout
        reported = 0
        try:
            while True:
                done = self._waiter.poll(_POLL_SLICE)
                if marks:
                    landed = self._report(reported, on_piece) if on_piece is not None else int(self._waiter.prefix())
                    if landed > reported:       # marks show progress: the timeout counts from the last one
                        deadline = max(deadline, time.perf_counter() + timeout)
                    reported = landed
                if done:
                    break
                if peer_alive is not None and not peer_alive():
                    raise PeerLost(f"sender lost during RDMA update {seq}; QPs still waiting: "
                                   f"{[hex(q) for q in self._waiter.missing()]}")
                if time.perf_counter() > deadline:
                    raise TransferTimeout(f"RDMA update {seq} incomplete after {timeout:.1f} s: no immediate yet "
                                          f"on QPs {[hex(q) for q in self._waiter.missing()]}")
        except (VerbsError, TransferError) as exc:    # the QPs may hold this update's rest: not reusable
            if not isinstance(exc, (PeerLost, TransferTimeout)):
                self._broken = exc
            raise
        self.updates += 1
        return {"update": seq, "seconds": time.perf_counter() - t0, "bytes": self.nbytes}

    def _report(self, reported: int, on_piece: Callable[[int, int], None]) -> int:
        """Pass the newly landed part of the prefix to ``on_piece``; return the new reported end."""
        prefix = int(self._waiter.prefix())
        if prefix > reported:
            on_piece(reported, prefix - reported)
        return max(prefix, reported)


class RdmaSenderEndpoint(_Endpoint):
    """The sending side: RDMA-WRITEs its region into the receiver's.

    Parameters are those of :class:`RdmaReceiverEndpoint`, plus the data-path
    tuning (all per :meth:`write` too): ``wr_size`` bytes per work request,
    ``max_outstanding`` requests in flight per QP, ``signal_every``
    (default ``max_outstanding // 4``), ``post_batch`` requests chained per
    ``ibv_post_send`` (default :func:`default_post_batch`).  ``post_threads`` (default
    :data:`DEFAULT_POST_THREADS`, at most ``qps``) threads post one update together, each its own
    contiguous group of QPs with its own CQ; the stripe (request ``i`` on QP ``i % qps``) is the same
    whatever the count, so the receiver cannot tell.  ``_first_chunk_only`` is a test switch
    reproducing the UCX bug (MR over the first handle only).
    """

    _role = "sender"

    def __init__(self, region: Any, device: str | None = None, *, port: int = 1, gid_index: int | None = None,
                 qps: int = DEFAULT_QPS, wr_size: int = DEFAULT_WR_SIZE,
                 max_outstanding: int = DEFAULT_MAX_OUTSTANDING, signal_every: int | None = None,
                 post_batch: int | None = None, post_threads: int | None = None,
                 _first_chunk_only: bool = False) -> None:
        v = _require_verbs()
        self._access = v.ACCESS_LOCAL_WRITE
        if not isinstance(max_outstanding, int) or max_outstanding < 1:
            raise ValueError(f"max_outstanding must be a positive int, got {max_outstanding!r}")
        threads = DEFAULT_POST_THREADS if post_threads is None else post_threads
        if not isinstance(threads, int) or threads < 1:
            raise ValueError(f"post_threads must be a positive int, got {post_threads!r}")
        self._pool: ThreadPoolExecutor | None = None
        self.wr_size = wr_size
        self.max_outstanding = max_outstanding
        self.signal_every = signal_every or max(1, max_outstanding // 4)
        self.post_batch = post_batch
        super().__init__(region, device, port, gid_index, qps, max_send_wr=max_outstanding, max_recv_wr=1,
                         _first_chunk_only=_first_chunk_only, cq_groups=threads)
        if len(self._groups) > 1:
            self._pool = ThreadPoolExecutor(len(self._groups) - 1, thread_name_prefix="tensorxfer-rdma-post")
        self.updates = 0
        self._states: list[array[int]] = []
        self._local_ptr = int(self._region.resolve_extent(0, self.nbytes).ptr)

    def connect(self, peer: dict[str, Any], scatter: bool = False) -> None:
        """Connect to the receiver's descriptors (its QPs plus ``addr``/``rkey``/``length``).

        ``scatter``: this session writes runs to their own places (a weight sync), so the receiver's region
        may be smaller than ours; every run is checked against its registration instead.

        Raises
        ------
        ProtocolError
            ``peer`` is malformed, or the receiver's region is smaller than ours.
        """
        self._check_open()
        peer = _check_peer(peer, "receiver")
        if peer["length"] < self.nbytes and not scatter:
            raise ProtocolError(f"receiver registered {peer['length']} bytes, sender needs {self.nbytes}")
        self._connect_qps(peer)

    def write(self, timeout: float = 60.0, *, offset: int = 0, length: int | None = None,
              wr_size: int | None = None, max_outstanding: int | None = None,
              signal_every: int | None = None, post_batch: int | None = None,
              peer_alive: Callable[[], bool] | None = None, update: int | None = None,
              marks: int = 0, ready: Any = None, runs: Any = None, starts: list[int] | None = None,
              on_slice: Callable[[int, int], None] | None = None) -> dict[str, Any]:
        """Write ``[offset, offset+length)`` of the region (default: all of it) as one update.

        Resumed (the update broke; the receiver counted what landed): ``starts`` gives per QP the first of
        its requests to write (see :func:`share_bytes`); the stripe, marks and final immediates are those of
        the whole write.  Whether it completes or raises, :attr:`last_state` then holds per QP the requests
        posted and known completed, so a broken write says what it had handed to the NIC.  ``on_slice``
        (e.g. a test's fault) is called every slice by each posting thread, in it, with ``(first, count)``: the
        QPs it posts to (:attr:`last_state` is fresh for those then).

        ``runs`` (a weight sync): ``(local offsets, remote offsets, bytes)``, three equal-length uint64 arrays:
        those runs are written instead, each to its own place in the receiver's region (cut into requests
        of at most ``wr_size``; the stripe over the QPs and the final immediates are the same).

        Relays: ``marks`` > 0 sends a piece mark every ``marks``-th request per QP (the receiver asked,
        with the ``wr_size`` to use); ``ready`` (``array('Q', [n])``, raised by another thread) lets no
        request reach past ``n`` bytes of the range until raised.  ``peer_alive`` may raise to abort.

        ``peer_alive`` (e.g. a check of the control connection) is called every
        50 ms while the write runs; False raises :class:`PeerLost` at once.
        Without it a dead receiver shows as ``IBV_WC_RETRY_EXC_ERR`` (hardware
        retry timers) or, failing that, as the ``timeout`` stall.

        ``update`` is the immediate the last request on each QP carries
        (default: this endpoint's count of updates + 1; the engine passes
        its offer's number, so both ends name the update the same way).

        Returns
        -------
        dict
            ``bytes``, ``seconds``, ``gbps``, ``wrs``, ``qps``, ``wr_size``, ``update``.

        Raises
        ------
        VerbsError
            A work completion failed: ``status`` (e.g. ``IBV_WC_LOC_PROT_ERR``),
            ``qp_num``, and ``offset``/``length`` of the failed request in the region.
            The session is unusable afterwards (its QPs are in the error state).
        TransferTimeout
            No completion for ``timeout`` seconds (peer gone, link down).
        PeerLost
            ``peer_alive()`` returned False.
        """
        self._check_open()
        if self._peer is None:
            raise ValueError("connect() first")
        if self._broken is not None:
            raise TransportUnavailable(f"this RDMA session is broken ({self._broken}); open a new one")
        length = self.nbytes - offset if length is None else length
        if offset < 0 or length < 0 or offset + length > self.nbytes:
            raise ValueError(f"range [{offset}, {offset + length}) is outside the region ({self.nbytes} bytes)")
        wr = int(wr_size or self.wr_size)
        mo = int(max_outstanding or self.max_outstanding)
        se = int(signal_every or (self.signal_every if max_outstanding is None else max(1, mo // 4)))
        pb = int(post_batch or self.post_batch or default_post_batch(wr))
        if wr > self.max_message_bytes:
            raise ValueError(f"wr_size {wr} exceeds the port's max message size {self.max_message_bytes}")
        seq = (self.updates + 1 if update is None else update) & _verbs.IMM_MASK
        table = None
        if runs is not None:
            table, length = scatter_table(runs, wr, self.nbytes, int(self._peer["length"]))
            offset = 0
        if starts is not None and (len(starts) != len(self._qps) or runs is not None or ready is not None):
            raise ValueError("starts needs one request index per QP, and no runs or ready gate")
        t0 = time.perf_counter()
        try:
            st = self._post(offset, length, wr, mo, se, seq, float(timeout), pb, peer_alive, marks, ready, table,
                            starts, on_slice)
        except VerbsError as exc:
            self._broken = exc
            if exc.offset is not None:
                exc.offset += offset
            raise
        except TransferError as exc:      # stall, peer lost, or aborted by peer_alive (upstream failed)
            self._broken = exc              # requests may still be in flight: the QPs are not reusable
            raise
        dt = time.perf_counter() - t0
        self.updates += 1
        st.update(seconds=dt, gbps=length * 8 / dt / 1e9 if dt > 0 else 0.0, qps=len(self._qps), wr_size=wr,
                  max_outstanding=mo, signal_every=se, post_batch=pb, update=seq, post_threads=len(self._groups))
        return dict(st)

    def clear_state(self) -> None:
        """Nothing posted yet in this update (:attr:`last_state` all zero)."""
        self._states = [array("Q", bytes(16 * count)) for _, count in self._groups]

    @property
    def last_state(self) -> list[tuple[int, int]]:
        """Per QP, (requests posted, requests known completed) of the last :meth:`write`, live while it runs."""
        return [(int(st[2 * k]), int(st[2 * k + 1])) for st in self._states for k in range(len(st) // 2)]

    def _post(self, offset: int, length: int, wr: int, mo: int, se: int, seq: int, timeout: float, pb: int,
              peer_alive: Callable[[], bool] | None, marks: int, ready: Any, table: Any = None,
              starts: list[int] | None = None,
              on_slice: Callable[[int, int], None] | None = None) -> dict[str, Any]:
        """Run the write loop, one group of QPs per posting thread (this one takes the first group)."""
        peer = self._peer
        assert peer is not None
        self._states = [array("Q", bytes(16 * count)) for _, count in self._groups]
        states = {first: st for (first, _), st in zip(self._groups, self._states)}

        def group(first: int, count: int, cq: Any, alive: Callable[[], bool] | None) -> dict[str, Any]:
            if on_slice is not None:
                outer = alive

                def alive() -> bool:
                    on_slice(first, count)
                    return outer is None or outer()
            return dict(_verbs.write_striped(self._qps[first:first + count], cq, self._local_ptr + offset,
                                             self._mr.lkey, peer["addr"] + offset, peer["rkey"], length,
                                             wr, mo, se, seq, timeout, pb, alive, marks, ready, first, len(self._qps),
                                             table, None if starts is None else starts[first:first + count],
                                             states[first]))

        if self._pool is None:
            return group(0, len(self._qps), self._cq, peer_alive)
        failed = threading.Event()      # one group failed: the others stop within a slice (50 ms)

        def alive() -> bool:
            if failed.is_set():
                raise _GroupAborted
            return peer_alive is None or peer_alive()

        def run(first: int, count: int, cq: Any) -> dict[str, Any]:
            try:
                return group(first, count, cq, alive)
            except BaseException:
                failed.set()
                raise

        (first, count), *rest = self._groups
        futures = [self._pool.submit(run, f, c, cq) for (f, c), cq in zip(rest, self._cqs[1:])]
        errors: list[BaseException] = []
        results: list[dict[str, Any]] = []
        try:
            results.append(run(first, count, self._cq))
        except BaseException as exc:
            errors.append(exc)
        for fut in futures:
            try:
                results.append(fut.result())
            except BaseException as exc:
                errors.append(exc)
        real = [e for e in errors if not isinstance(e, _GroupAborted)]
        if real:
            raise real[0]       # groups stopped because another failed report nothing of their own
        return {"bytes": length, "wrs": sum(r["wrs"] for r in results), "polls": sum(r["polls"] for r in results)}

    def close(self) -> None:
        """As :meth:`_Endpoint.close`, and stop the posting threads."""
        pool, self._pool = getattr(self, "_pool", None), None
        if pool is not None:
            pool.shutdown(wait=True)
        super().close()


class _GroupAborted(Exception):
    """Another posting thread's group failed: this one stops (its error is the one reported)."""


__all__ = ["DEFAULT_QPS", "DEFAULT_WR_SIZE", "RdmaReceiverEndpoint", "RdmaSenderEndpoint", "qp_requests",
           "rdma_available", "register_region", "share_bytes"]
