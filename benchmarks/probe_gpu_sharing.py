"""What two processes pay for sharing one GPU: the same bytes copied by one process, by two processes at once,
and by two processes one after the other, with the copy engines (``dst.copy_(src)``: cudaMemcpyAsync) and with
a copy kernel on the multiprocessors (``torch.bitwise_not(src, out=dst)``: one read, one write per word).

Why: a resharded sync with several target processes on one GPU (``bench_sync --device cuda:0``) runs each
target's device copies in its own CUDA context.  Without MPS the GPU time-slices kernels of different contexts;
this probe says what that costs, and whether the copy engines share better.  Prints one JSON line::

    python3 benchmarks/probe_gpu_sharing.py [--size 16e9] [--repeat 7]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
from typing import Any


def _op(how: str, src: Any, dst: Any) -> None:
    import torch

    if how == "engine":
        dst.copy_(src)
    else:
        torch.bitwise_not(src, out=dst)


def _worker(rank: int, nbytes: int, how: str, order: str, repeat: int, start: Any, handoff: Any, out: Any) -> None:
    import torch

    torch.cuda.set_device(0)
    src = torch.ones(nbytes // 8, dtype=torch.int64, device="cuda")
    dst = torch.empty_like(src)
    _op(how, src, dst)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat + 1):                   # the first round warms up
        start.wait()
        if order == "serial" and rank == 1:
            handoff.wait()
        t0 = time.monotonic_ns()
        _op(how, src, dst)
        torch.cuda.synchronize()
        t1 = time.monotonic_ns()
        if order == "serial" and rank == 0:
            handoff.wait()
        times.append((t0, t1))
    out.put((rank, times[1:]))


def _run(procs: int, nbytes: int, how: str, order: str, repeat: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    start, handoff, out = ctx.Barrier(procs), ctx.Barrier(2), ctx.Queue()
    workers = [ctx.Process(target=_worker, args=(r, nbytes // procs, how, order, repeat, start, handoff, out))
               for r in range(procs)]
    for w in workers:
        w.start()
    results = dict(out.get(timeout=600) for _ in workers)
    for w in workers:
        w.join()
    spans = [(max(results[r][i][1] for r in results) - min(results[r][i][0] for r in results)) / 1e9
             for i in range(repeat)]
    each = [statistics.median((results[r][i][1] - results[r][i][0]) / 1e9 for i in range(repeat)) for r in results]
    return {"span_s": statistics.median(spans), "spans_s": spans, "per_process_s": each}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=float, default=16e9)
    p.add_argument("--repeat", type=int, default=7)
    args = p.parse_args(argv)
    nbytes = int(args.size) // 16 * 16
    result: dict[str, Any] = {"size": nbytes}
    for how in ("engine", "kernel"):
        one = _run(1, nbytes, how, "together", args.repeat)
        together = _run(2, nbytes, how, "together", args.repeat)
        serial = _run(2, nbytes, how, "serial", args.repeat)
        result[how] = {"one_process": one, "two_at_once": together, "two_in_turn": serial,
                       "at_once_over_one": together["span_s"] / one["span_s"],
                       "in_turn_over_one": serial["span_s"] / one["span_s"]}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
