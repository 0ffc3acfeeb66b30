"""What a bandwidth-bound kernel loses when another process puts a little work on the same GPU now and then.

A weight sync on one GPU runs its tiles in the copy host's CUDA context while each source process queues a
few small operations of its own mid-step (the shared cells' amaxes and their copy to the host, the agreed
amaxes copied back).  Without MPS the GPU time-slices between contexts: each such operation waits for a
slice, and the running kernel is switched out and back in.  This probe measures both sides: the main process
casts ``--gib`` GiB of bf16 to FP8 ``--casts`` times back to back (torch's one-pass cast: the sync's bound),
alone and while a second process does one small operation every ``--interval-ms``:

- ``kernel_d2h``: a small kernel, then 4 KiB copied to pinned host memory and waited for (a source's
  shared amaxes read back);
- ``h2d``: 4 KiB of pinned host memory copied to the device on a stream of its own, waited for (the agreed
  amaxes written back).

It prints one JSON line per mode: the casts' time, the interruptions the other process made meanwhile, the
cost of one interruption to the casts, and how long each small operation waited (its latency)::

    python3 benchmarks/probe_timeslice.py [--gib 4] [--casts 10] [--repeat 5] [--interval-ms 1]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
from typing import Any


def interferer(op: str, interval: float, go: Any, stop: Any, out: Any) -> None:
    import torch

    x = torch.zeros(1 << 18, device="cuda")
    pinned = torch.zeros(1024, pin_memory=True)
    stream = torch.cuda.Stream()
    dev = torch.zeros(1024, device="cuda")
    torch.cuda.synchronize()
    out.put("ready")
    while True:
        go.wait()
        if stop.is_set():
            return
        latencies = []
        while go.is_set():
            time.sleep(interval)
            t = time.perf_counter()
            if op == "kernel_d2h":
                x.add_(1)
                pinned.copy_(x[:1024], non_blocking=True)
                torch.cuda.current_stream().synchronize()
            else:
                with torch.cuda.stream(stream):
                    dev.copy_(pinned, non_blocking=True)
                stream.synchronize()
            latencies.append((t, time.perf_counter() - t))
        out.put(latencies)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=4)
    p.add_argument("--casts", type=int, default=10)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--interval-ms", type=float, default=1.0)
    args = p.parse_args()
    import torch

    n = int(args.gib * (1 << 30)) // 2
    src = torch.ones(n, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty(n, dtype=torch.float8_e4m3fn, device="cuda")

    def casts() -> float:
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(args.casts):
            dst.copy_(src)
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / 1e3

    casts()
    ctx = mp.get_context("spawn")
    for op in ("none", "kernel_d2h", "h2d"):
        times, counts, waits = [], [], []
        if op == "none":
            times = [casts() for _ in range(args.repeat)]
        else:
            go, stop, out = ctx.Event(), ctx.Event(), ctx.Queue()
            proc = ctx.Process(target=interferer, args=(op, args.interval_ms / 1e3, go, stop, out))
            proc.start()
            assert out.get(timeout=120) == "ready"
            for _ in range(args.repeat):
                go.set()
                time.sleep(0.02)        # the other process is in its loop
                t0 = time.perf_counter()     # (CLOCK_MONOTONIC: the same clock in both processes)
                times.append(casts())
                t1 = time.perf_counter()
                go.clear()
                lat = out.get(timeout=60)
                inside = [w for t, w in lat if t0 <= t < t1]
                counts.append(len(inside))
                waits.extend(inside)
            stop.set()
            go.set()
            proc.join(30)
        t = statistics.median(times)
        row: dict[str, Any] = {"op": op, "casts_ms": t * 1e3, "gib": args.gib, "casts": args.casts,
                               "device": torch.cuda.get_device_name()}
        if op == "none":
            alone = t
        else:
            per_window = statistics.median(counts)      # operations begun while the casts ran
            row.update(interruptions=per_window, slowdown=t / alone)
            if waits:       # (none: the other process did nothing while the casts ran)
                row.update(cost_us=(t - alone) / max(per_window, 1e-9) * 1e6,
                           wait_us_median=statistics.median(waits) * 1e6,
                           wait_us_p90=sorted(waits)[int(0.9 * (len(waits) - 1))] * 1e6)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
