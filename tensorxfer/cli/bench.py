"""tensorxfer-bench: a synthetic transfer shaped like the reference run.

Sends tensorxfer.synthetic.layout() (820 tensors, 31.2 GB by default,
--size to scale down) from this process to a receiver in a child process
over loopback: one cold transfer (the receiver allocates and first-touches
its region), then --repeat warm ones in a new session: the steady-state
"training step update" that lands in the same region.  It prints Gbps
against the reference run's 212.4 Gbps and against the local limits it
measured here: a single-threaded memory copy, and iperf3 over loopback with
the same stream count (when iperf3 is installed).

Exit codes: 0 success, 1 transfer failed, 2 bad arguments or not enough memory.
"""

from __future__ import annotations

import json
import platform
import shutil
import socket
import subprocess
import sys
import time
from typing import Any

import numpy as np

REFERENCE_GBPS = 212.4


def memcpy_gbps(nbytes: int = 256 << 20) -> float:
    """Single-threaded host memory copy bandwidth in Gbit/s (best of 3)."""
    a = np.ones(nbytes, dtype=np.uint8)
    b = np.empty_like(a)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        np.copyto(b, a)
        best = min(best, time.perf_counter() - t)
    return nbytes * 8 / best / 1e9


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def iperf3_gbps(streams: int, nbytes: int) -> dict[str, Any] | None:
    """iperf3 over loopback with ``streams`` parallel streams moving ``nbytes``; None without iperf3.

    Returns the received Gbit/s and the exact client command.
    """
    exe = shutil.which("iperf3")
    if exe is None:
        return None
    port = free_port()
    server = subprocess.Popen([exe, "-s", "-1", "-B", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        cmd = [exe, "-c", "127.0.0.1", "-p", str(port), "-P", str(streams), "-n", str(nbytes), "--json"]
        last = ""
        for _ in range(50):     # the server needs a moment to listen
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            try:
                data = json.loads(out.stdout)
                return {"gbps": data["end"]["sum_received"]["bits_per_second"] / 1e9, "command": " ".join(cmd)}
            except (ValueError, KeyError) as e:
                last = f"{type(e).__name__}: {out.stdout[-300:]} {out.stderr[-300:]}"
            time.sleep(0.1)
        raise RuntimeError(f"iperf3 did not produce a result: {last}")
    finally:
        server.kill()
        server.wait()


def machine_facts() -> dict[str, Any]:
    import os

    facts: dict[str, Any] = {"cpus": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version(),
                             "machine": platform.machine(), "mem_total_bytes": 0}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    facts["cpu_model"] = line.split(":", 1)[1].strip()
                    break
        with open("/proc/meminfo") as f:
            facts["mem_total_bytes"] = int(f.readline().split()[1]) * 1024
    except OSError:
        pass   # facts are informative only
    return facts


def fill(region: Any, seed: int = 0) -> None:
    """Fill a region with a repeated random 1 MiB block (cheap, and not compressible to nothing)."""
    block = np.random.default_rng(seed).integers(0, 256, size=1 << 20, dtype=np.uint8)
    if region.is_cuda:
        from tensorxfer.memory._copy import Copier
        from tensorxfer.staging import htod

        with Copier(region.region.device_index) as c:
            for off in range(0, region.region.size, block.size):
                htod(c, region.region.ptr + off, block[:min(block.size, region.region.size - off)])
            c.synchronize()
        return
    view = np.frombuffer(region.region, dtype=np.uint8)
    for off in range(0, view.size, block.size):
        n = min(block.size, view.size - off)
        view[off:off + n] = block[:n]
    del view


def run_bench(size: int, streams: list[int | None], repeat: int, verify: bool, transport: str = "auto",
              quiet: bool = False, device: str = "cpu") -> dict[str, Any]:
    """Run the benchmark; return a JSON-able record.

    One receiver process serves every run.  A first, cold transfer pays the
    receiver's allocation and first-touch page faults; then, for each entry
    of ``streams``, a new session sends ``repeat`` warm transfers with that
    many streams.

    Raises
    ------
    TensorXferError
        The transfer failed.
    RuntimeError
        The receiver process failed.
    """
    from tensorxfer import Manifest, Sender, TensorRegion, synthetic
    from tensorxfer.cli import _loopback
    from tensorxfer.transport.tcp import DEFAULT_STREAMS

    manifest = Manifest.layout(synthetic.layout(size))
    by_streams: dict[int, list[dict[str, Any]]] = {}
    with TensorRegion.from_manifest(manifest, device=device) as region:
        fill(region)
        proc, port = _loopback.start(1 + repeat * len(streams), stall_timeout=60.0, device=device)
        try:
            with Sender(f"127.0.0.1:{port}", transport=transport, streams=streams[0]) as tx:
                cold = tx.send(region, verify=verify).as_dict()
            if not quiet:
                print(f"  cold run (receiver allocates and first-touches its memory): {cold['gbps']:.2f} Gbps",
                      flush=True)
            for k in streams:
                with Sender(f"127.0.0.1:{port}", transport=transport, streams=k) as tx:
                    runs = [tx.send(region, verify=verify).as_dict() for _ in range(repeat)]
                used = runs[0]["streams"] or k or DEFAULT_STREAMS
                by_streams[used] = runs
                if not quiet:
                    print(f"  {used} streams: " + ", ".join(f"{r['gbps']:.2f}" for r in runs) + " Gbps", flush=True)
            _loopback.results(proc)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return {"bytes": manifest.nbytes, "tensors": len(manifest), "cold": cold,
            "by_streams": {k: {"runs": v, "gbps_median": float(np.median([r["gbps"] for r in v]))}
                           for k, v in by_streams.items()}}


def main(argv: list[str] | None = None) -> int:
    from tensorxfer import TensorXferError, synthetic
    from tensorxfer.cli.common import SIZE_HELP, byte_size, mem_available, new_parser
    from tensorxfer.transport.tcp import DEFAULT_STREAMS

    p = new_parser("tensorxfer-bench", __doc__ or "", exit_codes=False)
    p.add_argument("--size", type=byte_size, default=synthetic.REFERENCE_BYTES, metavar="SIZE",
                   help=f"model bytes (default: the reference run's 31.2e9); {SIZE_HELP}")
    p.add_argument("--streams", type=int, default=None, metavar="N",
                   help=f"parallel TCP streams (default: {DEFAULT_STREAMS}, $TENSORXFER_TCP_STREAMS overrides)")
    p.add_argument("--transport", default="tcp",
                   help="tcp (default: the network path, compared with iperf3), ipc, rdma or auto")
    p.add_argument("--repeat", type=int, default=3, help="warm transfers after the first (cold) one")
    p.add_argument("--verify", action="store_true", help="per-tensor xxh3 checksums")
    p.add_argument("--device", default="cpu", help="where both regions live: cpu or cuda:N (GPU regions stage "
                   "through pinned buffers)")
    p.add_argument("--no-iperf", action="store_true", help="skip the iperf3 comparison")
    p.add_argument("--json", action="store_true", help="print one JSON record instead of text")
    args = p.parse_args(argv)
    size = int(args.size)
    if size <= 0 or args.repeat < 1:
        p.error("--size and --repeat must be positive")
    need = 2 * size + (512 << 20)
    avail = mem_available()
    if avail and need > avail:
        print(f"tensorxfer-bench: {size / 1e9:.1f} GB needs about {need / 2**30:.1f} GiB here (sender and receiver "
              f"regions), only {avail / 2**30:.1f} GiB available; pass a smaller --size, e.g. "
              f"--size {int(avail // 3 / 1e9)}e9", file=sys.stderr)
        return 2
    quiet = args.json
    if not quiet:
        print(f"tensorxfer-bench: {len(synthetic.layout(size))} tensors, {size / 1e9:.2f} GB, loopback, "
              f"sender and receiver in separate processes", flush=True)
    try:
        record = run_bench(size, [args.streams], args.repeat, args.verify, args.transport, quiet=quiet,
                           device=args.device)
    except (TensorXferError, RuntimeError) as e:
        print(f"tensorxfer-bench: transfer failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    ((streams, warm),) = record.pop("by_streams").items()
    record.update(streams=streams, runs=warm["runs"], gbps_warm_median=warm["gbps_median"])
    record["memcpy_gbps"] = memcpy_gbps()
    try:
        record["iperf3"] = None if args.no_iperf else iperf3_gbps(streams, record["bytes"])
    except RuntimeError as e:
        print(f"tensorxfer-bench: {e}", file=sys.stderr)
        record["iperf3"] = None
    record["reference_gbps"] = REFERENCE_GBPS
    record["machine"] = machine_facts()
    got = record["gbps_warm_median"]
    if args.json:
        print(json.dumps(record))
        return 0
    print(f"result: {got:.2f} Gbps over {record['streams']} streams (median of warm runs)")
    print(f"  vs reference run (RDMA, 400G ConnectX-7): {got / REFERENCE_GBPS:.3f} x {REFERENCE_GBPS} Gbps")
    print(f"  vs local memory copy (1 thread):          {got / record['memcpy_gbps']:.3f} x "
          f"{record['memcpy_gbps']:.1f} Gbps")
    if record["iperf3"]:
        ip = record["iperf3"]["gbps"]
        print(f"  vs iperf3 loopback, {record['streams']} streams:         {got / ip:.3f} x {ip:.2f} Gbps")
    elif not args.no_iperf:
        print("  (iperf3 not installed: apt-get install iperf3 for the loopback limit)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
