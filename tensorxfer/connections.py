"""Connection plumbing shared by the control channel and every transport.

:class:`Gate` is a listening socket whose connections must *prove*
themselves before anyone uses them.  The control listener (hello +
authentication), tcp's data streams, ipc's Unix socket and rdma's side
connection all have the same problem: a stranger can connect and then send
nothing, or one byte every few seconds.  Handled one at a time, ten idle
strangers hold a receiver for their timeouts in turn and a full backlog
locks everyone out.  So the gate identifies every connection concurrently,
each in its own thread against one overall deadline (a watchdog shuts the
socket down when it passes, however slowly bytes trickle in), keeps at most
``max_pending`` unproven connections (more are closed at once), and counts
what it dropped.  A connection that proved itself waits in the gate until
:meth:`Gate.admit` hands it out, so a legitimate peer is never queued
behind strangers.

:func:`recv_exact` / :func:`send_all` translate socket errors into the
engine's: a timeout is :class:`~tensorxfer.errors.TransferTimeout`, a closed
or reset connection :class:`~tensorxfer.errors.PeerLost`.
"""

from __future__ import annotations

import errno
import logging
import select
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from tensorxfer.errors import PeerLost, TransferError, TransferTimeout

log = logging.getLogger(__name__)

DEFAULT_MAX_PENDING = 256       # unproven connections kept at once; past it the oldest is dropped
MAX_READY = 16                  # proven connections waiting for admit(); more are dropped
BACKLOG = 512                   # the kernel's queue in front of the gate
_TICK = 0.05                    # how often admit() and the watchdog look at deadlines

Identify = Callable[[socket.socket], Any]
"""Reads a new connection's proof (blocking; the gate bounds it); returns what it proves, or None."""


def recv_exact(sock: socket.socket, n: int, timeout: float | None, what: str) -> bytes:
    """Exactly ``n`` bytes from ``sock``.

    Raises
    ------
    TransferTimeout
        Nothing for ``timeout`` seconds.
    PeerLost
        The peer closed or reset the connection first.
    """
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    sock.settimeout(timeout)
    try:
        while got < n:
            k = sock.recv_into(view[got:])
            if k == 0:
                raise PeerLost(f"the peer closed the connection while this side waited for {what} "
                               f"({got} of {n} bytes)")
            got += k
    except TimeoutError:
        raise TransferTimeout(f"no {what} from the peer within {timeout} s") from None
    except OSError as e:
        if isinstance(e, PeerLost):
            raise
        raise PeerLost(f"connection lost while waiting for {what}: {e}") from None
    finally:
        view.release()
    return bytes(buf)


def send_all(sock: socket.socket, data: bytes | memoryview, timeout: float | None, what: str) -> None:
    """Send all of ``data``; a timeout is :class:`TransferTimeout`, a lost connection :class:`PeerLost`."""
    sock.settimeout(timeout)
    try:
        sock.sendall(data)
    except TimeoutError:
        raise TransferTimeout(f"the peer did not take {what} within {timeout} s") from None
    except OSError as e:
        raise PeerLost(f"connection lost while sending {what}: {e}") from None


def readable_now(sock: socket.socket) -> bool:
    """Whether ``sock`` has data, EOF or an error waiting (never blocks).  poll, not select: a process holding
    many memfd chunks has fds >= 1024, which select() cannot take."""
    try:
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        return bool(poller.poll(0))
    except (OSError, ValueError):
        return True             # closed here: whatever comes next on it fails, as a closed peer would


def peer_closed(sock: socket.socket) -> bool:
    """Whether the peer closed or reset ``sock``; data waiting to be read does not count (never reads it)."""
    if not readable_now(sock):
        return False
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except (OSError, ValueError):
        return True


def listen(host: str, family: int | None = None, kind: int = socket.SOCK_STREAM, port: int = 0) -> socket.socket:
    """A listening socket on ``host:port`` with the gate's backlog (port 0: a free one).

    Raises
    ------
    OSError
        The address cannot be bound; for an IP address the error keeps its errno (and type:
        ``PermissionError`` for EACCES, ``socket.gaierror`` for a name that does not resolve) and its
        ``strerror`` says what the errno means here and what to do (:func:`bind_hint`).
    """
    if family is None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, kind)
    try:
        if family != socket.AF_UNIX:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(host if family == socket.AF_UNIX else (host, port))
        s.listen(BACKLOG)
    except OSError as e:
        s.close()
        hint = bind_hint(e, host, port) if family != socket.AF_UNIX else None
        if hint is None:
            raise
        raise type(e)(e.errno, f"{e.strerror}: {hint}") from None
    except BaseException:
        s.close()
        raise
    return s


