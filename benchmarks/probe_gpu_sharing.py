"""What two processes pay for sharing one GPU: the same bytes copied by one process, by two processes at once,
and by two processes one after the other, with the copy engines (``dst.copy_(src)``: cudaMemcpyAsync), with
a copy kernel on the multiprocessors (``torch.bitwise_not(src, out=dst)``: one read, one write per word), and
with a resharded sync's own copies (``bench_sync``'s 4-to-2 plan, each process one target's -- one process:
both): every pair by the strided-copy kernel ("schedule-kernel"), or its contiguous groups by the copy
engines in one ``cuMemcpyBatchAsync`` and only its strided groups by the kernel ("schedule-hybrid"), or every
pair of a target in ONE launch on one stream ("schedule-fused": the tiles carry each source's absolute
address, the kernel's source base is 0), so two contexts time-slice one channel each instead of four; or
("schedule-single", one process only) every pair of both targets in one launch (absolute addresses at both
ends, both bases 0): what one copier for the whole GPU would run.

Why: a resharded sync with several target processes on one GPU (``bench_sync --device cuda:0``) runs each
target's device copies in its own CUDA context.  Without MPS the GPU time-slices kernels of different contexts;
this probe says what that costs, and whether the copy engines share better.  Prints a JSON line a mode::

    python3 benchmarks/probe_gpu_sharing.py [--size 16e9] [--repeat 7]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def _schedule(nbytes: int, rank: int, procs: int, hybrid: bool, fused: bool = False, single: bool = False) -> Any:
    """A callable that runs this process's targets' copies of bench_sync's 4-to-2 plan (of ``nbytes`` in all)
    and waits for them."""
    import numpy as np
    import torch
    from bench_sync import specs

    from tensorxfer.memory import strided
    from tensorxfer.memory._copy import Copier, StridedCopy
    from tensorxfer.sync.fusing import segments_of
    from tensorxfer.sync.plan import plan

    sources, targets, src_bytes, tgt_bytes = specs(nbytes, 4, 2)
    pl = plan(sources, targets)
    src = [torch.ones(b, dtype=torch.uint8, device="cuda") for b in src_bytes]
    image = strided.kernel_image()
    launches = []
    if single and procs == 1:   # every pair of both targets in ONE launch: absolute addresses at both ends
        feeds = []
        dsts = [torch.empty(b, dtype=torch.uint8, device="cuda") for b in tgt_bytes]
        for t in range(2):
            feeds += [(src[s], dsts[t], segments_of(pl, s, t)) for s in pl.sources_of.get(t, ())]
        cols = [np.concatenate([sg.src_off + np.uint64(s.data_ptr()) for s, _, sg in feeds]),
                np.concatenate([sg.dst_off + np.uint64(d.data_ptr()) for _, d, sg in feeds])]
        cols += [np.concatenate([getattr(sg, c) for *_, sg in feeds])
                 for c in ("nbytes", "count", "src_stride", "dst_stride")]
        zero = torch.empty(0, dtype=torch.uint8, device="cuda")
        launches.append((Copier(0), StridedCopy(0, strided.tiles(*cols), image), None, zero, 0))
        src.extend(dsts)
    for t in [] if single and procs == 1 else range(2) if procs == 1 else [rank]:
        dst = torch.empty(tgt_bytes[t], dtype=torch.uint8, device="cuda")
        if fused:       # one table for all of this target's sources: absolute source addresses, base 0
            feeds = [(src[s], segments_of(pl, s, t)) for s in pl.sources_of.get(t, ())]
            cols = [np.concatenate([sg.src_off + np.uint64(s.data_ptr()) for s, sg in feeds])]
            cols += [np.concatenate([getattr(sg, c) for _, sg in feeds])
                     for c in ("dst_off", "nbytes", "count", "src_stride", "dst_stride")]
            launches.append((Copier(0), StridedCopy(0, strided.tiles(*cols), image), None, dst, 0))
            continue
        for s in pl.sources_of.get(t, ()):
            sg, copier = segments_of(pl, s, t), Copier(0)
            flat = (sg.count == 1) | ((sg.src_stride == sg.nbytes) & (sg.dst_stride == sg.nbytes))
            kept = ~flat if hybrid else np.ones(len(sg.count), bool)
            cols = [np.ascontiguousarray(c[kept]) for c in (sg.src_off, sg.dst_off, sg.nbytes, sg.count,
                                                             sg.src_stride, sg.dst_stride)]
            kernel = StridedCopy(0, strided.tiles(*cols), image) if kept.any() else None
            batch = None
            if hybrid and flat.any():
                batch = (np.ascontiguousarray(sg.dst_off[flat] + np.uint64(dst.data_ptr())),
                         np.ascontiguousarray(sg.src_off[flat] + np.uint64(src[s].data_ptr())),
                         np.ascontiguousarray(sg.nbytes[flat] * sg.count[flat]))
            launches.append((copier, kernel, batch, dst, src[s].data_ptr()))

    def run() -> None:
        for copier, kernel, batch, dst, src_base in launches:
            if batch is not None:
                copier.dtod_batch(*batch, batch_api=True)
            if kernel is not None:
                kernel.launch(copier, dst.data_ptr() if dst.numel() else 0, src_base)
        for copier, *_ in launches:
            copier.synchronize()
    run._keep = (src, launches)                     # type: ignore[attr-defined]
    return run


def _worker(rank: int, nbytes: int, how: str, order: str, repeat: int, start: Any, handoff: Any, out: Any,
            procs: int) -> None:
    import torch

    torch.cuda.set_device(0)
    if how.startswith("schedule"):
        run = _schedule(nbytes, rank, procs, how == "schedule-hybrid", how in ("schedule-fused", "schedule-single"),
                        how == "schedule-single")
    else:
        src = torch.ones(nbytes // procs // 8, dtype=torch.int64, device="cuda")
        dst = torch.empty_like(src)

        def run() -> None:
            if how == "engine":
                dst.copy_(src)
            else:
                torch.bitwise_not(src, out=dst)
            torch.cuda.synchronize()
    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat + 1):                   # the first round warms up
        start.wait()
        if order == "serial" and rank == 1:
            handoff.wait()
        t0 = time.monotonic_ns()
        run()
        t1 = time.monotonic_ns()
        if order == "serial" and rank == 0:
            handoff.wait()
        times.append((t0, t1))
    out.put((rank, times[1:]))


def _run(procs: int, nbytes: int, how: str, order: str, repeat: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    start, handoff, out = ctx.Barrier(procs), ctx.Barrier(2), ctx.Queue()
    workers = [ctx.Process(target=_worker, args=(r, nbytes, how, order, repeat, start, handoff, out, procs))
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
    p.add_argument("--modes", nargs="*", default=["engine", "kernel", "schedule-kernel", "schedule-hybrid"])
    args = p.parse_args(argv)
    nbytes = int(args.size) // 16 * 16
    result: dict[str, Any] = {"size": nbytes}
    for how in args.modes:
        one = _run(1, nbytes, how, "together", args.repeat)
        together = _run(2, nbytes, how, "together", args.repeat)
        serial = _run(2, nbytes, how, "serial", args.repeat)
        result[how] = {"one_process": one, "two_at_once": together, "two_in_turn": serial,
                       "at_once_over_one": together["span_s"] / one["span_s"],
                       "in_turn_over_one": serial["span_s"] / one["span_s"]}
        print(json.dumps({"mode": how, "size": nbytes, **result[how]}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
