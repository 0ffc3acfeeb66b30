"""Resharded weight sync, N sources to M targets, against what users write today and against the bound.

A Llama-shaped model of ``--size`` bytes (the synthetic reference layout: attention q/k/v/o, MLP
gate/up/down, norms, embedding and head) is held by ``--sources`` source processes, each the
``torch.chunk`` dim-0 shard of every tensor (FSDP2's layout), and needed by ``--targets`` target
processes in a TP layout: q/k/v fused into ``qkv_proj`` and gate/up into ``gate_up_proj`` (column
parallel), o_proj and down_proj row parallel, embedding and head vocab parallel, norms replicated.

Measured in the same run, on the same machine and device:

- ``sync``: :class:`tensorxfer.WeightSync` steps (every byte once, straight into the targets' tensors);
  a step's time runs from the first source's ``push()`` to the last rank's end.  The driver gives every
  rank the step's start instant through the store (a trainer's ranks call ``push()`` together after
  their optimizer step); until 2026-12-05 each rank started when the store's notice reached it, which
  put ~0.3 ms of the store's fan-out skew (six ranks) into every GPU step.
- ``baseline`` (``--device cpu`` only): what RL frameworks do today -- gather every tensor to source rank 0
  with torch.distributed (gloo), then rank 0 sends the whole model to each target (tensorxfer's own tcp
  Sender, the fastest honest choice), and each target copies its shard out.
- ``bound``: the most bytes any one target receives, at the 1-to-1 rate of the same transport measured in
  the same run (one Sender to one Receiver of that many bytes).  Over host ipc that one receiver copies
  on every core (``COPY_THREADS``), while the sync's M targets share them: since the ipc copy stopped
  running glibc's ``rep movsb`` (2026-12-05) the bound on the 2-core dev VM is 0.040-0.043 s for 0.98 GB,
  and even ``parallel_copy_floor`` (both targets' bytes, flat, at once) is 1.7-1.9x it: 1.3x cannot be
  met on one 2-core machine.  Until then the bound read 0.064-0.117 s.
- ``bound_core_share`` (host ipc, informative): the same transfer with the receiver copying on
  ``cpu_count // M`` threads, a target's share of the cores when every target runs on this machine.
- ``torch_copy`` (GPU): one ``dst.copy_(src)`` of the bytes all targets receive together.
- ``parallel_copy_floor`` (host): every target's bytes copied at once, one thread each, between warm
  buffers: on a machine whose targets share one memory bus, no sync can beat it, whatever the bound says.
- ``schedule_copy_floor`` (host): the plan's own copies (every pair's groups, half rows of row-parallel
  shards included) run in one process, a thread per pair, all at once: the sync minus its processes and
  control.

Writes ``sync-<device>-<UTC>.json`` under ``--out``.  Run it by hand::

    python3 benchmarks/bench_sync.py --size 2e9 --sources 4 --targets 2 --transport tcp --out benchmarks/results
    python3 benchmarks/bench_sync.py --device cuda:0 --size 16e9 --sources 4 --targets 2 --transport ipc --out $OUT
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import datetime as dt
import json
import os
import pstats
import shlex
import statistics
import subprocess
import sys
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import trace_sync  # noqa: E402  (benchmarks/, beside this file)

import tensorxfer as tx  # noqa: E402
from tensorxfer import synthetic  # noqa: E402
from tensorxfer.cli.bench import machine_facts  # noqa: E402
from tensorxfer.manifest import Manifest  # noqa: E402
from tensorxfer.sync import Source, Target, chunk_box  # noqa: E402
from tensorxfer.sync.rendezvous import open_tcp_store  # noqa: E402
from tensorxfer.sync.spec import RankSpec, SourceTensor, TargetTensor  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def model_layout(size: float) -> list[tuple[str, tuple[int, ...]]]:
    return [(name, shape) for name, _, shape in synthetic.layout(int(size), "BF16")]


def global_value(name: str, shape: tuple[int, ...], step: int, device: str) -> Any:
    """A tensor every rank can rebuild without the others: seeded by its name and the step."""
    g = torch.Generator(device=device).manual_seed((zlib.crc32(name.encode()) & 0xFFFF) * 1000 + step)
    return torch.rand(shape, generator=g, device=device, dtype=torch.float32).to(torch.bfloat16)


def source_shards(layout: list[tuple[str, tuple[int, ...]]], rank: int, n: int, device: str) -> dict[str, Source]:
    """This rank's dim-0 chunk of every tensor, filled with the global values (so targets can check them)."""
    out = {}
    for name, shape in layout:
        box = chunk_box(shape, 0, rank, n)
        # clone: a dim-0 slice is already contiguous, and .contiguous() would keep the whole global tensor
        local = global_value(name, shape, 0, device)[box.offsets[0]:box.offsets[0] + box.sizes[0]].clone()
        out[name] = Source(local, shape, box)
    return out