def bind_hint(error: OSError, host: str, port: int) -> str | None:
    """What a failed bind of ``host:port`` means and what to do, by errno (None: nothing to add).

    Each errno has its own cause: one hint for all ("is another process using the port?") sent users
    looking for a process that did not exist when the address was simply not this host's.
    """
    if isinstance(error, socket.gaierror):
        return (f"{host!r} cannot be resolved to an address of this host; give one of its IP addresses "
                f"(0.0.0.0: all of them, 127.0.0.1: this host only)")
    if error.errno == errno.EADDRINUSE:
        return "the port is in use by another process; stop it, or pick another port (port 0 picks a free one)"
    if error.errno == errno.EADDRNOTAVAIL:
        return (f"{host} is not an address of this host; listen on one of its own addresses (0.0.0.0: all of "
                f"them, 127.0.0.1: this host only)")
    if error.errno == errno.EACCES and 0 < port < 1024:
        return (f"ports below 1024 need privileges (root or CAP_NET_BIND_SERVICE); pick a port of 1024 or "
                f"above instead of {port}")
    if error.errno == errno.EACCES:
        return "the system refused it (a security policy); pick another address or port"
    return None


def connect_words(error: OSError, host: str) -> str:
    """Why connecting to ``host`` failed, in words with what to do (no ``[Errno -2]``, no ``gaierror``)."""
    if isinstance(error, socket.gaierror):
        return (f"the host name {host!r} does not resolve ({error.strerror}); check the address (HOST:PORT, "
                f"or an IP address)")
    if isinstance(error, TimeoutError) or error.errno == errno.ETIMEDOUT:
        return "no answer (a firewall dropping the connection, or a wrong address?)"
    if error.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
        return f"no route to {host} ({error.strerror}); check the address and this host's network"
    return error.strerror or str(error)


