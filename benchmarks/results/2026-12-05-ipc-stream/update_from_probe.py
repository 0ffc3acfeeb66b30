"""``TensorRegion.update_from`` of one 1 GB host tensor into a host region, against numpy's copy of the whole.

    PYTHONPATH=<tree> .venv/bin/python benchmarks/results/2026-12-05-ipc-stream/update_from_probe.py <label>
"""

import statistics
import sys
import time

import numpy as np

import tensorxfer as tx

N = 10**9
a = np.random.default_rng(0).integers(0, 255, N, dtype=np.uint8)
b = np.empty_like(a)
np.copyto(b, a)
with tx.TensorRegion.from_tensors({"w": a}, device="cpu") as r:
    runs, ref = [], []
    for _ in range(7):
        t = time.perf_counter()
        r.update_from({"w": a})
        runs.append(time.perf_counter() - t)
        t = time.perf_counter()
        np.copyto(b, a)
        ref.append(time.perf_counter() - t)
    assert np.array_equal(r.tensors()["w"], a)
    print(f"{sys.argv[1]}: update_from 1 GB host {statistics.median(runs) * 1e3:.1f} ms, "
          f"numpy.copyto whole {statistics.median(ref) * 1e3:.1f} ms")
