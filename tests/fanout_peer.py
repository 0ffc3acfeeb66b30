"""A fan-out receiver in its own process (tests/test_fanout.py, benchmarks/bench_fanout.py).

``python fanout_peer.py TOKEN STALL_TIMEOUT [HASH [PACING]] [--device D] [--ipc-piece-delay S]``: prints
``{"address": ...}`` once, then one JSON line per update it received (``ok``, version, sha256 of the region
when HASH is 1, fds, RSS) or failed (``error``); runs until killed.  PACING (bytes/s, benchmarks only) caps
every tcp data socket this process sends on (``SO_MAX_PACING_RATE``), emulating one link per hop on a
loopback machine.  ``--device``: where the received regions live (``cuda:0``: benchmarks on a GPU).
``--ipc-piece-delay S`` (tests): every ipc copy piece sleeps S seconds first, and each update's line says
when this receiver's first piece started copying and its last one finished (``copy_start``, ``copy_end``,
``time.time()``), so a test can see whether hops overlap (pipelined) or follow each other.
``--ipc-wedge-after-copy`` (tests): once every ipc piece is copied, the receiving thread hangs before it
reports done (as on a GPU whose final synchronize never returns).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import threading
import time

import tensorxfer as tx
from tensorxfer.errors import TensorXferError


def rss_kb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


SO_MAX_PACING_RATE = getattr(socket, "SO_MAX_PACING_RATE", 47)


def pace_tcp_streams(bytes_per_s: int) -> None:
    """Cap every tcp data stream this process opens at ``bytes_per_s`` (the kernel paces the sender)."""
    from tensorxfer.transport import tcp

    tune = tcp._tune

    def paced(sock: socket.socket) -> None:
        tune(sock)
        sock.setsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE, bytes_per_s)
    tcp._tune = paced


def sha256(region: tx.TensorRegion) -> str:
    """SHA-256 of the region's payload (a GPU region's is copied to the host first)."""
    if region.is_cuda:
        import numpy as np

        from tensorxfer.staging import read_into

        host = np.empty(region.nbytes, dtype=np.uint8)
        read_into(region, 0, host)
        return hashlib.sha256(host).hexdigest()
    mv = memoryview(region.region).cast("B")[:region.nbytes]
    try:
        return hashlib.sha256(mv).hexdigest()
    finally:
        mv.release()


def trace_ipc_copies(delay: float) -> list[tuple[float, float]]:
    """Slow every ipc copy piece down by ``delay`` s; the (start, end) of each piece go into the returned list."""
    from tensorxfer.transport import ipc

    spans: list[tuple[float, float]] = []
    lock = threading.Lock()
    copy_pieces = ipc.IpcReceiver._copy_pieces

    def traced(self, nbytes, progress, conn, copy, *args, **kw):  # type: ignore[no-untyped-def]
        def slow(off: int, n: int) -> None:
            start = time.time()
            time.sleep(delay)
            copy(off, n)
            with lock:
                spans.append((start, time.time()))
        return copy_pieces(self, nbytes, progress, conn, slow, *args, **kw)
    ipc.IpcReceiver._copy_pieces = traced  # type: ignore[method-assign]
    return spans


def wedge_ipc_after_copy() -> None:
    """Every ipc update copies all its pieces (and says so), then hangs instead of finishing."""
    from tensorxfer.transport import ipc

    copy_pieces = ipc.IpcReceiver._copy_pieces

    def wedged(self, *args, **kw):  # type: ignore[no-untyped-def]
        copy_pieces(self, *args, **kw)
        threading.Event().wait()
    ipc.IpcReceiver._copy_pieces = wedged  # type: ignore[method-assign]


def fd_kinds() -> dict[str, int]:
    """Open fds by what they are (socket, memfd, anon_inode:[eventfd], ...): what a changed count was made of."""
    kinds: dict[str, int] = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        kind = target.split(":[")[0] if ":[" in target else target.split("/")[1] if target.startswith("/") else target
        kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("token")
    p.add_argument("stall", type=float)
    p.add_argument("digest", nargs="?", default="1")
    p.add_argument("pacing", nargs="?", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--ipc-piece-delay", type=float, default=None)
    p.add_argument("--ipc-wedge-after-copy", action="store_true")
    args = p.parse_args()
    if args.ipc_wedge_after_copy:
        wedge_ipc_after_copy()
    digest = args.digest == "1"
    if args.pacing > 0:
        pace_tcp_streams(args.pacing)
    spans = trace_ipc_copies(args.ipc_piece_delay) if args.ipc_piece_delay is not None else None
    with tx.Receiver("127.0.0.1:0", token=args.token, stall_timeout=args.stall, device=args.device) as rx:
        print(json.dumps({"address": "{}:{}".format(*rx.address)}), flush=True)
        while True:
            try:
                region = rx.receive()
            except TensorXferError as e:
                print(json.dumps({"error": type(e).__name__, "message": str(e), "t": time.time()}), flush=True)
                if spans is not None:
                    spans.clear()
                continue
            v = rx.version
            line = {"ok": True, "update": v.update if v else None, "digest": v.digest.hex() if v else None,
                    "verified": rx.last_stats.verified if rx.last_stats else False,
                    "fds": len(os.listdir("/proc/self/fd")), "fd_kinds": fd_kinds(), "rss_kb": rss_kb(),
                    "t": time.time()}
            if spans:
                line["copy_start"] = min(a for a, _ in spans)
                line["copy_end"] = max(b for _, b in spans)
                spans.clear()
            if digest:
                line["sha256"] = sha256(region)
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
