"""Benchmark: packing a reference-shaped model into one region, and manifest speed.

Measured side by side in one run, medians over --repeat runs:

- ``from_tensors`` (allocate a memfd region with pages committed, then copy
  820 tensors in) against memcpy of the same bytes (numpy ``copyto`` of one
  contiguous buffer into a freshly allocated one: it pays its page faults
  too).  Ratio = memcpy time / from_tensors time (1.0 = as fast as memcpy).
- ``update_from`` (the copy alone, into the existing region: a training
  step's update) against ``copyto`` into a warm preallocated buffer.
- Manifest pack + unpack + validate for 820 and 100,000 tensors.

Model shape: ``tensorxfer.synthetic.layout`` — 820 BF16 tensors of a
91-layer decoder (per layer: 2 norm vectors, 4 attention and 3 MLP
matrices; plus embedding and lm_head), ~99.9% of the bytes in matrices.

    python benchmarks/bench_region.py --size 2e9 --repeat 5
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from tensorxfer import Manifest, TensorRegion, synthetic


def median_time(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=float, default=2e9, help="model bytes (default 2e9)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args()

    src = dict(synthetic.tensors(int(args.size)))
    nbytes = sum(a.nbytes for a in src.values())
    flat = np.concatenate([a.reshape(-1).view(np.uint8) for a in src.values()])

    def memcpy_fresh():
        dst = np.empty_like(flat)
        np.copyto(dst, flat)

    warm = np.empty_like(flat)
    np.copyto(warm, flat)

    def pack():
        TensorRegion.from_tensors(src).close()

    region = TensorRegion.from_tensors(src)
    results: dict = {}
    # interleave reference and subject so drift hits both alike
    t_memcpy_fresh = median_time(memcpy_fresh, args.repeat)
    t_pack = median_time(pack, args.repeat)
    t_memcpy_warm = median_time(lambda: np.copyto(warm, flat), args.repeat)
    t_update = median_time(lambda: region.update_from(src), args.repeat)
    region.close()

    manifests = {}
    for n in (820, 100_000):
        m = Manifest.layout((f"model.layers.{i}.weight", "BF16", (64, 64)) for i in range(n))
        data = m.pack()
        t_pack_m = median_time(m.pack, max(args.repeat, 5))
        t_unpack_m = median_time(lambda d=data: Manifest.unpack(d), max(args.repeat, 5))
        manifests[n] = {"bytes": len(data), "pack_ms": t_pack_m * 1e3, "unpack_validate_ms": t_unpack_m * 1e3,
                        "total_ms": (t_pack_m + t_unpack_m) * 1e3}

    gbs = lambda t: nbytes / t / 1e9  # noqa: E731
    results = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "numpy": np.__version__},
        "tensors": len(src), "bytes": nbytes, "repeat": args.repeat,
        "from_tensors": {"seconds": t_pack, "GBps": gbs(t_pack)},
        "memcpy_fresh": {"seconds": t_memcpy_fresh, "GBps": gbs(t_memcpy_fresh)},
        "ratio_from_tensors_vs_memcpy_fresh": t_memcpy_fresh / t_pack,
        "update_from": {"seconds": t_update, "GBps": gbs(t_update)},
        "memcpy_warm": {"seconds": t_memcpy_warm, "GBps": gbs(t_memcpy_warm)},
        "ratio_update_vs_memcpy_warm": t_memcpy_warm / t_update,
        "manifest": manifests,
    }
    print(f"{len(src)} tensors, {nbytes / 1e9:.2f} GB, median of {args.repeat}")
    print(f"{'':34}{'seconds':>10}{'GB/s':>10}{'ratio':>8}")
    print(f"{'memcpy into fresh buffer':34}{t_memcpy_fresh:10.3f}{gbs(t_memcpy_fresh):10.2f}")
    print(f"{'from_tensors (alloc + copy)':34}{t_pack:10.3f}{gbs(t_pack):10.2f}"
          f"{results['ratio_from_tensors_vs_memcpy_fresh']:8.2f}")
    print(f"{'memcpy into warm buffer':34}{t_memcpy_warm:10.3f}{gbs(t_memcpy_warm):10.2f}")
    print(f"{'update_from (copy into region)':34}{t_update:10.3f}{gbs(t_update):10.2f}"
          f"{results['ratio_update_vs_memcpy_warm']:8.2f}")
    for n, r in manifests.items():
        print(f"manifest {n:>7} tensors: {r['bytes']:>9} bytes, pack {r['pack_ms']:.2f} ms + "
              f"unpack/validate {r['unpack_validate_ms']:.2f} ms = {r['total_ms']:.2f} ms")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"region-{datetime.now(timezone.utc):%Y-%m-%d}.json"
    path.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
