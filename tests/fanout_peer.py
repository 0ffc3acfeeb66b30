"""A fan-out receiver in its own process (tests/test_fanout.py, benchmarks/bench_fanout.py).

``python fanout_peer.py TOKEN STALL_TIMEOUT [HASH]``: prints ``{"address": ...}`` once, then one JSON line
per update it received (``ok``, version, sha256 of the region when HASH is 1, fds, RSS) or failed
(``error``); runs until killed.
"""

from __future__ import annotations

import hashlib
import json
import os
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


def main() -> None:
    token, stall = sys.argv[1], float(sys.argv[2])
    digest = len(sys.argv) < 4 or sys.argv[3] == "1"
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
