"""Fan-out by chain pipelining: one update to N receivers, as a ratio to N = 1 in the same run.

Starts max(N) receiver processes (``tests/fanout_peer.py``: a ``Receiver`` with a token, looping on
``receive()``, its regions on ``--device``), then for each N in ``--receivers`` opens a
:class:`~tensorxfer.fanout.FanoutSender` to the first N of them (``--transport``: tcp with default streams,
or ipc), sends one warm-up update (sessions set up, regions allocated), then ``--repeat`` timed updates of
the same region (median).  Rounds interleave the N values so drift on a shared machine hits them alike.
The ratio compares each N's median to N = 1's median in the same round; "naive" is N x the N = 1 time (N
transfers from the sender, what the chain avoids).

``--transport ipc``: every hop copies (pulls) from the previous hop's memory on this host, pipelined by
the ipc watermark (each relay raises its next hop's watermark as its own copy lands).  All hops share one
machine's memory bandwidth -- host RAM, or with ``--device cuda:N`` the GPU's HBM (sender region and every
receiver's region on that GPU): N receivers each writing their own copy move N x the bytes through the same
memory, so where one copy already runs near the memory's peak (a device-to-device copy on an H200) N > 1
cannot come near 1.0x; the JSON records a plain copy of the same bytes on the same memory
(``reference_copy``) so the ratios can be read against that bound.  On a machine with one GPU per
receiver, ``--receiver-devices cuda:1 cuda:2 cuda:3`` puts each receiver on its own GPU (every hop then
copies over NVLink into its own HBM: the regime "1 -> 3 within 1.25x of one" is about).

Two regimes: plain loopback (every hop's kernel copies share this machine's CPUs, so on a 2-core box the
hops compete for the same cores: a CPU bound, not what a chain of machines sees), and ``--link-gbps G``:
every tcp data socket's sending rate is capped (``SO_MAX_PACING_RATE``, per process, nothing global) so
each hop behaves like its own G Gbit/s link -- the regime fan-out is for (the sender's one NIC is the
bottleneck).  Store-and-forward or N sends would take N x there; the chain should take one transfer plus
(N-1) pieces.

Writes ``<out>/fanout-<regime>-<UTC time>.json`` (``--out``, default ``benchmarks/results``) with the exact
command, machine facts, per-N medians and ratios, and every run.  Not a timed test: run it by hand::

    .venv/bin/python benchmarks/bench_fanout.py --size 1e9 --receivers 1 2 4 8 --repeat 3 --rounds 2
    .venv/bin/python benchmarks/bench_fanout.py --transport ipc --size 2e8 --receivers 1 2 4 --repeat 2 --rounds 1
    python3 benchmarks/bench_fanout.py --transport ipc --device cuda:0 --size 8e9 --receivers 1 2 3 \
        --repeat 3 --rounds 2 --out $OUT
    python3 benchmarks/bench_fanout.py --transport ipc --device cuda:0 --receiver-devices cuda:1 cuda:2 cuda:3 \
        --size 8e9 --receivers 1 2 3 --repeat 3 --rounds 2 --out $OUT     # 4 GPUs
    # rdma, inside the Soft-RoCE VM (every hop's rxe work shares the VM's two emulated CPUs):
    bash .ci/rxe-vm.sh run 'cd $PWD && PYTHONDONTWRITEBYTECODE=1 HOME=/tmp .venv/bin/python \
        benchmarks/bench_fanout.py --transport rdma --size 8e6 --receivers 1 2 3 --repeat 2 --rounds 2 --out DIR'
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import tensorxfer as tx  # noqa: E402
from tensorxfer.cli.bench import machine_facts  # noqa: E402
from tensorxfer.fanout import FanoutSender  # noqa: E402
from tensorxfer.staging import htod  # noqa: E402
from tensorxfer.transport import ipc, rdma, rdma_engine, tcp  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
TOKEN = "bench-fanout"


def start_peers(n: int, stall: float, pacing: int, devices: list[str]) -> list[tuple[subprocess.Popen, str]]:
    """``n`` receiver processes; receiver i keeps its regions on ``devices[i % len(devices)]``."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    peers = []
    for i in range(n):
        device = devices[i % len(devices)]
        peer = [sys.executable, str(ROOT / "tests" / "fanout_peer.py"), TOKEN, str(stall), "0", str(pacing),
                "--device", device]
        proc = subprocess.Popen(peer,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            proc.wait(timeout=60)
            raise RuntimeError(f"receiver process exited with {proc.returncode} before listening (device {device})")
        peers.append((proc, json.loads(line)["address"]))
    return peers


def make_region(size: int, tensors: int, device: str) -> tx.TensorRegion:
    """``tensors`` U8 tensors of ``size // tensors`` bytes on ``device``, filled with a repeated random block."""
    manifest = tx.Manifest.layout([(f"t{i}", "U8", (size // tensors,)) for i in range(tensors)])
    region = tx.TensorRegion.from_manifest(manifest, device=device)
    block = np.random.default_rng(0).integers(0, 256, size=4 << 20, dtype=np.uint8)
    if region.is_cuda:
        copier = region._get_copier()
        for off in range(0, region.nbytes, block.size):
            n = min(block.size, region.nbytes - off)
            htod(copier, region.region.ptr + off, block[:n])
        copier.synchronize()
    else:
        view = np.frombuffer(region.region, dtype=np.uint8, count=region.nbytes)
        for off in range(0, view.size, block.size):
            n = min(block.size, view.size - off)
            view[off:off + n] = block[:n]
        del view
    return region


def reference_copy(region: tx.TensorRegion, repeat: int) -> dict[str, Any]:
    """One plain copy of the region's bytes on the same memory: the floor for N receivers' copies there."""
    runs = []
    if region.is_cuda:
        from tensorxfer.memory import CudaRegion

        assert CudaRegion is not None
        with CudaRegion.allocate(region.nbytes, device=region.region.device_index) as dst:
            copier = region._get_copier()
            for i in range(repeat + 1):
                copier.synchronize()
                t = time.perf_counter()
                copier.dtod(dst.ptr, region.region.ptr, region.nbytes)
                copier.synchronize()
                if i:           # the first copy touches the new memory
                    runs.append(time.perf_counter() - t)
        what = "cuMemcpyDtoDAsync of the region's bytes on its device + stream synchronize"
    else:
        src = np.frombuffer(region.region, dtype=np.uint8, count=region.nbytes)
        dst = np.empty_like(src)
        np.copyto(dst, src)
        for _ in range(repeat):
            t = time.perf_counter()
            np.copyto(dst, src)
            runs.append(time.perf_counter() - t)
        del src, dst
        what = "numpy.copyto, 1 thread (the ipc receiver copies on TENSORXFER_IPC_THREADS)"
    med = statistics.median(runs)
    return {"what": what, "runs_s": runs, "median_s": med, "gbytes_per_s": region.nbytes / med / 1e9}


def transport_facts(transport: str, region: tx.TensorRegion) -> dict[str, Any]:
    if transport == "tcp":
        return {"streams": tcp.DEFAULT_STREAMS, "piece_bytes": tcp.PIECE_BYTES,
                "forward_piece_bytes": tcp.TcpSender.forward_piece_bytes(region)}
    if transport == "rdma":
        return {"qps": rdma.DEFAULT_QPS, "wr_size": rdma.DEFAULT_WR_SIZE,
                "forward_piece_bytes": rdma_engine.RdmaSender.forward_piece_bytes(region)}
    return {"copy_threads": ipc.COPY_THREADS, "plain_piece_bytes": ipc.CUDA_PIECE_BYTES if region.is_cuda
            else ipc.PIECE_BYTES, "forward_piece_bytes": ipc.IpcSender.forward_piece_bytes(region)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=float, default=1e9, help="region bytes per update (default 1e9)")
    p.add_argument("--tensors", type=int, default=64)
    p.add_argument("--receivers", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--repeat", type=int, default=3, help="timed updates per N per round (after one warm-up)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--verify", action="store_true")
    p.add_argument("--transport", choices=["tcp", "ipc", "rdma"], default="tcp")
    p.add_argument("--device", default="cpu",
                   help="where the sender's region and every receiver's region live: cpu (default) or cuda:N")
    p.add_argument("--receiver-devices", nargs="+", default=None, metavar="DEVICE",
                   help="where the receivers' regions live, receiver i on the i-th (cycled; default: --device): "
                        "e.g. --device cuda:0 --receiver-devices cuda:1 cuda:2 cuda:3 on a 4-GPU machine")
    p.add_argument("--link-gbps", type=float, default=0.0,
                   help="emulate one link of this speed per hop: every tcp data socket's sending rate is capped "
                        "at link/streams (SO_MAX_PACING_RATE); 0 (default): loopback as fast as the CPUs go")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if args.link_gbps and args.transport != "tcp":
        p.error("--link-gbps paces tcp data sockets; it means nothing for --transport ipc")
    if 1 not in args.receivers:
        p.error("--receivers must include 1: every ratio is to N = 1 in the same round")
    size = int(args.size) // args.tensors * args.tensors
    pacing = int(args.link_gbps * 1e9 / 8 / tcp.DEFAULT_STREAMS) if args.link_gbps else 0
    if pacing:
        sys.path.insert(0, str(ROOT / "tests"))
        from fanout_peer import pace_tcp_streams

        pace_tcp_streams(pacing)
    rows: list[dict] = []
    region = make_region(size, args.tensors, args.device)
    peers: list[tuple[subprocess.Popen, str]] = []
    try:
        reference = reference_copy(region, args.repeat)
        print(f"reference: one plain copy of {size / 1e9:.2f} GB on {args.device}: {reference['median_s']:.3f} s",
              flush=True)
        receiver_devices = args.receiver_devices or [args.device]
        peers = start_peers(max(args.receivers), stall=60.0, pacing=pacing, devices=receiver_devices)
        for rnd in range(args.rounds):
            for n in args.receivers:
                with FanoutSender([a for _, a in peers[:n]], token=TOKEN, transport=args.transport,
                                  stall_timeout=60.0) as fan:
                    warm = fan.send(region, verify=args.verify)
                    assert warm.ok, warm.failed
                    runs = []
                    for _ in range(args.repeat):
                        t0 = time.perf_counter()
                        st = fan.send(region, verify=args.verify)
                        runs.append(time.perf_counter() - t0)
                        assert st.ok, st.failed
                med = statistics.median(runs)
                assert all(r.transport == args.transport for r in st.receivers), st.receivers
                rows.append({"round": rnd, "receivers": n, "seconds_median": med, "runs": runs,
                             "warmup_seconds": warm.seconds, "gbps_per_receiver": size * 8 / med / 1e9,
                             "piece_bytes": st.piece_bytes, "chain": list(st.chain)})
                print(f"round {rnd}: N={n}: median {med:.3f} s ({size * 8 / med / 1e9:.2f} Gbps to each), "
                      f"runs {', '.join(f'{r:.3f}' for r in runs)}", flush=True)
    finally:
        for proc, _ in peers:
            proc.kill()
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        facts = transport_facts(args.transport, region)
        region.close()
    for row in rows:
        base = next(r for r in rows if r["round"] == row["round"] and r["receivers"] == 1)["seconds_median"]
        row["ratio_to_n1"] = row["seconds_median"] / base
        row["ratio_to_naive"] = row["seconds_median"] / (base * row["receivers"])
    summary = {}
    for n in args.receivers:
        mine = [r for r in rows if r["receivers"] == n]
        ratios = [r["ratio_to_n1"] for r in mine]
        summary[str(n)] = {"seconds_median": statistics.median(r["seconds_median"] for r in mine),
                           "ratio_to_n1_median": statistics.median(ratios), "ratios": ratios,
                           "ratio_to_reference_copy": statistics.median(r["seconds_median"] for r in mine)
                           / reference["median_s"]}
        print(f"N={n}: median {summary[str(n)]['seconds_median']:.3f} s, {statistics.median(ratios):.2f} x the "
              f"N=1 time (naive: {n} x), {summary[str(n)]['ratio_to_reference_copy']:.2f} x one plain copy")
    record = {
        "benchmark": f"fanout-chain-{args.transport}",
        "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
        "utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_facts(),
        "link_gbps": args.link_gbps, "pacing_bytes_per_s_per_stream": pacing,
        "bytes": size, "tensors": args.tensors, "verify": args.verify, "transport": args.transport,
        "device": args.device, "receiver_devices": args.receiver_devices or [args.device], **facts,
        "reference_copy": reference,
        "goal": "N=4 within 1.25x of N=1" if args.transport == "tcp" else
                "chain pipelined: N receivers well under N x the N=1 time, as far as the shared memory allows",
        "summary": summary, "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    kind = f"link{args.link_gbps:g}g" if args.link_gbps else "loopback"
    if args.transport != "tcp":
        kind = f"{args.transport}-{args.device.replace(':', '')}"
    path = args.out / f"fanout-{kind}-{dt.datetime.now(dt.timezone.utc).strftime('%Y-%m-%dT%H%MZ')}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
