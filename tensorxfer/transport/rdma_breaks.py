"""Breaks of an rdma update and what resuming it needs (issue 40), beside :mod:`tensorxfer.transport.rdma_engine`.

A resumable update carries a mark on every request, so the receiver knows per QP which requests landed.  When
a QP breaks, the end that saw it stops every QP and tells the other on the session's side connection (a
:data:`BROKE` notice: the QPs of a broken update cannot carry it); the receiver counts what landed
(``RdmaReceiverEndpoint.halt_and_count``) and the session's resume round connects new QPs under the same
memory registration.  :class:`BreakNotices` is that side-connection half, shared by both ends' transports;
:class:`Fault` breaks a QP for real in tests.
"""

from __future__ import annotations

import socket
import struct
import threading
from typing import Any

from tensorxfer.connections import readable_now, recv_exact, send_all
from tensorxfer.errors import LinkDropped, PeerLost, ProtocolError, TransferError, TransferTimeout, VerbsError
from tensorxfer.protocol import NONCE_BYTES, field, int_in
from tensorxfer.transport.rdma import (
    DEFAULT_WR_SIZE,
    RdmaReceiverEndpoint,
    RdmaSenderEndpoint,
    qp_requests,
    share_bytes,
)

#: A resumable update (``resumable`` set on the receiver before ``prepare``): the receiver asks for a mark on
#: every request, so when a QP breaks it knows to the request what landed on each QP (RC delivers in order),
#: and the sender sends again at most what it had in flight.  Measured cost in the Soft-RoCE VM: see
#: benchmarks/results/2026-12-06-resume-rdma/.
RESUME_MARKS = 1
MAX_MARK_EVERY = 1 << 20
MIN_MARK_WR_SIZE = 4 << 10
RESUME_WR_SIZE = DEFAULT_WR_SIZE
#: After a break: how long the receiver waits for its stopped QPs to flush (what landed is final then).
DRAIN_SECONDS = 2.0
#: A break, told to the peer on the side connection (the QPs of a broken update cannot carry it): update
#: number and resume attempt, so a notice that crossed the peer's own is recognised as stale.
BROKE = b"B"
BROKE_MSG = struct.Struct(">cQI")
#: Completion statuses that are facts about memory or the request, not about the link: a new QP would fail
#: the same way, so they are raised as they are, never resumed.
NOT_A_LINK_FAULT = frozenset({"IBV_WC_LOC_LEN_ERR", "IBV_WC_LOC_QP_OP_ERR", "IBV_WC_LOC_PROT_ERR",
                              "IBV_WC_LOC_ACCESS_ERR", "IBV_WC_REM_INV_REQ_ERR", "IBV_WC_REM_ACCESS_ERR",
                              "IBV_WC_MW_BIND_ERR"})


class Fault:
    """Test switch (``rdma_engine._FAULT``): break a QP for real mid-update -- ``ibv_modify_qp`` to the error
    state -- on the ``side`` ("sender" or "receiver"), once ``after`` bytes of the update are known landed
    (sender: the QP's posted share times the QP count, while it has more to post), ``times`` times (one per
    update or resume round that reaches it: a QP it broke is not broken again -- a poll between the break and
    the loop noticing it fired twice in one round).  Never set outside tests."""

    def __init__(self, side: str, after: int, qp: int = 0, times: int = 1) -> None:
        if side not in ("sender", "receiver"):
            raise ValueError(f"side must be 'sender' or 'receiver', got {side!r}")
        self.side, self.after, self.qp, self.left = side, after, qp, times
        self.fired: list[int] = []      # bytes landed when each break was made
        self._lock = threading.Lock()

    def on_sender(self, endpoint: RdmaSenderEndpoint, first: int, count: int, nbytes: int) -> None:
        """A sender's posting thread of QPs ``[first, first + count)``, between slices: break our QP when due --
        in its own thread, and only while it has requests to post: breaking a QP whose share had all gone out
        could leave the update complete and the QP dead."""
        if not first <= self.qp < first + count or endpoint.faulted(self.qp):
            return
        # progress from this QP's own count (fresh in its thread; another group's is a slice old): its posted
        # share times the QP count, as the stripe is even
        nq, posted = len(endpoint.last_state), endpoint.last_state[self.qp][0]
        if posted < qp_requests(self.qp, nq, RESUME_WR_SIZE, nbytes) and \
                self.due("sender", share_bytes(self.qp, posted, nq, RESUME_WR_SIZE, nbytes) * nq):
            endpoint.break_qp(self.qp)

    def on_receiver(self, endpoint: RdmaReceiverEndpoint, nbytes: int) -> None:
        if self.side == "receiver" and not endpoint.faulted(self.qp) and \
                self.due("receiver", requests_bytes(endpoint.landed_requests(), nbytes)):
            endpoint.break_qp(self.qp)

    def due(self, side: str, done: int) -> bool:
        with self._lock:
            if side != self.side or self.left <= 0 or done < self.after:
                return False
            self.left -= 1
            self.fired.append(done)
            return True



