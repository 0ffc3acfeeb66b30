#!/usr/bin/env python3
"""RDMA write throughput: tensorxfer vs ib_write_bw vs a pyverbs Python loop.

Run where an RDMA device is up (inside the Soft-RoCE VM in CI; on a real
NIC see docs/rdma.md).  Everything is measured in the same boot, and on
software emulation only the *ratios* mean anything:

- ``ib_write_bw`` (perftest) at the same message size and QP count: the
  reference a verbs program can reach on this device (goal: ≥ 0.95 of it);
- a pyverbs loop (tests/rdma_pyverbs_peer.py under /usr/bin/python3): one
  Python ``SendWR`` + ``post_send`` per request, pipelined — what the Cython
  nogil loop buys;
- sweeps over WR size and QP count for tensorxfer;
- the engine itself (``Sender``/``Receiver`` with ``transport="rdma"``, the
  receiver in a child process): the first (cold) update, which registers the
  MR and connects the QPs, is reported apart from the warm ones, whose
  offer-to-ack time (control round trips included) is set against
  ``ib_write_bw`` at the same message size and QP count, interleaved
  (ib, engine, ib, ...: each engine run against the mean of the ib runs
  around it; the median of those per-round ratios is reported).
  ``ib_write_bw`` is read in MiB/s (two decimals), not ``--report_gbits``
  (0.01 Gb/s steps: 4 % of Soft-RoCE's rate).  It moves the bytes of one
  update: ``-n`` is per QP, so ``-n size / (1 MiB x 4 QPs)`` (perftest's
  floor is 5 per QP, i.e. 20 MiB).  Results before ``*-samebytes-*`` ran
  ``-n size / 1 MiB`` per QP, 4x an update's bytes, which spreads its start
  and drain over 4x the data (``--ib-iters`` repeats that).
  ``--ib-procs 2`` adds a second reference: two ib_write_bw pairs at once,
  2 QPs each, rates summed.  Soft-RoCE does its protocol work in the thread
  that posts, so perftest (one posting thread) is held to one CPU while the
  engine posts from ``DEFAULT_POST_THREADS``; the two-process run is what
  perftest reaches with the same number of CPUs posting.

tensorxfer's sender and receiver endpoints run in this one process (the
device loops the traffic back, as ib_write_bw's server and client do through
the same rxe0); the clock covers ``write()`` plus ``wait_complete()``, i.e.
until the receiver saw every QP's immediate.  Results go to a dated JSON file
that records the exact command.

    python benchmarks/bench_rdma.py [--quick] [--engine-only] [--size BYTES] [--rounds N] [--device rxe0] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from tensorxfer import HostRegion, Manifest, Sender, TensorRegion
from tensorxfer.transport import _verbs, rdma
from tensorxfer.transport.rdma import (
    DEFAULT_QPS,
    DEFAULT_WR_SIZE,
    RdmaReceiverEndpoint,
    RdmaSenderEndpoint,
    rdma_available,
)

ROOT = Path(__file__).resolve().parent.parent
PEER = ROOT / "tests" / "rdma_pyverbs_peer.py"
MIB = 1 << 20
IB_MIN_ITERS = 5        # perftest refuses fewer iterations per QP


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes * 8 / seconds / 1e9


def tensorxfer_run(size: int, qps: int, wr_size: int, reps: int, chunk: int, device: str | None) -> dict[str, Any]:
    """Median of ``reps`` updates over one session (registration paid once, outside the clock)."""
    with HostRegion.allocate(size, chunk) as src, HostRegion.allocate(size, chunk) as dst:
        a = np.frombuffer(src, np.uint8)
        a[:] = np.random.default_rng(0).integers(0, 256, a.size, dtype=np.uint8)
        del a
        t_reg = time.perf_counter()
        rx = RdmaReceiverEndpoint(dst, device, qps=qps)
        tx = RdmaSenderEndpoint(src, device, qps=qps, wr_size=wr_size)
        t_reg = time.perf_counter() - t_reg
        try:
            tx.connect(rx.descriptors())
            rx.connect(tx.descriptors())
            tx.write(timeout=120)              # warm-up update
            rx.wait_complete(timeout=120)
            secs = []
            for _ in range(reps):
                t0 = time.perf_counter()
                st = tx.write(timeout=120)
                rx.wait_complete(timeout=120)
                secs.append(time.perf_counter() - t0)
            ok = bytes(memoryview(src)) == bytes(memoryview(dst))
        finally:
            tx.close()
            rx.close()
    med = statistics.median(secs)
    return {"impl": "tensorxfer", "bytes": size, "qps": qps, "wr_size": wr_size, "reps": reps,
            "seconds": secs, "gbps": gbps(size, med), "MBps": size / med / 1e6, "wrs": st["wrs"],
            "post_batch": st["post_batch"], "chunks": -(-size // chunk), "setup_seconds": t_reg, "verified": ok}


ENGINE_RECEIVER = """
import json, sys
from tensorxfer import Receiver
with Receiver(stall_timeout=300) as rx:
    print("{}:{}".format(*rx.address), flush=True)
    for _ in range(int(sys.argv[1])):
        rx.receive(timeout=600)
    print(json.dumps(rx.last_stats.as_dict()), flush=True)