def check_target(layout: list[tuple[str, tuple[int, ...]]], tensors: dict[str, Target], device: str) -> int:
    """Every target tensor equals its pieces cut from the global values; the number of tensors checked."""
    shapes = dict(layout)
    for name, target in tensors.items():
        for piece in target.pieces:
            full = global_value(piece.source_name, shapes[piece.source_name], 0, device)
            src = full[tuple(slice(o, o + k) for o, k in zip(piece.source_box.offsets, piece.source_box.sizes))]
            dst = target.tensor[tuple(slice(a, a + k) for a, k in zip(piece.at, piece.source_box.sizes))]
            if not torch.equal(src, dst):
                raise AssertionError(f"target tensor {name!r}: piece of {piece.source_name!r} differs")
    return len(tensors)


def target_tensors(layout: list[tuple[str, tuple[int, ...]]], rank: int, m: int, device: str) -> dict[str, Target]:
    shapes = dict(layout)
    out: dict[str, Target] = {}

    def empty(shape: tuple[int, ...]) -> Any:
        return torch.empty(shape, dtype=torch.bfloat16, device=device)
    for name, shape in layout:
        layer, _, leaf = name.rpartition(".self_attn.")
        if leaf == "q_proj.weight":
            parts = [(f"{layer}.self_attn.{p}_proj.weight", shapes[f"{layer}.self_attn.{p}_proj.weight"])
                     for p in "qkv"]
            rows = sum(chunk_box(s, 0, rank, m).sizes[0] for _, s in parts)
            out[f"{layer}.self_attn.qkv_proj.weight"] = Target.fused(empty((rows, shape[1])), parts, 0, rank, m)
        elif leaf in ("k_proj.weight", "v_proj.weight"):
            continue
        elif name.endswith("mlp.gate_proj.weight"):
            up = name.replace("gate_proj", "up_proj")
            parts = [(name, shape), (up, shapes[up])]
            rows = sum(chunk_box(s, 0, rank, m).sizes[0] for _, s in parts)
            out[name.replace("gate_proj", "gate_up_proj")] = Target.fused(empty((rows, shape[1])), parts, 0, rank, m)
        elif name.endswith("mlp.up_proj.weight"):
            continue
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            box = chunk_box(shape, 1, rank, m)
            out[name] = Target.shard(empty(box.sizes), name, shape, 1, rank, m)
        elif len(shape) == 1:
            out[name] = Target.whole(empty(shape), name)
        else:
            box = chunk_box(shape, 0, rank, m)
            out[name] = Target.shard(empty(box.sizes), name, shape, 0, rank, m)
    return out


# ---------------------------------------------------------------- ranks (child processes)
def specs(size: float, n: int, m: int) -> tuple[list[RankSpec], list[RankSpec], list[int], list[int]]:
    """The ranks' specs as bench_sync's processes declare them (BF16, dim-0 sources, the TP targets), each
    rank's region size in bytes: for measuring the plan's copies without the processes."""
    layout = model_layout(size)
    sources, src_bytes = [], []
    for r in range(n):
        man = Manifest.layout([(name, "BF16", chunk_box(shape, 0, r, n).sizes) for name, shape in layout])
        sources.append(RankSpec("source", r, [SourceTensor(name, shape, "BF16", chunk_box(shape, 0, r, n),
                                                           man[name].offset) for name, shape in layout]))
        src_bytes.append(man.nbytes)
    targets, tgt_bytes = [], []
    for t in range(m):
        tensors = target_tensors(layout, t, m, "meta")
        man = Manifest.layout([(name, "BF16", tuple(x.tensor.shape)) for name, x in tensors.items()])
        targets.append(RankSpec("target", t, [TargetTensor(name, tuple(x.tensor.shape), "BF16", man[name].offset,
                                                           tuple(x.pieces)) for name, x in tensors.items()]))
        tgt_bytes.append(man.nbytes)
    return sources, targets, src_bytes, tgt_bytes


