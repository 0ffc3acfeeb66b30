"""Endpoint-level sweep of max_outstanding/signal_every vs ib_write_bw, same bytes, interleaved."""
import json, statistics, sys, time
sys.path.insert(0, "/work/main/benchmarks")
import numpy as np
from bench_rdma import ib_write_bw, MIB
from tensorxfer import HostRegion
from tensorxfer.transport import _verbs
from tensorxfer.transport.rdma import RdmaReceiverEndpoint, RdmaSenderEndpoint

size = int(sys.argv[1]); rounds = int(sys.argv[2])
configs = [(32, 8), (128, 32), (64, 64), (128, 128)]
dev = _verbs.device_names()[0]
with _verbs.Context.open(dev) as ctx:
    gid, _ = ctx.choose_gid(1)
out = {c: [] for c in configs}
with HostRegion.allocate(size, 4 * MIB) as src, HostRegion.allocate(size, 4 * MIB) as dst:
    np.frombuffer(src, np.uint8)[:] = 7
    rx = RdmaReceiverEndpoint(dst, None, qps=4)
    tx = RdmaSenderEndpoint(src, None, qps=4, wr_size=MIB, max_outstanding=128)
    tx.connect(rx.descriptors()); rx.connect(tx.descriptors())
    tx.write(timeout=120); rx.wait_complete(timeout=120)
    for r in range(rounds):
        ib0 = ib_write_bw(MIB, 4, size // (4 * MIB), dev, gid, "192.168.77.1")["gbps"]
        res = {}
        for mo, se in configs:
            secs = []
            for _ in range(3):
                t0 = time.perf_counter()
                tx.write(timeout=120, max_outstanding=mo, signal_every=se)
                rx.wait_complete(timeout=120)
                secs.append(time.perf_counter() - t0)
            res[(mo, se)] = size * 8 / statistics.median(secs) / 1e9
        ib1 = ib_write_bw(MIB, 4, size // (4 * MIB), dev, gid, "192.168.77.1")["gbps"]
        ib = (ib0 + ib1) / 2
        for c in configs:
            out[c].append(res[c] / ib)
        print(r, round(ib0, 4), round(ib1, 4), {f"{c[0]}/{c[1]}": round(res[c] / ib, 3) for c in configs}, flush=True)
    tx.close(); rx.close()
print({f"{c[0]}/{c[1]}": round(statistics.median(v), 3) for c, v in out.items()})
