"""A TCP relay that cuts connections for real: the fault injector of the resume tests (no mocks).

Run as a process: ``python -m tests.cutting_relay --to 127.0.0.1:PORT --cut N[,N...]``.  It listens on a
loopback address of its own (:func:`relay_host`: the same host, another address, one no other live relay
has), forwards the control connection to the receiver, and mirrors every data listener the receiver opens
on the target address: before it passes on any byte from the receiver to the sender (an accept or resume
frame, which names a data port), it opens a listener on its address with the same port number for each
port listening on the target address (``/proc/net/tcp``), so the sender's data streams -- which connect to
the control connection's peer -- go through the relay too.  (With one address for every relay, a relay that
outlived its test could hold another's mirror port, and that sender's data would go around the relay it is
measured by: a hang where that relay waits for bytes it never sees.)

``--cut`` lists byte counts of the data sent from sender to receiver (all data connections together,
in arrival order at the relay): when a count is reached, the relay forwards exactly up to it and resets
the connection that carried it (SO_LINGER 0: an RST to both ends, the way a dropped link or a killed
middlebox ends a connection).  With ``--stall`` it instead stops carrying that connection at that count and
keeps it open: a link that went silent (no RST, no FIN), which only the ends' stall timeouts notice.

``--pause-at N`` holds every data connection once N data bytes went through (it forwards exactly up to N,
then prints ``paused`` on a line of its own) until it gets SIGUSR1 or SIGUSR2: a test kills a sender or
receiver process there -- at a chosen point of the transfer, with data in flight -- and then lets the relay
carry on (SIGUSR1: what the dead process's kernel still holds is delivered, then its close or reset), or
(SIGUSR2) resets every data connection at once, dropping what it holds: the machine went away with its
socket buffers (a pre-empted node), so what landed is what had landed at the pause.

It prints its address (``HOST:PORT``) on the first line; on SIGTERM (or stdin closing) it prints one JSON line:
``data_bytes`` (sender -> receiver, data connections), ``control_bytes``, ``cuts`` (byte counts where it
cut), ``connections``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import struct
import sys
import threading


def relay_host(pid: int) -> str:
    """A loopback address for the relay of process ``pid``: 127.A.B.C with A >= 1 (never the receiver's
    127.0.0.1), one-to-one with pids below 2**24 -- two live relays never share one."""
    return f"127.{1 + (pid >> 16)}.{(pid >> 8) & 255}.{pid & 255}"


def listening_ports(host: str) -> set[int]:
    """Ports listening on ``host`` in this network namespace (from /proc/net/tcp)."""
    want = "".join(f"{int(p):02X}" for p in reversed(host.split(".")))
    ports = set()
    with open("/proc/net/tcp") as f:
        next(f)
        for line in f:
            parts = line.split()
            addr, port = parts[1].split(":")
            if parts[3] == "0A" and addr == want:
                ports.add(int(port, 16))
    return ports


def reset(sock: socket.socket) -> None:
    """Abort ``sock``: linger 0, so closing sends an RST.  The shutdown first wakes the relay's other thread
    blocked in recv on it: until that call returns, close() would release nothing and send nothing."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