START_AHEAD = 0.005     # s: the store tells every rank the step's start instant this long before it


def wait_go(store: Any, key: str) -> None:
    """Start a step at the instant the driver put under ``key`` (every rank at once, as a trainer's ranks
    leave their optimizer step together), not as the store's notices reach each rank: those arrive
    ~0.3 ms apart for six ranks, a skew of the store, not of the sync."""
    store.wait([key])
    at = float(store.get(key))
    while (left := at - time.time()) > 0:
        if left > 0.0005:
            time.sleep(left - 0.0005)   # then spin the last half millisecond: a sleep wakes up late


def rank_main(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)        # one intra-op thread per rank: N + M ranks share the machine's cores
    n, m = args.sources, args.targets
    layout = model_layout(args.size)
    store = open_tcp_store("127.0.0.1", args.store_port, False, timeout=600)
    role, rank = args.role, args.rank
    if args.trace:
        trace_sync.install()
    tensors: Any = (source_shards(layout, rank, n, args.device) if role == "source" else
                    target_tensors(layout, rank, m, args.device))
    sync = tx.WeightSync(store, "bench", role, rank, (n, m), tensors, token="bench", transport=args.transport,
                         timeout=600, stall_timeout=300, elastic=args.membership == "elastic",
                         copy_host={"auto": None, "on": True, "off": False}[args.copy_host])
    if args.device != "cpu":
        torch.cuda.empty_cache()    # the global values' temporaries and the adopted shards' old storage: six
        #                             ranks share one GPU, and an 80 GB card holds 16 GB of model only twice
    steps = []
    store.set(f"ready/{role}/{rank}", b"1")
    prof = cProfile.Profile() if args.profile and rank == 0 else None     # rank 0 of each role, warm steps
    for step in range(args.repeat + 1):
        wait_go(store, f"go/{step}")
        t0 = time.time()
        if prof is not None and step:
            prof.enable()
        if role == "source":
            st = sync.push()
        else:
            sync.wait(timeout=600)
            st = sync.last_stats
        if prof is not None:
            prof.disable()
        steps.append((t0, time.time()))
        store.set(f"done/{step}/{role}/{rank}", json.dumps({"start": t0, "end": steps[-1][1]}).encode())
    if args.trace:
        trace_sync.dump(args.trace, role, rank, steps)
    if prof is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
        with open(args.profile / f"profile-{role}{rank}.txt", "w") as f:
            for key in ("cumulative", "tottime"):
                pstats.Stats(prof, stream=f).sort_stats(key).print_stats(50)
    # the last step as this rank saw it: pack time and bytes, and per pair its seconds and wire seconds
    store.set(f"stats/{role}/{rank}", json.dumps({**st.as_dict(), "adopted": sync.adopted}).encode())
    if role == "target":
        store.set(f"bytes/{rank}", str(sync.region.nbytes).encode())
        checked = check_target(layout, tensors, args.device)
        print(f"target {rank}: all {checked} tensors equal their pieces of the global values", flush=True)
    sync.close()
    return 0