class PeerBroke(PeerLost):
    """The peer said on the side connection that its QPs broke in this update (it stopped them)."""


class BreakNotices:
    """The side-connection half of breaks, mixed into both ends' transports.  They keep ``_side`` (the socket),
    ``_side_lock``, ``_seq`` (the update), ``_attempt`` (its resume round), ``_peer_broke``, ``_closing``."""

    _side: socket.socket | None
    _side_lock: threading.Lock
    _seq: int
    _attempt: int
    _peer_broke: bool
    _closing: bool

    def _peer_alive(self) -> bool:
        """False when the side connection closed (the peer died).  After the setup only break notices travel on
        it (:data:`BROKE`): one for this round raises :class:`PeerBroke`, a stale one (a round the two ends
        left behind) is skipped; any other byte is as wrong as its closing (counting it as alive let a peer
        that wrote some and died hold us until the deadline)."""
        side = self._side
        if self._closing or side is None:
            return False
        with self._side_lock:
            while True:
                if self._peer_broke:
                    raise PeerBroke(f"rdma: the peer's QPs broke in update {self._seq} (it said so and stopped them)")
                if not readable_now(side):
                    return True
                try:
                    first = side.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
                except BlockingIOError:
                    return True
                except OSError:
                    return False
                if first != BROKE:
                    return False
                _, seq, attempt = BROKE_MSG.unpack(recv_exact(side, BROKE_MSG.size, 1.0, "a break notice"))
                if seq == self._seq and attempt == self._attempt:
                    self._peer_broke = True

    def _tell_broke(self) -> None:
        """Tell the peer this end's QPs broke (best effort: a dead side connection says more than this would)."""
        side = self._side
        if side is None:
            return
        try:
            send_all(side, BROKE_MSG.pack(BROKE, self._seq, self._attempt), 1.0, "a break notice")
        except TransferError:
            pass        # the peer is gone: it learns from the closed side connection instead

    def _read_side(self, n: int, timeout: float, what: str) -> bytes:
        """The next ``n`` bytes of a resume exchange on the side connection, skipping break notices (both ends
        may have told the other of the same break before the exchange began)."""
        side = self._side
        if side is None:
            raise PeerLost("rdma: the side connection is gone")
        while True:
            first = recv_exact(side, 1, timeout, what)
            if first != BROKE:
                return first + (recv_exact(side, n - 1, timeout, what) if n > 1 else b"")
            recv_exact(side, BROKE_MSG.size - 1, timeout, "a break notice")

    def _is_break(self, e: BaseException) -> bool:
        """Whether ``e`` is a broken link of this update (a new QP may carry on), not the peer gone or a fault
        that a new QP would repeat."""
        if self._closing:
            return False
        if isinstance(e, PeerBroke | TransferTimeout):
            return True
        if isinstance(e, PeerLost) or not isinstance(e, VerbsError):
            return False
        if e.status in NOT_A_LINK_FAULT:    # ours, unless the peer broke its QP first and ours saw the effect
            try:
                self._peer_alive()
            except PeerBroke:
                return True
            return False
        return e.qp_num is not None or e.status is not None


