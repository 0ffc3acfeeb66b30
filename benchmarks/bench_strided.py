"""The device copies of a resharded weight sync, alone in one process: the strided-copy kernel against the
copy engines' pitched copies (``cuMemcpy2DAsync``) and against one torch ``dst.copy_(src)`` of the same
bytes.  No processes, sockets or control frames: what is left of a sync step's time above these numbers is
orchestration.

The layout is ``bench_sync``'s (a Llama-shaped model, dim-0 shards on ``--sources``, a TP layout on
``--targets``); every pair's segments come from the real planner.  Per target: every source's segments run
on one stream one after another, and on one stream per source at once (as a target's feeds do).  Times are
CUDA events, medians of ``--repeat``.  Writes ``strided-<UTC>.json`` under ``--out``::

    python3 benchmarks/bench_strided.py --size 16e9 --sources 4 --targets 2 --out $OUT
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import shlex
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from bench_sync import specs  # noqa: E402

from tensorxfer.cli.bench import machine_facts  # noqa: E402
from tensorxfer.memory import strided  # noqa: E402
from tensorxfer.memory._copy import Copier, StridedCopy  # noqa: E402
from tensorxfer.sync.fusing import segments_of  # noqa: E402
from tensorxfer.sync.plan import plan  # noqa: E402


def timed(fn: Any, streams: list[Any], repeat: int) -> float:
    runs = []
    for _ in range(repeat + 1):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        for s in streams:
            torch.cuda.current_stream().wait_stream(s)
        end.record()
        torch.cuda.synchronize()
        runs.append(start.elapsed_time(end) / 1e3)
    return statistics.median(runs[1:])


def measure_target(t: int, segs: dict[int, Any], src: list[Any], nbytes: int, tile_sizes: list[int], repeat: int,
                   images: dict[str, bytes], row_sizes: list[int]) -> dict[str, Any]:
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    moved = sum(sg.total_bytes for sg in segs.values())
    copiers = {s: Copier(0) for s in segs}
    ext = [torch.cuda.ExternalStream(c.stream) for c in copiers.values()]
    one = copiers[next(iter(segs))]
    row: dict[str, Any] = {"target": t, "bytes": moved, "groups": {s: len(sg) for s, sg in segs.items()}}
    for (label, image), tile, rows in itertools.product(images.items(), tile_sizes, row_sizes):
        at = f"{tile}" if len(images) == 1 and len(row_sizes) == 1 else f"{label}@{tile}@rows{rows}"
        kernels = {s: StridedCopy(0, strided.tiles(sg.src_off, sg.dst_off, sg.nbytes, sg.count, sg.src_stride,
                                                   sg.dst_stride, tile_bytes=tile, row_bytes=rows), image)
                   for s, sg in segs.items()}

        def serial(kernels: dict[int, Any] = kernels) -> None:
            for s, k in kernels.items():
                k.launch(one, dst.data_ptr(), src[s].data_ptr())

        def parallel(kernels: dict[int, Any] = kernels) -> None:
            for s, k in kernels.items():
                k.launch(copiers[s], dst.data_ptr(), src[s].data_ptr())
        row[f"kernel_one_stream_s@{at}"] = timed(serial, [ext[0]], repeat)
        row[f"kernel_stream_per_source_s@{at}"] = timed(parallel, ext, repeat)
        row[f"tiles@{at}"] = {s: k.tiles for s, k in kernels.items()}
        if len(images) > 1 or len(row_sizes) > 1:     # the variants must copy the same bytes: digests agree
            dst.zero_()
            torch.cuda.synchronize()        # the zeroing (torch's stream) ends before the copy (the copier's)
            serial()
            torch.cuda.current_stream().wait_stream(ext[0])
            row[f"digest@{at}"] = int(dst.view(torch.int64).sum().item()) if nbytes % 8 == 0 else None
        for k in kernels.values():
            k.close()

    def engines() -> None:
        for s, sg in segs.items():
            copiers[s].dtod_groups(sg.dst_off + np.uint64(dst.data_ptr()), sg.src_off + np.uint64(src[s].data_ptr()),
                                   sg.nbytes, sg.count, sg.dst_stride, sg.src_stride)
    row["copy_engines_2d_s"] = timed(engines, ext, repeat)
    a = torch.empty(moved, dtype=torch.uint8, device="cuda:0")
    b = torch.empty_like(a)
    row["torch_copy_s"] = timed(lambda: b.copy_(a), [], repeat)
    for c in copiers.values():
        c.close()
    for k, v in list(row.items()):
        if k.endswith("_s") or "_s@" in k:
            row[k.replace("_s", "_gbytes_per_s", 1)] = moved / v / 1e9
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=float, default=16e9)
    p.add_argument("--sources", type=int, default=4)
    p.add_argument("--targets", type=int, default=2)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--tile-bytes", type=int, nargs="*", default=[strided.TILE_BYTES])
    p.add_argument("--row-bytes", type=int, nargs="*", default=[strided.ROW_BYTES])
    p.add_argument("--images", type=Path, nargs="*", default=[],
                   help="kernel variants (fatbin files) to compare; default: the package's strided_copy.fatbin")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = p.parse_args(argv)
    n, m = args.sources, args.targets
    image = strided.kernel_image()
    images = {f.stem: f.read_bytes() for f in args.images} if args.images else {"package": image}
    assert all(images.values()), "strided_copy.fatbin was not built"
    sources, targets, src_bytes, tgt_bytes = specs(args.size, n, m)
    pl = plan(sources, targets)
    src = [torch.randint(0, 256, (b,), dtype=torch.uint8, device="cuda:0") for b in src_bytes]
    result: dict[str, Any] = {"targets": []}
    for t in range(m):
        segs = {s: segments_of(pl, s, t) for s in range(n) if s in pl.sources_of.get(t, ())}
        row = measure_target(t, segs, src, tgt_bytes[t], args.tile_bytes, args.repeat, images,
                             args.row_bytes)
        print(json.dumps(row), flush=True)
        result["targets"].append(row)
    out = {"command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
           "date": dt.datetime.now(dt.timezone.utc).isoformat(), "machine": machine_facts(), "size": args.size,
           "sources": n, "targets": m, "result": result}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"strided-{dt.datetime.now(dt.timezone.utc).strftime('%Y%m%dT%H%MZ')}.json"
    path.write_text(json.dumps(out, indent=1))
    print("wrote", path, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
