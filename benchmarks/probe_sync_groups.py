"""Where a host sync's copies go slower than a flat copy: the plan's own groups, by kind and by threading.

The 2 GB Llama-shaped plan of ``bench_sync.py`` (4 dim-0 sources to 2 TP targets), its groups copied by
``copy_groups`` (what the ipc transport runs) between warm host regions in this one process: a thread per
pair and a thread per target (all at once), one thread for everything, one thread for the contiguous
groups alone and for the strided ones alone (half rows of the row-parallel shards), and numpy's flat copy
of each target's bytes, a thread per target.  Medians of ``--repeat`` runs after a warm-up.

    .venv/bin/python benchmarks/probe_sync_groups.py [--size 2e9] [--repeat 5]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
from bench_sync import all_at_once, plan_in_host_regions

from tensorxfer.memory._hostcopy import copy_groups
from tensorxfer.sync.fusing import segments_of


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=float, default=2e9)
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()
    n, m = 4, 2
    with plan_in_host_regions(args.size, n, m) as (pl, views, tgt_bytes):
        measure(pl, views, tgt_bytes, n, m, args.repeat)
    return 0


def measure(pl: Any, views: list[Any], tgt_bytes: list[int], n: int, m: int, repeat: int) -> None:
    """Time and print every way above (``views``: the sources' regions, then the targets')."""
    pairs = [(s, t, segments_of(pl, s, t)) for t in range(m) for s in pl.sources_of.get(t, ())]

    def columns(sg: Any, keep: Any = None) -> list[Any]:
        cols = [sg.src_off, sg.dst_off, sg.nbytes, sg.count, sg.src_stride, sg.dst_stride]
        return cols if keep is None else [np.ascontiguousarray(c[keep]) for c in cols]

    def in_turn(items: list[tuple[int, int, list[Any]]]) -> tuple[Any, tuple]:
        def run() -> None:
            for s, t, cols in items:
                copy_groups(views[s], views[n + t], *cols)
        return run, ()
    strided = {(s, t): (sg.count > 1) & (sg.src_stride != sg.nbytes) for s, t, sg in pairs}
    total = sum(sg.total_bytes for _, _, sg in pairs)
    strided_bytes = sum(int((sg.nbytes * sg.count)[strided[s, t]].sum()) for s, t, sg in pairs)
    flat = [(np.ones(b, dtype=np.uint8), np.ones(b, dtype=np.uint8)) for b in tgt_bytes]
    jobs = {
        "a thread per pair": [(copy_groups, (views[s], views[n + t], *columns(sg))) for s, t, sg in pairs],
        "a thread per target": [in_turn([(s, t, columns(sg)) for s, tt, sg in pairs if tt == t]) for t in range(m)],
        "one thread": [in_turn([(s, t, columns(sg)) for s, t, sg in pairs])],
        "one thread, contiguous groups": [in_turn([(s, t, columns(sg, ~strided[s, t])) for s, t, sg in pairs])],
        "one thread, strided groups": [in_turn([(s, t, columns(sg, strided[s, t])) for s, t, sg in pairs])],
        "numpy flat copy, a thread per target": [(np.copyto, (dst, src)) for src, dst in flat],
    }
    r = {what: all_at_once(todo, repeat) for what, todo in jobs.items()}
    print(f"{total / 1e9:.2f} GB, of it {strided_bytes / 1e9:.2f} GB in strided groups")
    for what, seconds in r.items():
        print(f"{what:40} {seconds * 1e3:7.1f} ms")
    print(f"one thread: contiguous {(total - strided_bytes) / r['one thread, contiguous groups'] / 1e9:.1f} GB/s, "
          f"strided {strided_bytes / r['one thread, strided groups'] / 1e9:.1f} GB/s")


if __name__ == "__main__":
    sys.exit(main())