class Relay:
    def __init__(self, target_host: str, control_port: int, cuts: list[int], stall: bool = False,
                 pause_at: int | None = None) -> None:
        self.stall = stall
        self.pause_at = pause_at
        self.gate = threading.Event()       # cleared while paused
        self.gate.set()
        self.drop = False                   # SIGUSR2: held data connections are reset, not carried on
        self.stalled: list[socket.socket] = []      # silent connections, kept open (and referenced) until exit
        self.target_host = target_host
        self.control_port = control_port
        self.cuts = sorted(cuts)
        self.cut_at: list[int] = []
        self.data_bytes = 0
        self.control_bytes = 0
        self.connections = 0
        self.lock = threading.Lock()
        self.mirrors: dict[int, socket.socket] = {}
        self.host = relay_host(os.getpid())
        self.control = self._listen(control_port, control=True)     # the receiver's port, on self.host

    def _listen(self, port: int, control: bool) -> socket.socket:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((self.host, port))
        s.listen(64)
        threading.Thread(target=self._accept, args=(s, control), daemon=True).start()
        return s

    def mirror(self) -> None:
        """A listener on this relay's address for every port the receiver listens on (new data listeners)."""
        for port in listening_ports(self.target_host):
            if port not in self.mirrors and port != self.control_port:
                try:
                    self.mirrors[port] = self._listen(port, control=False)
                except OSError:
                    pass    # not free on this relay's address

    def _accept(self, lst: socket.socket, control: bool) -> None:
        while True:
            try:
                conn, _ = lst.accept()
            except OSError:
                return
            port = self.control_port if control else lst.getsockname()[1]
            try:
                up = socket.create_connection((self.target_host, port))
            except OSError:
                conn.close()
                continue
            for s in (conn, up):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self.lock:
                self.connections += 1
            threading.Thread(target=self._pump, args=(conn, up, control, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(up, conn, control, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, control: bool, forward: bool) -> None:
        buf = bytearray(1 << 20)
        view = memoryview(buf)
        try:
            while True:
                n = src.recv_into(buf)
                if n == 0:
                    dst.shutdown(socket.SHUT_WR)
                    return
                if control:
                    if not forward:
                        self.mirror()       # the frame may name a data port: it must be there first
                    with self.lock:
                        self.control_bytes += n
                    dst.sendall(view[:n])
                    continue
                if not forward:
                    dst.sendall(view[:n])
                    continue
                n = self._pause(dst, view, n)
                self.gate.wait()
                if self.drop:
                    reset(src)
                    reset(dst)
                    return
                with self.lock:
                    start = self.data_bytes
                    cut = next((c for c in self.cuts if start < c <= start + n), None)
                    take = n if cut is None else cut - start
                    self.data_bytes += take
                    if cut is not None:
                        self.cuts.remove(cut)
                        self.cut_at.append(cut)
                dst.sendall(view[:take])
                if cut is not None:
                    if self.stall:
                        with self.lock:
                            self.stalled += [src, dst]
                        return
                    reset(src)
                    reset(dst)
                    return
        except OSError:
            reset(src)
            reset(dst)

    def _pause(self, dst: socket.socket, view: memoryview, n: int) -> int:
        """Forward up to the pause point and hold there (``--pause-at``); return the bytes of ``view`` left."""
        with self.lock:
            start = self.data_bytes
            hit = self.pause_at is not None and start < self.pause_at <= start + n
            if hit:
                assert self.pause_at is not None
                first, self.pause_at = self.pause_at - start, None
                self.data_bytes += first
                self.gate.clear()
        if not hit:
            return n
        dst.sendall(view[:first])
        print("paused", flush=True)
        view[:n - first] = view[first:n]
        return n - first

    def report(self) -> dict[str, object]:
        with self.lock:
            return {"data_bytes": self.data_bytes, "control_bytes": self.control_bytes, "cuts": self.cut_at,
                    "connections": self.connections}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--to", required=True, help="the receiver's HOST:PORT")
    ap.add_argument("--cut", default="", help="data byte counts to cut at, comma-separated")
    ap.add_argument("--stall", action="store_true", help="go silent at the cuts instead of resetting")
    ap.add_argument("--pause-at", type=int, default=None, help="hold the data at this byte count until SIGUSR1")
    args = ap.parse_args()
    host, port = args.to.rsplit(":", 1)
    cuts = [int(c) for c in args.cut.split(",") if c]
    relay = Relay(host, int(port), cuts, args.stall, args.pause_at)
    signal.signal(signal.SIGUSR1, lambda *_: relay.gate.set())

    def drop(*_: object) -> None:
        relay.drop = True
        relay.gate.set()
    signal.signal(signal.SIGUSR2, drop)
    print("{}:{}".format(*relay.control.getsockname()), flush=True)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    done.wait()
    print(json.dumps(relay.report()), flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
