"""A copy host in a process of its own, for tests/test_copy_host.py (stopped, resumed and killed with real signals).

Usage: ``python tests/copy_host_peer.py KEY STALL [DEVICE]`` (KEY "" for a tokenless group; DEVICE a CUDA device
index, absent or "" for host memory).  Prints one JSON line,
``{"path": the lane socket, "pid": this process}``, then reads commands from stdin, one a line, answering each
with a JSON line:

- ``stats``: ``{"copies", "revoked", "lanes"}`` (the host's counters);
- ``limit N``: set ``CopyHost.limit_bytes`` to N (``limit none``: no cap);
- ``quit``: close the host and exit 0.
"""

from __future__ import annotations

import json
import logging
import os
import sys

from tensorxfer.transport.ipc.delegate import CopyHost


def main() -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    key = sys.argv[1].encode() or None
    device = int(sys.argv[3]) if len(sys.argv) > 3 and sys.argv[3] else None
    host = CopyHost(key, device, float(sys.argv[2]))
    print(json.dumps({"path": host.path, "pid": os.getpid()}), flush=True)
    try:
        for line in sys.stdin:
            cmd = line.split()
            if cmd == ["stats"]:
                print(json.dumps({"copies": host.copies, "revoked": host.revoked, "lanes": host.lanes_served}),
                      flush=True)
            elif cmd[:1] == ["limit"] and len(cmd) == 2:
                host.limit_bytes = None if cmd[1] == "none" else int(cmd[1])
                print(json.dumps({"limit": host.limit_bytes}), flush=True)
            elif cmd == ["quit"]:
                break
            else:
                print(json.dumps({"error": f"unknown command {line.strip()!r}"}), flush=True)
    finally:
        host.close()


if __name__ == "__main__":
    main()
