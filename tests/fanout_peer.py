"""A fan-out receiver in its own process (tests/test_fanout.py, benchmarks/bench_fanout.py).

``python fanout_peer.py TOKEN STALL_TIMEOUT [HASH [PACING]]``: prints ``{"address": ...}`` once, then one JSON line
per update it received (``ok``, version, sha256 of the region when HASH is 1, fds, RSS) or failed
(``error``); runs until killed.  PACING (bytes/s, benchmarks only) caps every tcp data socket this process
sends on (``SO_MAX_PACING_RATE``), emulating one link per hop on a loopback machine.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sys
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


def main() -> None:
    token, stall = sys.argv[1], float(sys.argv[2])
    digest = len(sys.argv) < 4 or sys.argv[3] == "1"
    if len(sys.argv) > 4 and int(sys.argv[4]) > 0:
        pace_tcp_streams(int(sys.argv[4]))
    with tx.Receiver("127.0.0.1:0", token=token, stall_timeout=stall) as rx:
        print(json.dumps({"address": "{}:{}".format(*rx.address)}), flush=True)
        while True:
            try:
                region = rx.receive()
            except TensorXferError as e:
                print(json.dumps({"error": type(e).__name__, "message": str(e), "t": time.time()}), flush=True)
                continue
            v = rx.version
            line = {"ok": True, "update": v.update if v else None, "digest": v.digest.hex() if v else None,
                    "verified": rx.last_stats.verified if rx.last_stats else False,
                    "fds": len(os.listdir("/proc/self/fd")), "rss_kb": rss_kb(), "t": time.time()}
            if digest:
                mv = memoryview(region.region).cast("B")[:region.nbytes]
                line["sha256"] = hashlib.sha256(mv).hexdigest()
                mv.release()
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