"""


def engine_run(size: int, qps: int, updates: int, chunk: int) -> dict[str, Any]:
    """``updates`` sends of one region through Sender/Receiver over rdma (receiver in a child process)."""
    proc = subprocess.Popen([sys.executable, "-c", ENGINE_RECEIVER, str(updates)], stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout is not None
    try:
        where = proc.stdout.readline().strip()
        with TensorRegion.from_manifest(Manifest.layout([("w", "U8", (size,))]), chunk_size=chunk) as src:
            a = np.frombuffer(src.region, np.uint8, count=size)
            a[:] = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8)
            del a
            with Sender(where, transport="rdma", streams=qps, stall_timeout=300) as s:
                stats = [s.send(src) for _ in range(updates)]
        received = json.loads(proc.stdout.readline())
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    warm = [st.seconds for st in stats[1:]]
    med = statistics.median(warm)
    return {"impl": "tensorxfer engine (Sender/Receiver, rdma)", "bytes": size, "qps": qps,
            "wr_size": DEFAULT_WR_SIZE, "updates": updates, "cold_seconds": stats[0].seconds,
            "cold_setup_seconds": stats[0].setup_seconds, "cold_gbps": gbps(size, stats[0].seconds),
            "seconds": warm, "gbps": gbps(size, med), "warm_setup_seconds": max(st.setup_seconds for st in stats[1:]),
            "warm_wire_gbps": gbps(size, statistics.median(st.wire_seconds for st in stats[1:])),
            "registration": stats[0].registration, "post_threads": rdma.DEFAULT_POST_THREADS,
            "sender_counters": dict(stats[-1].counters),
            "receiver_counters": received["counters"]}


def ib_write_bw(size: int, qps: int, iters: int, device: str, gid_index: int, host: str,
                procs: int = 1) -> dict[str, Any]:
    """perftest's ib_write_bw, server and client on this machine.

    ``procs`` > 1: that many client/server pairs at once (ports 18515, 18516, ...), each with
    ``qps / procs`` QPs; their rates are summed.  perftest posts from one thread, and a software
    provider does its protocol work in the posting thread, so this is the reference for a sender
    that posts from several threads.
    """
    exe = shutil.which("ib_write_bw")
    impl = "ib_write_bw" if procs == 1 else f"ib_write_bw x{procs} processes"
    if exe is None:
        return {"impl": impl, "error": "ib_write_bw not found (apt-get install perftest)"}
    per_qps = max(1, qps // procs)
    bases = [[exe, "-d", device, "-x", str(gid_index), "-s", str(size), "-n", str(iters), "-q", str(per_qps),
              "-p", str(18515 + i),
              "-F"]   # MB/sec (MiB/s), two decimals: --report_gbits rounds to 0.01 Gb/s, 4 % of Soft-RoCE's rate
             for i in range(procs)]
    servers = [subprocess.Popen(b, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for b in bases]
    cmds = [[*b, host] for b in bases]
    try:
        time.sleep(2.0)   # the servers must listen before the clients connect
        clients = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for c in cmds]
        couts = [c.communicate(timeout=600) for c in clients]
        souts = [s.communicate(timeout=120)[0] for s in servers]
    finally:
        for proc in servers:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    rates, peaks = [], []
    for client, (cout, cerr), sout in zip(clients, couts, souts):
        # with several QPs perftest runs ``iters`` per QP and reports the iterations summed over them
        m = re.search(rf"^\s*{size}\s+\d+\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)", cout + sout, re.M)
        if client.returncode or not m:
            return {"impl": impl, "error": f"rc={client.returncode}", "stdout": cout[-2000:],
                    "stderr": cerr[-1000:], "server": sout[-1000:]}
        rates.append(float(m.group(2)))
        peaks.append(float(m.group(1)))
    mib_s = sum(rates)
    return {"impl": impl, "bytes": size * iters * per_qps * procs, "msg_size": size, "qps": per_qps * procs,
            "procs": procs, "iters": iters, "gbps": mib_s * MIB * 8 / 1e9, "gbps_peak": sum(peaks) * MIB * 8 / 1e9,
            "MiBps": mib_s, "MiBps_each": rates, "command": " & ".join(shlex.join(c) for c in cmds)}


def pyverbs_run(size: int, qps: int, wr_size: int, reps: int, device: str | None) -> dict[str, Any]:
    """tests/rdma_pyverbs_peer.py (pyverbs, /usr/bin/python3) writing into a tensorxfer receiver."""
    py = "/usr/bin/python3"
    if subprocess.run([py, "-c", "import pyverbs"], capture_output=True).returncode:
        return {"impl": "pyverbs", "error": "python3-pyverbs is not importable by /usr/bin/python3"}
    env = {**os.environ, "RDMA_DEVICE": device or _verbs.device_names()[0]}
    cmd = [py, str(PEER), "send", str(size), str(qps), str(wr_size), "1", str(reps + 1)]
    p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    assert p.stdin is not None and p.stdout is not None
    try:
        with HostRegion.allocate(size) as dst, RdmaReceiverEndpoint(dst, device, qps=qps) as rx:
            peer = json.loads(p.stdout.readline())
            peer["gid"] = bytes.fromhex(peer["gid"])
            rx.connect(peer)
            d = rx.descriptors()
            p.stdin.write(json.dumps({**d, "gid": d["gid"].hex()}) + "\n")
            p.stdin.flush()
            for _ in range(reps + 1):
                rx.wait_complete(timeout=600, peer_alive=lambda: p.poll() is None)
                p.stdin.write("{}\n")
                p.stdin.flush()
            secs = json.loads(p.stdout.readline())["seconds"][1:]   # drop the warm-up
        p.wait(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        p.stdin.close()
        p.stdout.close()
    med = statistics.median(secs)
    return {"impl": "pyverbs", "bytes": size, "qps": qps, "wr_size": wr_size, "reps": reps, "seconds": secs,
            "gbps": gbps(size, med), "MBps": size / med / 1e6, "command": shlex.join(cmd)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer sizes and repetitions (CI)")
    ap.add_argument("--size", type=int, default=None, help="bytes per update (default 16 MiB, quick 8 MiB)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--host", default=os.environ.get("RDMA_HOST", "192.168.77.1"),
                    help="address ib_write_bw's client dials (this machine's RoCE/IPoIB address)")
    ap.add_argument("--chunk", type=int, default=4 * MIB, help="region chunk (handle) size")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 5, quick 3)")
    ap.add_argument("--engine-only", action="store_true", help="only the engine against ib_write_bw")
    ap.add_argument("--ib-iters", type=int, default=None,
                    help="ib_write_bw -n (per QP) for the engine's reference (default: an update's bytes)")
    ap.add_argument("--post-threads", type=int, default=None,
                    help="the sender's posting threads (default: the library's, rdma.DEFAULT_POST_THREADS)")
    ap.add_argument("--ib-procs", type=int, default=1,
                    help="also set the engine against this many ib_write_bw processes at once (rates summed): "
                         "the reference for a sender posting from several threads")
    ap.add_argument("--out", default=None, help="JSON file (default benchmarks/results/rdma-<date>.json)")
    args = ap.parse_args(argv)
    if args.post_threads is not None:
        rdma.DEFAULT_POST_THREADS = args.post_threads    # read when an endpoint is built

    ok, why = rdma_available(args.device)
    if not ok:
        print(f"bench_rdma: RDMA unavailable: {why}", file=sys.stderr)
        return 2
    device = args.device or _verbs.device_names()[0]
    with _verbs.Context.open(device) as ctx:
        gid_index, _ = ctx.choose_gid(1)
        port = ctx.query_port(1)
    size = args.size or (8 * MIB if args.quick else 16 * MIB)
    reps = 3 if args.quick else 5
    rounds = args.rounds or (3 if args.quick else 5)
    ref_wr = MIB
    wr_sweep = [256 << 10] if args.quick else [16 << 10, 256 << 10, 4 * MIB]
    qp_sweep = [2] if args.quick else [2, 8]
    py_sweep = [64 << 10] if args.quick else [4 << 10, 64 << 10, MIB]

    results: list[dict[str, Any]] = []

    def note(r: dict[str, Any]) -> dict[str, Any]:
        results.append(r)
        shown = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()
                 if k not in ("seconds", "stdout", "command")}
        print(json.dumps(shown), flush=True)
        return r

    ratios: dict[str, Any] = {}

    def paired(wr: int, q: int) -> None:
        """ib_write_bw and tensorxfer alternately, ``rounds`` times; the median of the per-round
        ratios resists the drift of an emulated machine better than a ratio of medians."""
        per = []
        for _ in range(rounds):
            ib = note(ib_write_bw(wr, q, max(IB_MIN_ITERS, size // (wr * q)), device, gid_index, args.host))
            tx = note(tensorxfer_run(size, q, wr, reps, args.chunk, args.device))
            if "gbps" in ib:
                per.append(tx["gbps"] / ib["gbps"])
        if per:
            ratios[f"tensorxfer/ib_write_bw wr={wr} qps={q}"] = {"median": statistics.median(per), "rounds": per}

    # the engine: warm updates (registered and connected once) against ib_write_bw, interleaved as
    # ib, engine, ib, engine, ..., ib: each engine run is compared with the mean of the ib_write_bw runs
    # just before and just after it, which cancels the emulated machine's drift (it moves the rate by
    # up to +-20 % within minutes) to first order
    ib_iters = args.ib_iters or max(IB_MIN_ITERS, size // (DEFAULT_WR_SIZE * DEFAULT_QPS))

    procs = [1] if args.ib_procs <= 1 else [1, args.ib_procs]

    def reference() -> list[dict[str, Any]]:
        # each process moves its share of an update: -n per QP is the same, with qps / procs QPs each
        return [note(ib_write_bw(DEFAULT_WR_SIZE, DEFAULT_QPS, ib_iters, device, gid_index, args.host, n))
                for n in procs]
    per: list[list[float]] = [[] for _ in procs]
    before = reference()
    for _ in range(rounds):
        eng = note(engine_run(size, DEFAULT_QPS, reps + 1, args.chunk))
        after = reference()
        for k in range(len(procs)):
            if "gbps" in before[k] and "gbps" in after[k]:
                per[k].append(eng["gbps"] / ((before[k]["gbps"] + after[k]["gbps"]) / 2))
        before = after
    for n, rs in zip(procs, per):
        if rs:
            name = "ib_write_bw" if n == 1 else f"ib_write_bw x{n} processes"
            ratios[f"engine warm update/{name} wr={DEFAULT_WR_SIZE} qps={DEFAULT_QPS}"] = {
                "median": statistics.median(rs), "rounds": rs}
    # the endpoints alone, same message size and QP count as ib_write_bw
    for q in sorted({1, DEFAULT_QPS}) if not args.engine_only else ():
        paired(ref_wr, q)
    if not args.engine_only:
        paired(64 << 10, DEFAULT_QPS)
    # sweeps (tensorxfer alone)
    for wr in wr_sweep if not args.engine_only else ():
        note(tensorxfer_run(size, DEFAULT_QPS, wr, reps, args.chunk, args.device))
    for q in qp_sweep if not args.engine_only else ():
        note(tensorxfer_run(size, q, ref_wr, reps, args.chunk, args.device))
    # pyverbs' Python loop vs tensorxfer at the same WR size and QP count, back to back
    for wr in py_sweep if not args.engine_only else ():
        py = note(pyverbs_run(size, DEFAULT_QPS, wr, reps, args.device))
        txr = note(tensorxfer_run(size, DEFAULT_QPS, wr, reps, args.chunk, args.device))
        if "gbps" in py:
            ratios[f"tensorxfer/pyverbs wr={wr} qps={DEFAULT_QPS}"] = {"median": txr["gbps"] / py["gbps"]}

    now = dt.datetime.now(dt.timezone.utc)
    try:
        rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        rev = ""
    doc = {
        "benchmark": "bench_rdma", "date": now.isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable, *sys.argv]), "cwd": os.getcwd(), "git_commit": rev,
        "launcher": os.environ.get("TENSORXFER_BENCH_LAUNCHER", ""),
        "machine": {"node": platform.node(), "kernel": platform.release(), "cpus": os.cpu_count(),
                    "device": device, "port": port, "gid_index": gid_index,
                    "note": "Soft-RoCE (rdma_rxe) in a qemu TCG VM: absolute numbers are meaningless; "
                            "compare ratios" if device.startswith("rxe") else ""},
        "size": size, "reps": reps, "rounds": rounds, "chunk": args.chunk, "results": results, "ratios": ratios,
    }
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"rdma-{now:%Y%m%dT%H%M%SZ}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps({"ratios": {k: round(v["median"], 3) for k, v in ratios.items()}}, indent=1))
    print(f"wrote {out}")
    return 0 if all(r.get("verified", True) and "error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
