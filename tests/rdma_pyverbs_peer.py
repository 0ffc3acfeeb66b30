"""An independent RDMA peer built on rdma-core's pyverbs, for tests and the benchmark.

Runs under Debian's ``/usr/bin/python3`` (where python3-pyverbs lives), imports
nothing from tensorxfer, and speaks the same wire convention as
``tensorxfer.transport.rdma`` (the descriptor dict, one WRITE_WITH_IMM per QP
carrying the update number).  Descriptors travel as JSON lines over
stdin/stdout, with the GID as hex.

    rdma_pyverbs_peer.py recv SIZE QPS [UPDATES]
        pyverbs registers its own buffer (REMOTE_WRITE), waits for UPDATES
        updates, and prints {"sha256": ..., "head": ...} after each one.
    rdma_pyverbs_peer.py send SIZE QPS WR_SIZE SEED [REPEAT [DEPTH]]
        fills its buffer with random.Random(SEED).randbytes(SIZE) and writes it
        into the receiver with a Python post_send loop (one SendWR object and one
        post_send call per request, DEPTH in flight per QP, all signaled: what
        pyverbs offers), REPEAT times, waiting for a line on stdin after each;
        prints {"seconds": [...]}.
"""

import hashlib
import json
import os
import random
import socket
import sys
import time

import pyverbs.enums as e
from pyverbs.addr import GID, AHAttr, GlobalRoute
from pyverbs.cq import CQ
from pyverbs.device import Context
from pyverbs.mr import MR
from pyverbs.pd import PD
from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
from pyverbs.wr import SGE, RecvWR, SendWR

PORT = 1
MTU = {256: e.IBV_MTU_256, 512: e.IBV_MTU_512, 1024: e.IBV_MTU_1024, 2048: e.IBV_MTU_2048, 4096: e.IBV_MTU_4096}


def out(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def read_msg():
    line = sys.stdin.readline()
    if not line:
        sys.exit("peer closed stdin")
    return json.loads(line)


def pick_gid(ctx):
    """RoCE v2 IPv4-mapped GID, found the pyverbs way (index order, first ::ffff: entry)."""
    n = ctx.query_port(PORT).gid_tbl_len
    for i in range(min(n, 16)):
        try:
            g = ctx.query_gid(PORT, i).gid
        except Exception:  # empty GID slots raise
            continue
        if g.startswith("0000:0000:0000:0000:0000:ffff:"):
            return i, g
    return 0, ctx.query_gid(PORT, 0).gid


def setup(size, nqps, access, max_send_wr, max_recv_wr):
    ctx = Context(name=os.environ.get("RDMA_DEVICE", "rxe0"))
    pd = PD(ctx)
    mr = MR(pd, size, access)
    cq = CQ(ctx, nqps * (max_send_wr + max_recv_wr) + 16, None, None, 0)
    cap = QPCap(max_send_wr=max_send_wr, max_recv_wr=max_recv_wr, max_send_sge=1, max_recv_sge=1)
    qps = [QP(pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap)) for _ in range(nqps)]
    pa = ctx.query_port(PORT)
    idx, gid = pick_gid(ctx)
    mtu = {v: k for k, v in MTU.items()}[pa.active_mtu]
    psns = [random.randrange(1 << 24) for _ in qps]
    desc = {"transport": "rdma", "version": 1, "port": PORT, "lid": pa.lid, "gid": gid.replace(":", ""),
            "gid_index": idx, "mtu": mtu, "link_layer": "Ethernet" if pa.link_layer == e.IBV_LINK_LAYER_ETHERNET
            else "InfiniBand", "qps": [{"qp_num": qp.qp_num, "psn": p} for qp, p in zip(qps, psns)],
            "nbytes": size, "mr_path": "pyverbs"}
    return ctx, pd, mr, cq, qps, psns, desc, idx


def connect(qps, psns, peer, sgid_index, access):
    h = peer["gid"]
    dgid = GID()
    dgid.gid = ":".join(h[i:i + 4] for i in range(0, 32, 4))
    for qp, psn, rq in zip(qps, psns, peer["qps"]):
        attr = QPAttr(qp_state=e.IBV_QPS_INIT)
        attr.qp_access_flags = access
        attr.port_num = PORT
        attr.pkey_index = 0
        qp.to_init(attr)
        gr = GlobalRoute(dgid=dgid, sgid_index=sgid_index, hop_limit=64)
        attr = QPAttr(qp_state=e.IBV_QPS_RTR)
        attr.ah_attr = AHAttr(port_num=PORT, is_global=1, gr=gr, dlid=peer["lid"])
        attr.path_mtu = MTU[peer["mtu"]]
        attr.dest_qp_num = rq["qp_num"]
        attr.rq_psn = rq["psn"]
        attr.max_dest_rd_atomic = 1
        attr.min_rnr_timer = 12
        qp.to_rtr(attr)
        attr.sq_psn = psn
        attr.timeout = 14
        attr.retry_cnt = 7
        attr.rnr_retry = 7
        attr.max_rd_atomic = 1
        qp.to_rts(attr)


