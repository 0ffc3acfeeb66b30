"""Every process's GPU work in one step of a sync, on one clock: what ``BENCH_KINETO=DIR`` made bench_fp8 write.

Each rank of ``BENCH_KINETO=DIR python3 benchmarks/bench_fp8.py --device cuda:0 ...`` profiles its last step
with CUPTI (PyTorch's profiler, CUDA activity only: the copy host's kernels are launched through the driver,
and CUPTI sees them as well) and writes ``DIR/<role><rank>.json`` (a Chrome trace) and its step's wall-clock
start and end.  This prints, in ms from the first rank's start: each process's kernels and copies (first
start, last end, busy time, count), the GPU's busy time as the union of them all, the gaps in it longer than
``--gap-us``, and when the GPU's work began and ended against the step's.  What it shows is which process put
what on the GPU and in which order, not timings: on the H100, CUPTI made the traced 16 GB step's launches take
0.5-6 ms and the step 12.7-13.6 ms (``benchmarks/results/2026-12-07-fp8-source-work-before-the-tiles``)::

    python3 benchmarks/gpu_timeline.py DIR [--gap-us 20]
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

GPU_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}


def load(directory: Path) -> tuple[dict[str, list[tuple[float, float, str]]], dict[str, tuple[float, float]]]:
    """rank -> its GPU intervals (start us, end us, name) on the epoch clock; rank -> its step (start, end) us."""
    work, steps = {}, {}
    for path in sorted(directory.glob("*.step.json")):
        rank = path.name.removesuffix(".step.json")
        t0, t1 = json.loads(path.read_text())
        steps[rank] = (t0 * 1e6, t1 * 1e6)
        trace = json.loads((directory / f"{rank}.json").read_text())
        base = trace.get("baseTimeNanoseconds", 0) / 1e3
        work[rank] = sorted((base + e["ts"], base + e["ts"] + e.get("dur", 0), e.get("name", "?"))
                            for e in trace["traceEvents"] if e.get("cat") in GPU_CATEGORIES)
    return work, steps


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("directory", type=Path)
    p.add_argument("--gap-us", type=float, default=20.0)
    args = p.parse_args()
    work, steps = load(args.directory)
    zero = min(t0 for t0, _ in steps.values())
    ms = lambda us: f"{(us - zero) / 1e3:7.3f}"        # noqa: E731
    end = max(t1 for _, t1 in steps.values())
    print(f"step: {ms(zero).strip()} .. {ms(end).strip()} ms (first rank's start .. last rank's end)")
    for rank, spans in work.items():
        if not spans:
            print(f"{rank:8s} no GPU work")
            continue
        busy = sum(b - a for a, b in union([(a, b) for a, b, _ in spans]))
        names = sorted({n[:40] for _, _, n in spans})
        print(f"{rank:8s} {ms(spans[0][0])} .. {ms(spans[-1][1])}  busy {busy / 1e3:6.3f} ms  x{len(spans)}  "
              f"{'; '.join(names)[:160]}")
        for a, b, n in spans:
            if b - a < 200:      # the small ones, one by one (a source's amaxes, copies)
                print(f"           {ms(a)} .. {ms(b)}  {n[:60]}")
    every = union([(a, b) for spans in work.values() for a, b, _ in spans])
    if not every:
        return
    busy = sum(b - a for a, b in every)
    print(f"GPU: first work {ms(every[0][0])}, last {ms(every[-1][1])}; busy {busy / 1e3:.3f} ms of "
          f"{(every[-1][1] - every[0][0]) / 1e3:.3f}; before it {(every[0][0] - zero) / 1e3:.3f} ms, after it "
          f"{(end - every[-1][1]) / 1e3:.3f} ms")
    for (_, b), (c, _) in itertools.pairwise(every):
        if c - b >= args.gap_us:
            print(f"  gap {ms(b)} .. {ms(c)}  ({(c - b):.0f} us)")


if __name__ == "__main__":
    main()