def baseline_main(args: argparse.Namespace) -> int:
    """What users write today: gloo gather to source rank 0, whole model to every target, targets slice."""
    import torch.distributed as dist

    torch.set_num_threads(1)        # as the sync's ranks
    n, m = args.sources, args.targets
    layout = model_layout(args.size)
    store = open_tcp_store("127.0.0.1", args.store_port, False, timeout=600)
    if args.role == "source":
        dist.init_process_group("gloo", store=dist.PrefixStore("gloo", store), rank=args.rank, world_size=n)
        shards = {name: global_value(name, shape, 0, "cpu")[chunk_box(shape, 0, args.rank, n).offsets[0]:][
            :chunk_box(shape, 0, args.rank, n).sizes[0]].contiguous() for name, shape in layout}
        full = None
        if args.rank == 0:
            full = tx.TensorRegion.from_manifest(tx.Manifest.layout([(nm, "BF16", s) for nm, s in layout]))
            views = full.tensors(framework="torch")
        addresses = [store.get(f"base/addr/{t}").decode() for t in range(m)] if args.rank == 0 else []
        senders = [tx.Sender(a, transport="tcp", stall_timeout=300) for a in addresses]
        store.set(f"ready/base/source/{args.rank}", b"1")
        for step in range(args.repeat + 1):
            wait_go(store, f"base/go/{step}")
            t0 = time.time()
            for name, shape in layout:
                local = shards[name]
                sizes = [chunk_box(shape, 0, r, n).sizes[0] for r in range(n)]
                gather = [torch.empty((s, *shape[1:]), dtype=local.dtype) for s in sizes] if args.rank == 0 else None
                dist.gather(local, gather, dst=0)
                if args.rank == 0:
                    torch.cat(gather, out=views[name]) if len(shape) > 1 or n > 1 else views[name].copy_(gather[0])
            for s in senders:
                s.send(full)
            store.set(f"base/done/{step}/source/{args.rank}", json.dumps({"start": t0, "end": time.time()}).encode())
        for s in senders:
            s.close()
        if full is not None:
            del views
            full.close()
        dist.destroy_process_group()
        return 0
    tensors = target_tensors(layout, args.rank, m, "cpu")
    with tx.Receiver("127.0.0.1:0", stall_timeout=300) as rx:
        store.set(f"base/addr/{args.rank}", "{}:{}".format(*rx.address).encode())
        store.set(f"ready/base/target/{args.rank}", b"1")
        for step in range(args.repeat + 1):
            region = rx.receive(timeout=600)
            views = region.tensors(framework="torch")
            for target in tensors.values():       # slice this rank's shard out of the whole model
                for piece in target.pieces:
                    src = views[piece.source_name]
                    index = tuple(slice(o, o + s) for o, s in zip(piece.source_box.offsets, piece.source_box.sizes))
                    dst = tuple(slice(a, a + s) for a, s in zip(piece.at, piece.source_box.sizes))
                    target.tensor[dst].copy_(src[index])
            del views
            store.set(f"base/done/{step}/target/{args.rank}", json.dumps({"end": time.time()}).encode())
    return 0


# ---------------------------------------------------------------- driver
def spawn(args: argparse.Namespace, port: int, role: str, rank: int, what: str) -> subprocess.Popen:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--what", what, "--role", role, "--rank", str(rank),
           "--store-port", str(port), "--size", str(args.size), "--sources", str(args.sources), "--targets",
           str(args.targets), "--transport", args.transport, "--device", args.device, "--repeat", str(args.repeat),
           "--membership", args.membership, "--copy-host", args.copy_host] + (
               ["--profile", str(args.profile)] if args.profile else []) + (
               ["--trace", str(args.trace)] if args.trace else [])
    return subprocess.Popen(cmd, env=dict(os.environ, PYTHONPATH=str(ROOT)))


def wait_for(store: Any, keys: list[str], procs: list[subprocess.Popen], limit: float = 900.0) -> None:
    """Wait for ``keys`` in the store, but stop (RuntimeError) as soon as a rank process has exited with an
    error: a failed rank never sets its key, and the bench would wait out the limit (on the GPU, device time)."""
    end = time.monotonic() + limit
    while not store.check(keys):     # (polled: a step's times are the ranks' own, not when this sees them)
        failed = [p.args for p in procs if p.poll() not in (None, 0)]
        if failed or time.monotonic() > end:
            for p in procs:
                p.kill()
            raise RuntimeError(f"a rank failed ({failed[0] if failed else 'timed out'}): see its output above")
        time.sleep(0.02)


