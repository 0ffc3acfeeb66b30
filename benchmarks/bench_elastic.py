"""Benchmark: elastic membership at cluster scale, by simulation on a real store.

A Kimi-K2-shaped group (the tensors, 256 trainer ranks and 128 inference ranks of
``benchmarks/bench_plan.py``) registers in a real store -- an etcd server started here
(Debian's etcd-server) or any ``--store`` URL -- through :class:`tensorxfer.sync.membership.Membership`,
exactly as ``WeightSync`` ranks do; then:

- **form**: source 0 forms the group (step 0);
- **plan per rank**: ``--plan-ranks`` ranks (sources and targets spread over the group), each in a
  fresh process, read the step record and every member's description from the store, decode, plan
  their part (``plan(..., scope=(role, rank))``, as ``WeightSync`` does) and publish their digest;
  their times, and whether all digests agree;
- **steady step**: every rank reports a step and one source decides the next (the store traffic of
  one step when nobody joins or leaves);
- **join / leave**: a 129th target registers (a replica of TP rank 0) and the next step plans it in;
  then it leaves and the next step plans it out: time from the decision to the new plan of source 0's
  part (descriptions already read are cached; only the newcomer's is read).

Store traffic is counted at the rendezvous interface (requests, keys, value bytes written and read).

    python benchmarks/bench_elastic.py                       # full scale, etcd started here
    python benchmarks/bench_elastic.py --store tcpstore                # a TCPStore hosted by this process
    python benchmarks/bench_elastic.py --layers 4 --experts 16 --sources 16 --targets 8 --ep 8 --plan-ranks 2
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import bench_plan  # noqa: E402
from tensorxfer.sync import RankSpec, plan  # noqa: E402
from tensorxfer.sync.membership import Membership, StepRecord  # noqa: E402
from tensorxfer.sync.rendezvous import Rendezvous, connect  # noqa: E402

GROUP = "kimi"


class Counting(Rendezvous):
    """A rendezvous that counts what passes through it."""

    def __init__(self, inner: Rendezvous) -> None:
        self.inner = inner
        self.has_leases = inner.has_leases
        self.reset()

    def reset(self) -> dict[str, int]:
        old = dict(getattr(self, "counts", {}))
        self.counts = {"requests": 0, "keys_written": 0, "bytes_written": 0, "keys_read": 0, "bytes_read": 0}
        return old

    def _w(self, n: int, nbytes: int) -> None:
        self.counts["requests"] += 1
        self.counts["keys_written"] += n
        self.counts["bytes_written"] += nbytes

    def _r(self, values: Sequence[bytes | None]) -> None:
        self.counts["requests"] += 1
        self.counts["keys_read"] += sum(v is not None for v in values)
        self.counts["bytes_read"] += sum(len(v) for v in values if v is not None)

    def publish(self, key: str, value: bytes) -> None:
        self._w(1, len(value))
        self.inner.publish(key, value)

    def peek(self, keys: Sequence[str]) -> list[bytes | None]:
        out = self.inner.peek(keys)
        self._r(out)
        return out

    def read(self, keys: Sequence[str], timeout: float) -> list[bytes]:
        out = self.inner.read(keys, timeout)
        self._r(out)
        return out

    def has(self, key: str) -> bool:
        self.counts["requests"] += 1
        return self.inner.has(key)

    def publish_many(self, items: dict[str, bytes]) -> None:
        self._w(len(items), sum(map(len, items.values())))
        self.inner.publish_many(items)

    def members_version(self, prefix: str) -> int | None:
        self.counts["requests"] += 1
        return self.inner.members_version(prefix)

    def publish_once(self, key: str, value: bytes) -> bytes:
        self._w(1, len(value))
        return self.inner.publish_once(key, value)

    def join(self, prefix: str, name: str, value: bytes) -> None:
        self._w(1, len(value))
        self.inner.join(prefix, name, value)

    def leave(self, prefix: str, name: str) -> None:
        self._w(1, 0)
        self.inner.leave(prefix, name)

    def evict(self, prefix: str, name: str, value: bytes) -> bool:
        self._w(1, 0)
        return self.inner.evict(prefix, name, value)

    def members(self, prefix: str) -> dict[str, bytes]:
        out = self.inner.members(prefix)
        self._r(list(out.values()))
        return out

    def close(self) -> None:
        self.inner.close()


@contextlib.contextmanager
def store(url: str | None) -> Iterator[str]:
    if url == "tcpstore":       # a TCPStore hosted here (a machine without etcd)
        from tensorxfer.sync.rendezvous import open_tcp_store

        host = open_tcp_store("127.0.0.1", 0, True, timeout=600)
        yield f"tcp://127.0.0.1:{host.port}"
        return
    if url:
        yield url
        return
    from tests.etcd_server import etcd_server

    with tempfile.TemporaryDirectory() as d, etcd_server(Path(d)) as started:
        yield started


def plan_one(url: str, role: str, rank: int) -> dict[str, Any]:
    """What one rank does when it enters the group's first epoch (run in a fresh process)."""
    rdv = Counting(connect(url))
    m = Membership(rdv, GROUP, role, rank, 30.0)
    t0 = time.perf_counter()
    record = m.step_record(0, 60)
    sources, targets, _ = m.specs(record, 60)
    t1 = time.perf_counter()
    p = plan(sources, targets, scope=(role, rank))   # this rank's part, as WeightSync plans
    t2 = time.perf_counter()
    m.publish_digest(record.epoch, p.digest)
    rdv.close()
    return {"role": role, "rank": rank, "read_decode_s": round(t1 - t0, 3), "plan_s": round(t2 - t1, 3),
            "total_s": round(time.perf_counter() - t0, 3), "digest": p.digest, "store": rdv.counts}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench_plan.add_model_arguments(ap)
    ap.add_argument("--store", default=None,
                    help="a store URL, or 'tcpstore' to host a TCPStore here (default: start an etcd server here)")
    ap.add_argument("--plan-ranks", type=int, default=4, help="ranks that plan the first epoch, each in a process")
    ap.add_argument("--every-rank", action="store_true",
                    help="also plan on every rank of the group (each in a process, --jobs at a time)")
    ap.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    ap.add_argument("--plan-one", nargs=3, metavar=("URL", "ROLE", "RANK"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.plan_one:
        print(json.dumps(plan_one(args.plan_one[0], args.plan_one[1], int(args.plan_one[2]))))
        return 0
    bench_plan.check_model_arguments(ap, args)

    wires = [bench_plan.target_template(args.tp, r, args.layers, args.experts).to_wire() for r in range(args.tp)]
    srcs = bench_plan.sources(args.sources, args.shard, args.ep, args.layers, args.experts)
    tgts = [RankSpec.from_wire(dict(wires[r % args.tp], rank=r)) for r in range(args.targets)]
    out: dict[str, Any] = {"benchmark": "sync.elastic", "command": "python benchmarks/bench_elastic.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
        if v not in (None, False) and k != "plan_one").replace(" True", ""),
        "host": platform.node(), "cpus": os.cpu_count(), "sources": args.sources, "targets": args.targets,
        "spec_bytes_total": sum(len(s.to_bytes()) for s in [*srcs, *tgts])}
    with store(args.store) as url:
        out["store"] = url.split(":")[0]
        rdv = Counting(connect(url))
        ranks = {("source", s.rank): Membership(rdv, GROUP, "source", s.rank, 30.0) for s in srcs}
        ranks |= {("target", t.rank): Membership(rdv, GROUP, "target", t.rank, 30.0) for t in tgts}
        t0 = time.perf_counter()
        for spec in srcs:
            ranks["source", spec.rank].register(spec)
        for spec in tgts:
            ranks["target", spec.rank].register(spec, ("10.0.0.1", 20000 + spec.rank))
        out["register_all_s"] = round(time.perf_counter() - t0, 3)
        out["register_store"] = rdv.reset()
        leader = ranks["source", 0]
        t0 = time.perf_counter()
        first = leader.form((args.sources, args.targets), 60)
        out["form_s"] = round(time.perf_counter() - t0, 3)
        out["form_store"] = rdv.reset()

        picks = [("source", 0), ("target", 0), ("source", args.sources - 1), ("target", args.targets - 1),
                 ("source", args.sources // 2), ("target", args.targets // 2)][:args.plan_ranks]
        per_rank = [json.loads(subprocess.run([sys.executable, __file__, "--plan-one", url, role, str(rank)],
                                              check=True, capture_output=True, text=True).stdout)
                    for role, rank in picks]
        out["plan_per_rank"] = [{k: v for k, v in r.items() if k != "digest"} for r in per_rank]
        out["digests_agree"] = len({r["digest"] for r in per_rank}) == 1
        out["epoch1_digest"] = per_rank[0]["digest"]
        if args.every_rank:     # then every rank of the group, --jobs processes at a time (times inflated)
            everyone = [("source", r) for r in range(args.sources)] + [("target", r) for r in range(args.targets)]
            t0 = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
                results = list(pool.map(lambda rr: json.loads(subprocess.run(
                    [sys.executable, __file__, "--plan-one", url, rr[0], str(rr[1])], check=True,
                    capture_output=True, text=True).stdout), everyone))
            totals = sorted(r["total_s"] for r in results)
            out["every_rank"] = {"ranks": len(results), "jobs": args.jobs, "wall_s": round(time.perf_counter() - t0, 1),
                                 "distinct_digests": len({r["digest"] for r in results}),
                                 "same_as_sampled": {r["digest"] for r in results} == {out["epoch1_digest"]},
                                 "total_s_median_under_load": totals[len(totals) // 2],
                                 "total_s_max_under_load": totals[-1]}

        # the leader plans too (it caches every description from now on)
        t0 = time.perf_counter()
        s_specs, t_specs, _ = leader.specs(first, 60)
        plan(s_specs, t_specs, scope=("source", 0))
        out["leader_plan_s"] = round(time.perf_counter() - t0, 3)
        rdv.reset()

        def step(n: int, prev: StepRecord) -> tuple[StepRecord, dict[str, int], float]:
            """Every member reports step n-1 (if n > 1); the leader decides step n; every other member
            reads the record."""
            rdv.reset()
            if prev.step > 0:
                for (role, _r), m in ranks.items():
                    if m.uid in (prev.sources if role == "source" else prev.targets).values():
                        m.report(prev.step, True, prev.step, {})
            t = time.perf_counter()
            record = leader.decide(n, prev)
            decided = time.perf_counter() - t
            for (role, _r), m in ranks.items():
                if m is not leader and m.uid in (record.sources if role == "source" else record.targets).values():
                    rdv.peek([m.key("step", n)])
            return record, rdv.reset(), decided

        r1, _, _ = step(1, first)
        r2, steady, decide_s = step(2, r1)
        assert r2.epoch == first.epoch
        out["steady_step_store"] = steady
        out["steady_decide_s"] = round(decide_s, 3)

        def replan(record: StepRecord) -> float:
            t = time.perf_counter()
            s, tg, _ = leader.specs(record, 60)
            plan(s, tg, scope=("source", 0))
            return time.perf_counter() - t

        joiner = Membership(rdv, GROUP, "target", args.targets, 30.0)
        ranks["target", args.targets] = joiner
        joiner.register(RankSpec.from_wire(dict(wires[0], rank=args.targets)), ("10.0.0.2", 20000))
        r3, join_store, decide_s = step(3, r2)
        assert r3.epoch == r2.epoch + 1 and args.targets in r3.targets
        out["join"] = {"decide_s": round(decide_s, 3), "replan_s": round(replan(r3), 3), "store": join_store}
        joiner.leave()
        r4, leave_store, decide_s = step(4, r3)
        assert r4.epoch == r3.epoch + 1 and args.targets not in r4.targets
        out["leave"] = {"decide_s": round(decide_s, 3), "replan_s": round(replan(r4), 3), "store": leave_store}
        rdv.close()
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