def is_this_host(host: str) -> bool:
    """Whether ``host`` (a name or an address) may be this host: one of its addresses can be bound here.
    True also when that cannot be told (a name that does not resolve now): callers use it to rule same-host
    paths out, never in."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_DGRAM)
    except OSError:
        return True
    for family, kind, proto, _, addr in infos:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.bind((addr[0], 0))        # only this host's own addresses can be bound
            return True
        except OSError:
            continue
    return False


class Gate:
    """A listener whose connections prove themselves concurrently before use.

    Parameters
    ----------
    listener : socket.socket
        A listening socket; the gate owns it from now on (``close()`` closes it).
    identify : callable
        ``identify(conn)`` reads and checks a new connection's proof and
        returns what it proves (any value but None), or None / raises for a
        stranger.  It runs in a thread of its own; the gate shuts ``conn``
        down when ``proof_timeout`` passes, so it may block.
    proof_timeout : float
        Seconds one connection may take to prove itself, in all.
    what : str
        What the connections are, for logs and errors ("control", "tcp stream").
    max_pending : int
        Unproven connections kept at once; when a new one arrives past it,
        the *oldest* is dropped (a flood of idle strangers cannot lock out a
        peer that proves itself in milliseconds).

    Notes
    -----
    ``dropped`` counts strangers (closed, too slow, failed proof, over the
    pending limit); ``last_drop`` says why the latest one was dropped.
    """

    def __init__(self, listener: socket.socket, identify: Identify, proof_timeout: float, what: str,
                 max_pending: int | None = None) -> None:
        self._listener: socket.socket | None = listener
        self._identify = identify
        self.proof_timeout = float(proof_timeout)
        self.what = what
        self.max_pending = DEFAULT_MAX_PENDING if max_pending is None else max_pending
        self.dropped = 0
        self.last_drop = ""
        self._lock = threading.Condition()
        self._pending: dict[socket.socket, float] = {}     # unproven connection -> its deadline
        self._ready: deque[tuple[socket.socket, Any]] = deque()
        self._watchdog: threading.Thread | None = None
        self._provers: list[threading.Thread] = []
        self._closed = False

    @property
    def address(self) -> Any:
        if self._listener is None:
            raise TransferError(f"the {self.what} listener is closed")
        return self._listener.getsockname()

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    @property
    def ready(self) -> int:
        """Connections that proved themselves and wait for :meth:`admit`."""
        with self._lock:
            return len(self._ready)

    def fileno(self) -> int:
        """The listening socket's fd (readable when a connection waits to be accepted), for poll()."""
        if self._listener is None:
            raise TransferError(f"the {self.what} listener is closed")
        return self._listener.fileno()

    def pump(self, wait: float) -> None:
        """Accept what arrived within ``wait`` seconds and start proving it, without taking anything out.

        For a caller busy with something else (the receiver waiting for its session's next offer) that
        still wants new connections proved meanwhile.
        """
        if not self._closed:
            self._accept_one(wait)

    def admit(self, count: int = 1, timeout: float | None = None,
              abort: Callable[[], str | None] | None = None) -> list[tuple[socket.socket, Any]]:
        """The next ``count`` connections that proved themselves, as ``(conn, proof)``; the caller owns them.

        Parameters
        ----------
        timeout : float, optional
            Seconds to wait in all (``None``: until ``count`` arrived or ``abort`` says stop).
        abort : callable, optional
            Polled every 50 ms; a non-None return (the reason) ends the wait with :class:`TransferError`.

        Raises
        ------
        TransferTimeout
            Fewer than ``count`` proved themselves within ``timeout`` (strangers dropped meanwhile are named).
        TransferError
            The gate was closed, or ``abort`` returned a reason.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                if len(self._ready) >= count:
                    return [self._ready.popleft() for _ in range(count)]
                have = len(self._ready)
            if self._closed or self._listener is None:
                raise TransferError(f"the {self.what} listener was closed")
            reason = abort() if abort is not None else None
            if reason is not None:
                raise TransferError(reason)
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                why = f"; {self.dropped} stranger(s) dropped (last: {self.last_drop})" if self.dropped else ""
                raise TransferTimeout(f"{have} of {count} {self.what} connection(s) proved themselves within "
                                      f"{timeout} s{why}")
            wait = _TICK if deadline is None else max(1e-3, min(_TICK, deadline - now))
            self._accept_one(wait)

    def _accept_one(self, wait: float) -> None:
        listener = self._listener
        if listener is None:
            return
        try:
            listener.settimeout(wait)       # (close() may have closed it since it was read above: EBADF)
            conn, _ = listener.accept()
        except TimeoutError:
            return
        except OSError:
            if self._closed:
                return
            raise
        oldest = None
        with self._lock:
            if self._closed:        # closed while this one was accepted: close() has taken its snapshot
                conn.close()
                return
            if len(self._pending) >= self.max_pending:
                oldest = min(self._pending, key=self._pending.__getitem__)
                del self._pending[oldest]   # its prover wakes, finds itself expired and drops it
            self._pending[conn] = time.monotonic() + self.proof_timeout
            if self._watchdog is None:
                self._watchdog = threading.Thread(target=self._watch, name=f"tensorxfer-gate-{self.what}",
                                                  daemon=True)
                self._watchdog.start()
        if oldest is not None:
            try:
                oldest.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass    # already gone
        prover = threading.Thread(target=self._prove, args=(conn,), name=f"tensorxfer-prove-{self.what}",
                                  daemon=True)
        with self._lock:
            if self._closed:        # close() took its snapshot of the provers: this one would be left running
                self._pending.pop(conn, None)
                conn.close()
                return
            self._provers = [t for t in self._provers if t.is_alive()] + [prover]
            prover.start()          # under the lock: close() joins only started provers

    def _prove(self, conn: socket.socket) -> None:
        conn.settimeout(self.proof_timeout)     # a backstop; the watchdog enforces the overall deadline
        try:
            proof = self._identify(conn)
            why = "it failed the proof" if proof is None else ""
        except Exception as e:      # a stranger's garbage must never escape the gate
            proof, why = None, f"{type(e).__name__}: {e}"
        with self._lock:
            expired = self._pending.pop(conn, None) is None or self._closed
            if proof is not None and not expired and len(self._ready) < MAX_READY:
                self._ready.append((conn, proof))
                self._lock.notify_all()
                return
        conn.close()
        if proof is not None:
            why = "it did not prove itself in time" if expired else \
                f"{MAX_READY} proven connections already wait their turn"
        self._drop(why)

    def _drop(self, why: str) -> None:
        with self._lock:
            self.dropped += 1
            self.last_drop = why
        log.warning("%s connection dropped: %s", self.what, why)

    def _watch(self) -> None:
        """Shut down connections past their deadline (their prover wakes and drops them)."""
        while True:
            time.sleep(_TICK)
            now = time.monotonic()
            with self._lock:
                expired = [c for c, d in self._pending.items() if d <= now or self._closed]
                for c in expired:
                    del self._pending[c]
                done = not self._pending
                if done:
                    self._watchdog = None
            for c in expired:
                try:
                    c.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass    # already gone: its prover sees that
            if done:
                return

    def close(self) -> None:
        """Close the listener, every unproven connection and every proven one nobody took; idempotent."""
        with self._lock:
            self._closed = True
            listener, self._listener = self._listener, None
            pending = list(self._pending)
            ready = [c for c, _ in self._ready]
            self._ready.clear()
            provers, self._provers = self._provers, []
        if listener is not None:
            listener.close()
        for c in pending:
            try:
                c.shutdown(socket.SHUT_RDWR)    # its prover wakes and closes it
            except OSError:
                pass
        for t in provers:
            t.join(1.0)         # so a closed gate leaves no socket behind
        with self._lock:
            ready += [c for c, _ in self._ready]
            self._ready.clear()
        for c in ready:
            c.close()

    def __enter__(self) -> Gate:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