def run_steps(args: argparse.Namespace, store: Any, prefix: str, procs: list[subprocess.Popen],
              ready: list[str]) -> tuple[list[float], list[float]]:
    """Each step's time two ways, to the last rank's end: from the start instant this process sets in the
    store (:func:`wait_go`; a rank told late starts late) and from the first source rank's start (the
    trainer calling push())."""
    wait_for(store, ready, procs)
    from_go, from_push = [], []
    n, m = args.sources, args.targets
    for step in range(args.repeat + 1):
        go = time.time() + START_AHEAD
        store.set(f"{prefix}go/{step}", repr(go).encode())
        sources = [f"{prefix}done/{step}/source/{s}" for s in range(n)]
        keys = [f"{prefix}done/{step}/target/{t}" for t in range(m)] + sources
        wait_for(store, keys, procs)
        records = dict(zip(keys, (json.loads(v) for v in store.multi_get(keys))))
        end = max(r["end"] for r in records.values())
        from_go.append(end - go)
        from_push.append(end - min(records[k]["start"] for k in sources))
    for p in procs:
        if p.wait(timeout=600) != 0:
            raise RuntimeError(f"a rank failed with {p.returncode}")
    return from_go, from_push


def one_to_one(nbytes: int, transport: str, device: str, repeat: int, copy_threads: int | None = None) -> float:
    """Seconds for one warm transfer of ``nbytes`` from a Sender to a Receiver (here, one process each);
    ``copy_threads``: the host ipc receiver copies on that many threads (default: its own choice)."""
    import threading

    from tensorxfer.transport.ipc import copy as ipc_copy

    default_threads = ipc_copy.COPY_THREADS
    ipc_copy.COPY_THREADS = copy_threads or default_threads
    m = tx.Manifest.layout([("x", "U8", (nbytes,))])
    try:
        with tx.TensorRegion.from_manifest(m, device=device) as region, \
                tx.Receiver(device=device, stall_timeout=300) as rx:
            got = threading.Thread(target=lambda: [rx.receive(timeout=300) for _ in range(repeat + 1)])
            got.start()
            with tx.Sender("{}:{}".format(*rx.address), transport=transport, stall_timeout=300) as s:
                runs = [s.send(region).seconds for _ in range(repeat + 1)]
            got.join()
    finally:
        ipc_copy.COPY_THREADS = default_threads
    return statistics.median(runs[1:])


def copy_floor(sizes: list[int], repeat: int) -> float:
    """Host memory alone: seconds for one thread per target to copy that target's bytes between warm
    buffers, all at once (numpy's copy; the GIL is released).  What the machine's memory allows M targets
    that each write their bytes once: below the 1-to-1 bound when they share one memory bus."""
    import numpy as np

    bufs = [(np.ones(n, dtype=np.uint8), np.ones(n, dtype=np.uint8)) for n in sizes]
    return all_at_once([(np.copyto, (dst, src)) for src, dst in bufs], repeat)


def median_seconds(fn: Any, device: str, repeat: int) -> float:
    """Median seconds of ``repeat`` calls of ``fn`` after a warm-up one, the device synchronized around each."""
    runs = []
    for _ in range(repeat + 1):
        if device != "cpu":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device != "cpu":
            torch.cuda.synchronize()
        runs.append(time.perf_counter() - t)
    return statistics.median(runs[1:])


def rank_arguments(p: argparse.ArgumentParser, transport: str) -> None:
    """The flags the driver passes its rank processes (bench_sync's and bench_fp8's)."""
    p.add_argument("--role", default="")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--store-port", type=int, default=0)
    p.add_argument("--size", type=float, default=2e9)
    p.add_argument("--sources", type=int, default=4)
    p.add_argument("--targets", type=int, default=2)
    p.add_argument("--transport", default=transport)
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeat", type=int, default=3)


def all_at_once(jobs: list[tuple[Any, tuple]], repeat: int) -> float:
    """Median seconds (of ``repeat`` runs after a warm-up) for ``fn(*args)`` of every job, each in its own
    thread, all started at once."""
    import threading

    runs = []
    for _ in range(repeat + 1):
        threads = [threading.Thread(target=fn, args=args) for fn, args in jobs]
        t = time.perf_counter()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        runs.append(time.perf_counter() - t)
    return statistics.median(runs[1:])


