"""Recovery within one rdma update, measured (issue 40): one Sender/Receiver update of SIZE bytes in which a QP
is moved to the error state for real (``ibv_modify_qp`` to ``IBV_QPS_ERR``, ``rdma_engine.Fault``) once a
chosen fraction of the bytes landed, on the sender's side or the receiver's, against the same update without a
cut, with recovery on (a mark on every request) and off (no marks: today's wire).

    PYTHONPATH=. python benchmarks/bench_resume_rdma.py --mib 1024 --cut 0.55 --rounds 2 --out runs.jsonl

Needs an RDMA device (the Soft-RoCE VM: ``.ci/rxe-vm.sh run ...``).  Both ends run in this process (the
receiver in a thread).  Prints (and appends to ``--out``) one JSON line per run: the sender's stats (seconds,
wire_seconds, retries, resent_bytes, recovery_seconds), the receiver's (update, retries, recovery_seconds),
and, for a cut, what the sender had in flight when it broke (``in_flight``: requests posted and not known
completed, in bytes; ``posted``) -- the issue's bound is resent_bytes < 1.2 x in_flight.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tensorxfer import Receiver, Sender  # noqa: E402
from tensorxfer.session.recovery import DEFAULT_POLICY  # noqa: E402
from tensorxfer.transport import rdma_engine  # noqa: E402
from tests.helpers import Background  # noqa: E402
from tests.test_rdma_resume import region, same  # noqa: E402


class Breaks(logging.Handler):
    """Collects the sender's break records (``rdma_break``: in flight and posted bytes at the break)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen: list[dict] = []

    def emit(self, record: logging.LogRecord) -> None:
        info = getattr(record, "rdma_break", None)
        if info is not None:
            self.seen.append(info)


def one(src, nbytes: int, cut: float | None, side: str, recovery: bool, breaks: Breaks) -> dict:
    breaks.seen.clear()
    fault = rdma_engine.Fault(side, int(nbytes * cut), qp=1) if cut else None
    rdma_engine._FAULT = fault
    policy = DEFAULT_POLICY if recovery else None
    try:
        with Receiver(stall_timeout=30, recovery=policy) as rx:
            job = Background(rx.receive, timeout=600)
            with Sender("{}:{}".format(*rx.address), transport="rdma", streams=4, stall_timeout=30,
                        recovery=policy) as s:
                t0 = time.perf_counter()
                st = s.send(src)
                wall = time.perf_counter() - t0
            got = job.result(timeout=600)
            rs = rx.last_stats
            assert rs is not None
            row = {"bytes": nbytes, "recovery": recovery, "cut": cut, "side": side if cut else None,
                   "fired_at": fault.fired if fault else [], "identical": same(src, got),
                   "sender_seconds": round(wall, 3), "wire_seconds": round(st.wire_seconds, 3),
                   "retries": st.retries, "resent_bytes": st.resent_bytes,
                   "sender_recovery_seconds": round(st.recovery_seconds, 3), "receiver_update": rs.update,
                   "receiver_retries": rs.retries, "receiver_recovery_seconds": round(rs.recovery_seconds, 3),
                   "counters": dict(st.counters), "breaks": list(breaks.seen)}
            if breaks.seen:
                row["in_flight"] = breaks.seen[0]["in_flight"]
                row["resent_over_in_flight"] = round(st.resent_bytes / max(1, row["in_flight"]), 4)
            return row
    finally:
        rdma_engine._FAULT = None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--cut", type=float, default=0.55)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    breaks = Breaks()
    logging.getLogger("tensorxfer").addHandler(breaks)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    nbytes = args.mib << 20
    with region(nbytes, seed=11) as src:
        for _ in range(args.rounds):
            for cut, side, recovery in ((None, "sender", False), (None, "sender", True), (args.cut, "sender", True),
                                        (args.cut, "receiver", True)):
                row = one(src, src.nbytes, cut, side, recovery, breaks)
                line = json.dumps(row)
                print(line, flush=True)
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(line + "\n")


if __name__ == "__main__":
    main()