def requests_bytes(requests: list[int], nbytes: int) -> int:
    """Bytes in the first ``requests[q]`` requests of each QP ``q`` of a resumable update of ``nbytes``."""
    return sum(share_bytes(q, k, len(requests), RESUME_WR_SIZE, nbytes) for q, k in enumerate(requests))


def dropped_at(endpoint: Any, e: BaseException, requests: list[int], nbytes: int, unfinished: bool) -> LinkDropped:
    """The :class:`LinkDropped` of a break: keyed by the broken QP's index (the first unfinished one when the
    error names none), with the bytes of each QP's share in its first ``requests[q]`` requests (``unfinished``:
    only QPs whose share is not all there)."""
    nq = len(requests)
    shares = {q: share_bytes(q, k, nq, RESUME_WR_SIZE, nbytes) for q, k in enumerate(requests)
              if not unfinished or k < qp_requests(q, nq, RESUME_WR_SIZE, nbytes)}
    qpn = getattr(e, "qp_num", None)
    index = endpoint.qp_index(qpn) if qpn is not None else None
    if index is None:
        index = min(shares) if shares else 0
    return LinkDropped({index: e}, shares, nbytes)


def check_resume(descriptors: dict[str, Any], peer: dict[str, Any], posted: list[int], attempt: int,
                 registration: tuple[int, int, int] | None, nbytes: int) -> tuple[int, bytes, list[int], int]:
    """A sender's check of the receiver's ``resume`` descriptors (``peer``: already checked as a receiver's):
    the next round, a nonce, the session's registration, a request index per QP.  Returns the round, the
    nonce, the starts and the bytes this round sends again (posted before the break, not landed).

    Raises
    ------
    ProtocolError
        Any of that does not hold.
    """
    got = field(descriptors, "attempt", int)
    side_nonce = field(descriptors, "nonce", bytes)
    starts = field(descriptors, "from", list)
    nq = len(posted)
    if got != attempt + 1 or len(side_nonce) != NONCE_BYTES or len(peer["qps"]) != nq:
        raise ProtocolError(f"rdma resume descriptors: attempt {got} (expected {attempt + 1}), {len(side_nonce)}-byte "
                            f"nonce, {len(peer['qps'])} QPs (this update has {nq})")
    if (peer["addr"], peer["rkey"], peer["length"]) != registration:
        raise ProtocolError("rdma resume descriptors name another memory registration than this session's")
    if len(starts) != nq or not all(type(k) is int and 0 <= k <= qp_requests(q, nq, RESUME_WR_SIZE, nbytes)
                                    for q, k in enumerate(starts)):
        raise ProtocolError(f"rdma resume descriptors: 'from' {starts!r} is not a request index per QP of this update")
    again = sum(max(0, share_bytes(q, p, nq, RESUME_WR_SIZE, nbytes) - share_bytes(q, k, nq, RESUME_WR_SIZE, nbytes))
                for q, (p, k) in enumerate(zip(posted, starts)))
    return got, side_nonce, starts, again



def marks_asked(descriptors: dict[str, Any]) -> tuple[int, int | None]:
    """The piece marks (every how many requests per QP) and request size a receiver asked for (a
    relay's, or a resumable update's: every request)."""
    marks = descriptors.get("marks", 0)
    if marks == 0 or marks is None:
        return 0, None
    wr_size = descriptors.get("wr_size")
    if not int_in(marks, 1, MAX_MARK_EVERY + 1) or not int_in(wr_size, MIN_MARK_WR_SIZE, (1 << 30) + 1):
        raise ProtocolError(f"rdma accept descriptors: 'marks' must be an int in [1, {MAX_MARK_EVERY}] with an "
                            f"int 'wr_size' in [{MIN_MARK_WR_SIZE}, 1 GiB], got {marks!r}, {wr_size!r}")
    return marks, wr_size


__all__ = ["BROKE", "BROKE_MSG", "DRAIN_SECONDS", "NOT_A_LINK_FAULT", "RESUME_MARKS", "RESUME_WR_SIZE",
           "BreakNotices", "Fault", "PeerBroke", "check_resume", "dropped_at", "marks_asked",
           "requests_bytes"]