@contextlib.contextmanager
def plan_in_host_regions(size: float, n: int, m: int,
                         one_target_buffer: bool = False) -> Iterator[tuple[Any, list[Any], list[int]]]:
    """The ``n``-to-``m`` plan of ``specs`` and warm host regions (memfd, every byte written) for its ranks:
    yields (plan, byte views of the sources' regions then the targets', each target's bytes).  With
    ``one_target_buffer`` the targets share one region, each at the sum of the earlier targets' bytes.
    The regions are closed on exit (each unmapped once its last view is gone)."""
    import numpy as np

    from tensorxfer.memory import HostRegion
    from tensorxfer.sync.plan import plan

    sources, targets, src_bytes, tgt_bytes = specs(size, n, m)
    pl = plan(sources, targets)
    regions = [HostRegion.allocate(b) for b in src_bytes + ([sum(tgt_bytes)] if one_target_buffer else tgt_bytes)]
    try:
        views = [np.frombuffer(memoryview(r), dtype=np.uint8) for r in regions]
        for v in views:
            v.fill(1)
        yield pl, views, tgt_bytes
    finally:
        for r in regions:
            r.close()


def schedule_copy_floor(size: float, n: int, m: int, repeat: int) -> float:
    """Host memory alone, this sync's own copies: every (source, target) pair's planned groups copied by
    ``copy_groups`` (what the ipc transport runs) between memfd regions, a thread per pair, all at once, in
    one process -- no processes, sockets or control frames.  A row-parallel shard is half of every source
    row, read at a fraction of a flat copy's speed: this, not the flat floor, is what the schedule's bytes
    cost on this machine's memory."""
    from tensorxfer.memory._hostcopy import copy_groups
    from tensorxfer.sync.fusing import segments_of

    with plan_in_host_regions(size, n, m) as (pl, views, _):
        pairs = [(views[s], views[n + t], segments_of(pl, s, t)) for t in range(m) for s in pl.sources_of.get(t, ())]
        return all_at_once([(copy_groups, (sv, dv, sg.src_off, sg.dst_off, sg.nbytes, sg.count, sg.src_stride,
                                           sg.dst_stride)) for sv, dv, sg in pairs], repeat)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--what", choices=["bench", "sync", "baseline"], default="bench")
    rank_arguments(p, "tcp")
    p.add_argument("--membership", choices=["elastic", "fixed"], default="elastic",
                   help="elastic: members agreed through the store before each step (WeightSync's default)")
    p.add_argument("--copy-host", choices=["auto", "on", "off"], default="auto",
                   help="targets on one device copy through one of them (WeightSync's copy_host; auto: GPUs only)")
    p.add_argument("--no-baseline", action="store_true")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--profile", type=Path, default=None,
                   help="cProfile the warm steps of source 0 and target 0 (their main threads) into this folder")
    p.add_argument("--trace", type=Path, default=None,
                   help="record a timeline of every rank's phases into this folder and print its summary "
                        "(trace_sync.py; the traced steps run slightly slower)")
    args = p.parse_args(argv)
    if args.what == "sync":
        return rank_main(args)
    if args.what == "baseline":
        return baseline_main(args)
    store = open_tcp_store("127.0.0.1", 0, True, timeout=900)
    port = store.port
    n, m = args.sources, args.targets
    procs = [spawn(args, port, "target", t, "sync") for t in range(m)] + \
        [spawn(args, port, "source", s, "sync") for s in range(n)]
    sync_from_go, sync_times = run_steps(args, store, "", procs, [f"ready/{r}/{i}" for r, c in
                                                                  (("source", n), ("target", m)) for i in range(c)])
    target_bytes = [int(store.get(f"bytes/{t}")) for t in range(m)]
    last_step = {f"{role}{r}": json.loads(store.get(f"stats/{role}/{r}"))
                 for role, count in (("source", n), ("target", m)) for r in range(count)}
    result: dict[str, Any] = {"sync_runs_s": sync_times[1:], "sync_cold_s": sync_times[0],
                              "sync_median_s": statistics.median(sync_times[1:]), "target_bytes": target_bytes,
                              "total_target_bytes": sum(target_bytes), "last_step_by_rank": last_step,
                              "step_measured": "from the first source rank's push() to the last rank's end",
                              "sync_from_go_runs_s": sync_from_go[1:],
                              "sync_from_go_median_s": statistics.median(sync_from_go[1:])}
    print("sync", f"{result['sync_median_s'] * 1e3:.2f} ms from the first push,",
          f"{result['sync_from_go_median_s'] * 1e3:.2f} ms from the start instant", flush=True)
    if args.trace:
        print(trace_sync.summarize(args.trace), flush=True)
    bound_one = one_to_one(max(target_bytes), args.transport, args.device, args.repeat)
    result["bound_s"] = bound_one
    result["sync_over_bound"] = result["sync_median_s"] / bound_one
    print("bound", f"{bound_one:.3f} s", "sync/bound", f"{result['sync_over_bound']:.2f}", flush=True)
    if args.device == "cpu" and args.transport == "ipc":
        share = max(1, (os.cpu_count() or 1) // m)
        core_share = one_to_one(max(target_bytes), args.transport, args.device, args.repeat, share)
        result.update(bound_core_share_s=core_share, bound_core_share_threads=share,
                      sync_over_bound_core_share=result["sync_median_s"] / core_share)
        print("bound on a target's share of the cores", f"{core_share:.3f} s ({share} copy thread(s))",
              "sync/that", f"{result['sync_over_bound_core_share']:.2f}", flush=True)
    if args.device == "cpu":
        floor = copy_floor(target_bytes, args.repeat)
        result["parallel_copy_floor_s"] = floor
        result["sync_over_parallel_copy_floor"] = result["sync_median_s"] / floor
        result["parallel_copy_floor_over_bound"] = floor / bound_one
        print("parallel copy floor", f"{floor:.3f} s ({floor / bound_one:.2f}x the bound)", "sync/floor",
              f"{result['sync_over_parallel_copy_floor']:.2f}", flush=True)
        sched = schedule_copy_floor(args.size, n, m, args.repeat)
        result["schedule_copy_floor_s"] = sched
        result["sync_over_schedule_copy_floor"] = result["sync_median_s"] / sched
        result["schedule_copy_floor_over_bound"] = sched / bound_one
        print("schedule copy floor", f"{sched:.3f} s ({sched / bound_one:.2f}x the bound)", "sync/schedule floor",
              f"{result['sync_over_schedule_copy_floor']:.2f}", flush=True)
    if args.device != "cpu":
        src = torch.empty(sum(target_bytes), dtype=torch.uint8, device=args.device)
        dst = torch.empty_like(src)
        result["torch_copy_s"] = median_seconds(lambda: dst.copy_(src), args.device, args.repeat)
        del src, dst
        result["ratio_torch_copy_over_sync"] = result["torch_copy_s"] / result["sync_median_s"]
        result["ratio_torch_copy_over_sync_from_go"] = result["torch_copy_s"] / result["sync_from_go_median_s"]
        print("torch copy", f"{result['torch_copy_s'] * 1e3:.2f} ms", "ratio",
              f"{result['ratio_torch_copy_over_sync']:.3f} (from the start instant: "
              f"{result['ratio_torch_copy_over_sync_from_go']:.3f})", flush=True)
    elif not args.no_baseline:
        procs = [spawn(args, port, "target", t, "baseline") for t in range(m)]
        store.wait([f"ready/base/target/{t}" for t in range(m)], dt.timedelta(seconds=300))
        procs += [spawn(args, port, "source", s, "baseline") for s in range(n)]
        base_from_go, base = run_steps(args, store, "base/", procs,
                                       [f"ready/base/{r}/{i}" for r, c in (("source", n), ("target", m))
                                        for i in range(c)])
        result.update(baseline_runs_s=base[1:], baseline_median_s=statistics.median(base[1:]),
                      speedup_over_baseline=statistics.median(base[1:]) / result["sync_median_s"],
                      baseline_from_go_median_s=statistics.median(base_from_go[1:]))
        print("baseline", f"{result['baseline_median_s']:.3f} s", "speedup",
              f"{result['speedup_over_baseline']:.2f}", flush=True)
    out = {"command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
           "date": dt.datetime.now(dt.timezone.utc).isoformat(), "machine": machine_facts(), "size": args.size,
           "sources": n, "targets": m, "transport": args.transport, "device": args.device, "result": result}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"sync-{args.device.replace(':', '')}-{args.transport}-{n}to{m}-" \
                      f"{dt.datetime.now(dt.timezone.utc).strftime('%Y%m%dT%H%MZ')}.json"
    path.write_text(json.dumps(out, indent=1))
    print("wrote", path, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
