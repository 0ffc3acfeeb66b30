"""The strided-copy kernel's variants on a resharded sync's own schedule, against torch's copy of the same bytes.

``bench_sync``'s 4-to-2 plan (``--size`` bytes), both targets' pairs in this one process (no second CUDA
context): every pair's tiles launched on a stream of its own, as the ipc targets launch them, then all waited
for; beside it, in the same process, torch's ``dst.copy_(src)`` of the same number of bytes.  A variant is
the kernel compiled with other knobs (``strided_copy.cu``: ``TX_UNROLL``, ``TX_STREAMING``) or cut into tiles
of another size; each runs in a process of its own (the kernel module is loaded once per process), and every
variant's copy must leave the same checksum.  Prints a JSON line a variant and round::

    python3 benchmarks/probe_strided_kernel.py [--size 16e9] [--repeat 7] [--rounds 2] [--variants ...]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

KERNEL = ROOT / "tensorxfer" / "memory" / "strided_copy.cu"
TARGETS = ["-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=sm_90"]
#: name -> (nvcc defines, tile bytes; None: strided.TILE_BYTES)
VARIANTS: dict[str, tuple[list[str], int | None]] = {
    "default": ([], None),
    "unroll8": (["-DTX_UNROLL=8"], None),
    "streaming": (["-DTX_STREAMING=1"], None),
    "unroll8-streaming": (["-DTX_UNROLL=8", "-DTX_STREAMING=1"], None),
    "tile128k": ([], 128 << 10),
    "tile1m": ([], 1 << 20),
}


def worker(fatbin: Path, tile_bytes: int | None, size: float, repeat: int) -> dict[str, float | int]:
    import torch
    from bench_sync import specs

    from tensorxfer.memory import strided
    from tensorxfer.memory._copy import Copier, StridedCopy
    from tensorxfer.sync.fusing import segments_of
    from tensorxfer.sync.plan import plan

    sources, targets, src_bytes, tgt_bytes = specs(size, 4, 2)
    pl = plan(sources, targets)
    # as long as the targets' bytes too (replicated tensors make them more than the sources'): the torch copy
    src = torch.randint(0, 256, (max(sum(src_bytes), sum(tgt_bytes)),), dtype=torch.uint8, device="cuda",
                        generator=torch.Generator(device="cuda").manual_seed(7))
    dst = torch.zeros(sum(tgt_bytes), dtype=torch.uint8, device="cuda")
    src_at = [src.data_ptr() + sum(src_bytes[:s]) for s in range(len(src_bytes))]
    dst_at = [dst.data_ptr() + sum(tgt_bytes[:t]) for t in range(len(tgt_bytes))]
    image = fatbin.read_bytes()
    pairs = []
    for t in range(len(tgt_bytes)):
        for s in pl.sources_of.get(t, ()):
            sg = segments_of(pl, s, t)
            tiles = strided.tiles(sg.src_off, sg.dst_off, sg.nbytes, sg.count, sg.src_stride, sg.dst_stride,
                                  tile_bytes=tile_bytes or strided.TILE_BYTES)
            pairs.append((Copier(0), StridedCopy(0, tiles, image), dst_at[t], src_at[s]))

    def schedule() -> None:
        for copier, kernel, d, s in pairs:
            kernel.launch(copier, d, s)
        for copier, *_ in pairs:
            copier.synchronize()

    n = sum(tgt_bytes)

    def torch_copy() -> None:
        dst.copy_(src[:n])
        torch.cuda.synchronize()

    def timed(fn: object) -> list[float]:
        runs = []
        for _ in range(repeat + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()                                            # type: ignore[operator]
            runs.append(time.perf_counter() - t0)
        return runs[1:]

    kernel_runs = timed(schedule)
    checksum = int(dst.view(torch.int64).sum().item())     # every variant must land the same bytes
    copy_runs = timed(torch_copy)
    tiles_total = sum(k.tiles for _, k, _, _ in pairs)
    return {"bytes": n, "tiles": tiles_total, "checksum": checksum, "kernel_s": statistics.median(kernel_runs),
            "torch_copy_s": statistics.median(copy_runs),
            "torch_copy_over_kernel": statistics.median(copy_runs) / statistics.median(kernel_runs)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=float, default=16e9)
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--tile-bytes", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker is not None:
        print(json.dumps(worker(args.worker, args.tile_bytes or None, args.size, args.repeat)), flush=True)
        return 0
    nvcc = shutil.which("nvcc") or next((str(Path(r, "bin", "nvcc")) for r in
                                         (os.environ.get("CUDA_HOME", ""), "/usr/local/cuda")
                                         if r and Path(r, "bin", "nvcc").exists()), None)
    if nvcc is None:
        print("probe_strided_kernel: nvcc not found (set CUDA_HOME)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        images = {}
        for name in args.variants:
            defines, _ = VARIANTS[name]
            images[name] = Path(tmp, f"{name}.fatbin")
            subprocess.run([nvcc, "-fatbin", "-O3", *TARGETS, *defines, "-o", str(images[name]), str(KERNEL)],
                           check=True)
        for round_ in range(1, args.rounds + 1):
            for name in args.variants:
                _, tile_bytes = VARIANTS[name]
                out = subprocess.run([sys.executable, __file__, "--worker", str(images[name]), "--tile-bytes",
                                      str(tile_bytes or 0), "--size", str(args.size), "--repeat", str(args.repeat)],
                                     check=True, stdout=subprocess.PIPE, text=True).stdout
                record = {"variant": name, "round": round_, **json.loads(out.strip().splitlines()[-1])}
                print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
