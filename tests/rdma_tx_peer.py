"""A tensorxfer RDMA peer in its own process, for the two-process and fault tests.

Messages are msgpack (the endpoints' descriptors as they are), hex-encoded, one
per line on stdin/stdout: the shape the engine's control channel will carry.

    rdma_tx_peer.py recv SIZE QPS CHUNK UPDATES
        receiver: after each update prints {"update", "sha256"}
    rdma_tx_peer.py send SIZE QPS CHUNK SEED UPDATES WR_SIZE
        sender: region filled from numpy's default_rng(SEED + update); before each
        update waits for a "go" line; prints the write stats.
"""

from __future__ import annotations

import hashlib
import sys

import msgpack
import numpy as np

from tensorxfer import HostRegion
from tensorxfer.transport.rdma import RdmaReceiverEndpoint, RdmaSenderEndpoint


def out(obj: object) -> None:
    sys.stdout.write(msgpack.packb(obj).hex() + "\n")
    sys.stdout.flush()


def read_msg() -> object:
    line = sys.stdin.readline()
    if not line:
        sys.exit("peer closed stdin")
    return msgpack.unpackb(bytes.fromhex(line.strip()))


def fill(region: HostRegion, size: int, seed: int) -> None:
    a = np.frombuffer(region, np.uint8, size)
    a[:] = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
    del a


def main() -> None:
    role, args = sys.argv[1], [int(a) for a in sys.argv[2:]]
    if role == "recv":
        size, qps, chunk, updates = args
        with HostRegion.allocate(size, chunk) as region, RdmaReceiverEndpoint(region, qps=qps) as ep:
            out(ep.descriptors())
            ep.connect(read_msg())  # type: ignore[arg-type]
            out({"connected": True})
            for _ in range(updates):
                st = ep.wait_complete(timeout=120)
                digest = hashlib.sha256(memoryview(region)[:size]).hexdigest()
                out({"update": st["update"], "sha256": digest})
    else:
        size, qps, chunk, seed, updates, wr_size = args
        with HostRegion.allocate(size, chunk) as region, \
                RdmaSenderEndpoint(region, qps=qps, wr_size=wr_size) as ep:
            out(ep.descriptors())
            ep.connect(read_msg())  # type: ignore[arg-type]
            for u in range(updates):
                read_msg()
                fill(region, size, seed + u)
                out(ep.write(timeout=60))


if __name__ == "__main__":
    main()
