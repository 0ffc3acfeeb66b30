"""Would a host sync be faster if each source wrote its targets' parts (push) instead of each target pulling?

The 2 GB Llama-shaped plan of ``bench_sync.py`` (4 dim-0 sources to 2 TP targets), its groups copied by
``copy_groups`` between warm host regions in this one process (both targets in one buffer), three ways:

- pull, a thread per pair: what the ipc targets run today.  A row-parallel shard is half of every source
  row, so each target reads half rows, skipping the other half.
- pull with every group cut into single rows: what cutting alone costs.
- push, a thread per source: the same single rows, all targets' rows sorted by source offset, so each source
  row is read once, front to back, and its halves written to both targets (what a source writing into its
  targets' memory would run, with no new kernel).

Medians of ``--rounds`` rounds, the three alternating, each round the median of ``--repeat`` runs::

    .venv/bin/python benchmarks/probe_sync_push.py [--size 2e9] [--rounds 5] [--repeat 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
from bench_sync import all_at_once, plan_in_host_regions

from tensorxfer.memory._hostcopy import copy_groups
from tensorxfer.sync.fusing import segments_of

U64 = np.uint64


def single_rows(cols: list[Any]) -> list[Any]:
    """The same copies as one-row groups, in group then row order."""
    so, do, w, h, ss, ds = cols
    rows = h.astype(np.int64)
    idx = np.repeat(np.arange(len(w)), rows)
    r = (np.arange(len(idx)) - np.repeat(np.cumsum(rows) - rows, rows)).astype(U64)
    return [so[idx] + r * ss[idx], do[idx] + r * ds[idx], w[idx], np.ones(len(idx), U64), w[idx], w[idx]]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=float, default=2e9)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    n, m = 4, 2
    with plan_in_host_regions(args.size, n, m, one_target_buffer=True) as (pl, views, tgt_bytes):
        measure(pl, views, tgt_bytes, n, m, args.rounds, args.repeat)
    return 0


def measure(pl: Any, views: list[Any], tgt_bytes: list[int], n: int, m: int, rounds: int, repeat: int) -> None:
    """Time and print the three ways (``views``: the sources' regions, then one holding every target)."""
    dst = views[n]
    base = [sum(tgt_bytes[:t]) for t in range(m)]
    pairs = []
    for t in range(m):
        for s in pl.sources_of.get(t, ()):
            sg = segments_of(pl, s, t)
            pairs.append((s, [sg.src_off, sg.dst_off + U64(base[t]), sg.nbytes, sg.count, sg.src_stride,
                              sg.dst_stride]))
    by_source: dict[int, list[list[Any]]] = {}
    for s, cols in pairs:
        by_source.setdefault(s, []).append(single_rows(cols))
    push = {}
    for s, parts in by_source.items():
        joined = [np.concatenate([part[i] for part in parts]) for i in range(6)]
        order = np.argsort(joined[0], kind="stable")
        push[s] = [np.ascontiguousarray(c[order]) for c in joined]
    jobs = {
        "pull, a thread per pair (today)": [(copy_groups, (views[s], dst, *cols)) for s, cols in pairs],
        "pull, single rows, a thread per pair": [(copy_groups, (views[s], dst, *single_rows(cols)))
                                                 for s, cols in pairs],
        "push, a thread per source, rows read once": [(copy_groups, (views[s], dst, *cols))
                                                      for s, cols in push.items()],
    }
    runs: dict[str, list[float]] = {what: [] for what in jobs}
    for _ in range(rounds):
        for what, todo in jobs.items():
            runs[what].append(all_at_once(todo, repeat))
    total = sum(tgt_bytes)
    print(f"{total / 1e9:.2f} GB to {m} targets from {n} sources; {sum(len(c[0]) for c in push.values())} rows "
          f"when cut into single rows")
    for what, seconds in runs.items():
        print(f"{what:44} median {statistics.median(seconds) * 1e3:6.1f} ms  (rounds: "
              f"{' '.join(f'{x * 1e3:.1f}' for x in seconds)})")


if __name__ == "__main__":
    sys.exit(main())