def recv(size, nqps, updates=1):
    access = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE
    ctx, pd, mr, cq, qps, psns, desc, idx = setup(size, nqps, access, 1, 4)
    # pyverbs insists on one SGE per receive; WRITE_WITH_IMM consumes the
    # receive without touching its buffer, so any valid SGE will do
    scratch = [SGE(mr.buf, 1, mr.lkey)]
    desc.update(role="receiver", addr=mr.buf, rkey=mr.rkey, length=size)
    out(desc)
    connect(qps, psns, read_msg(), idx, access)
    for i, qp in enumerate(qps):  # receives need INIT or later; the sender waits for "connected"
        for _ in range(4):
            qp.post_recv(RecvWR(wr_id=i, num_sge=1, sg=scratch))
    out({"connected": True})
    for upd in range(1, updates + 1):
        got = set()
        deadline = time.monotonic() + 120
        while len(got) < nqps:
            n, wcs = cq.poll(16)
            for wc in wcs[:n]:
                if wc.status != e.IBV_WC_SUCCESS:
                    sys.exit(f"receive failed: status {wc.status} on QP {wc.qp_num:#x}")
                imm = socket.ntohl(wc.imm_data)
                if imm != upd:
                    sys.exit(f"immediate {imm} on QP {wc.qp_num:#x}, expected {upd}")
                got.add(wc.wr_id)
                qps[wc.wr_id].post_recv(RecvWR(wr_id=wc.wr_id, num_sge=1, sg=scratch))
            if n == 0 and time.monotonic() > deadline:
                sys.exit(f"timed out waiting for update {upd}")
        data = mr.read(size, 0)
        out({"update": upd, "sha256": hashlib.sha256(data).hexdigest(), "head": data[:16].hex()})
    for qp in qps:
        qp.close()
    mr.close()
    cq.close()
    pd.close()
    ctx.close()


def send(size, nqps, wr_size, seed, repeat=1, depth=16):
    ctx, pd, mr, cq, qps, psns, desc, idx = setup(size, nqps, e.IBV_ACCESS_LOCAL_WRITE, depth, 1)
    mr.write(random.Random(seed).randbytes(size), size, 0)
    desc.update(role="sender")
    out(desc)
    peer = read_msg()
    connect(qps, psns, peer, idx, 0)
    nwr = (size + wr_size - 1) // wr_size
    if nwr < nqps:  # pyverbs cannot post the zero-length (no SGE) tail tensorxfer uses there
        sys.exit(f"need at least one request per QP ({nwr} requests, {nqps} QPs)")
    secs = []
    for upd in range(1, repeat + 1):
        t0 = time.perf_counter()
        # The straightforward pyverbs loop, pipelined: one Python SendWR and one
        # post_send call per request, round-robin over the QPs, up to `depth`
        # in flight per QP, every request signaled, completions polled in batches.
        inflight = [0] * nqps
        for i in range(nwr):
            q = i % nqps
            while inflight[q] >= depth:
                n, wcs = cq.poll(16)
                for wc in wcs[:n]:
                    if wc.status != e.IBV_WC_SUCCESS:
                        sys.exit(f"write failed: status {wc.status}")
                    inflight[wc.wr_id % nqps] -= 1
            off = i * wr_size
            last = i + nqps >= nwr
            wr = SendWR(wr_id=i, opcode=e.IBV_WR_RDMA_WRITE_WITH_IMM if last else e.IBV_WR_RDMA_WRITE,
                        num_sge=1, sg=[SGE(mr.buf + off, min(wr_size, size - off), mr.lkey)],
                        send_flags=e.IBV_SEND_SIGNALED, imm_data=socket.htonl(upd) if last else 0)
            wr.set_wr_rdma(peer["rkey"], peer["addr"] + off)
            qps[q].post_send(wr)
            inflight[q] += 1
        while sum(inflight):
            n, wcs = cq.poll(16)
            for wc in wcs[:n]:
                if wc.status != e.IBV_WC_SUCCESS:
                    sys.exit(f"write failed: status {wc.status}")
                inflight[wc.wr_id % nqps] -= 1
        secs.append(time.perf_counter() - t0)
        read_msg()  # the receiver confirms before the next update
    out({"seconds": secs})
    for qp in qps:
        qp.close()
    mr.close()
    cq.close()
    pd.close()
    ctx.close()


if __name__ == "__main__":
    role, args = sys.argv[1], [int(a) for a in sys.argv[2:]]
    {"recv": recv, "send": send}[role](*args)
