"""Fan-out by chain pipelining: one update to N receivers, as a ratio to N = 1 in the same run.

Starts max(N) receiver processes (``tests/fanout_peer.py``: a ``Receiver`` with a token, looping on
``receive()``), then for each N in ``--receivers`` opens a :class:`~tensorxfer.fanout.FanoutSender` to the
first N of them (tcp, default streams), sends one warm-up update (sessions set up, regions allocated), then
``--repeat`` timed updates of the same region (median).  Rounds interleave the N values so drift on a shared
machine hits them alike.  The ratio compares each N's median to N = 1's median in the same round; "naive" is
N x the N = 1 time (N transfers from the sender, what the chain avoids).

Two regimes: plain loopback (every hop's kernel copies share this machine's CPUs, so on a 2-core box the
hops compete for the same cores: a CPU bound, not what a chain of machines sees), and ``--link-gbps G``:
every tcp data socket's sending rate is capped (``SO_MAX_PACING_RATE``, per process, nothing global) so
each hop behaves like its own G Gbit/s link -- the regime fan-out is for (the sender's one NIC is the
bottleneck).  Store-and-forward or N sends would take N x there; the chain should take one transfer plus
(N-1) pieces.

Writes ``benchmarks/results/fanout-<regime>-<UTC time>.json`` with the exact command, machine facts and every run.
Not a timed test: run it by hand::

    .venv/bin/python benchmarks/bench_fanout.py --size 1e9 --receivers 1 2 4 8 --repeat 3 --rounds 2
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import tensorxfer as tx
from tensorxfer.cli.bench import machine_facts
from tensorxfer.fanout import FanoutSender
from tensorxfer.transport.tcp import DEFAULT_STREAMS, FORWARD_PIECE_BYTES, PIECE_BYTES

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"
TOKEN = "bench-fanout"


def start_peers(n: int, stall: float, pacing: int) -> list[tuple[subprocess.Popen, str]]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    peers = []
    for _ in range(n):
        peer = [sys.executable, str(ROOT / "tests" / "fanout_peer.py"), TOKEN, str(stall), "0", str(pacing)]
        proc = subprocess.Popen(peer,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        assert proc.stdout is not None
        peers.append((proc, json.loads(proc.stdout.readline())["address"]))
    return peers


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=float, default=1e9, help="region bytes per update (default 1e9)")
    p.add_argument("--tensors", type=int, default=64)
    p.add_argument("--receivers", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--repeat", type=int, default=3, help="timed updates per N per round (after one warm-up)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--verify", action="store_true")
    p.add_argument("--link-gbps", type=float, default=0.0,
                   help="emulate one link of this speed per hop: every tcp data socket's sending rate is capped "
                        "at link/streams (SO_MAX_PACING_RATE); 0 (default): loopback as fast as the CPUs go")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    size = int(args.size) // args.tensors * args.tensors
    rng = np.random.default_rng(0)
    tensors = {f"t{i}": rng.integers(0, 255, size // args.tensors, dtype=np.uint8) for i in range(args.tensors)}
    pacing = int(args.link_gbps * 1e9 / 8 / DEFAULT_STREAMS) if args.link_gbps else 0
    if pacing:
        sys.path.insert(0, str(ROOT / "tests"))
        from fanout_peer import pace_tcp_streams

        pace_tcp_streams(pacing)
    peers = start_peers(max(args.receivers), stall=60.0, pacing=pacing)
    rows: list[dict] = []
    try:
        with tx.TensorRegion.from_tensors(tensors) as region:
            for rnd in range(args.rounds):
                for n in args.receivers:
                    with FanoutSender([a for _, a in peers[:n]], token=TOKEN, transport="tcp",
                                      stall_timeout=60.0) as fan:
                        warm = fan.send(region, verify=args.verify)
                        assert warm.ok, warm.failed
                        runs = []
                        for _ in range(args.repeat):
                            t0 = time.perf_counter()
                            st = fan.send(region, verify=args.verify)
                            runs.append(time.perf_counter() - t0)
                            assert st.ok, st.failed
                    med = statistics.median(runs)
                    rows.append({"round": rnd, "receivers": n, "seconds_median": med, "runs": runs,
                                 "warmup_seconds": warm.seconds, "gbps_per_receiver": size * 8 / med / 1e9,
                                 "chain": list(st.chain)})
                    print(f"round {rnd}: N={n}: median {med:.3f} s ({size * 8 / med / 1e9:.2f} Gbps to each), "
                          f"runs {', '.join(f'{r:.3f}' for r in runs)}", flush=True)
    finally:
        for proc, _ in peers:
            proc.kill()
            proc.wait()
    for row in rows:
        base = next(r for r in rows if r["round"] == row["round"] and r["receivers"] == 1)["seconds_median"]
        row["ratio_to_n1"] = row["seconds_median"] / base
        row["ratio_to_naive"] = row["seconds_median"] / (base * row["receivers"])
    summary = {}
    for n in args.receivers:
        ratios = [r["ratio_to_n1"] for r in rows if r["receivers"] == n]
        summary[str(n)] = {"ratio_to_n1_median": statistics.median(ratios), "ratios": ratios}
        print(f"N={n}: {statistics.median(ratios):.2f} x the N=1 time (naive: {n} x)")
    record = {
        "benchmark": "fanout-chain-tcp",
        "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
        "utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_facts(),
        "link_gbps": args.link_gbps, "pacing_bytes_per_s_per_stream": pacing,
        "bytes": size, "tensors": args.tensors, "verify": args.verify, "transport": "tcp",
        "streams": DEFAULT_STREAMS, "piece_bytes": PIECE_BYTES, "forward_piece_bytes": FORWARD_PIECE_BYTES,
        "goal": "N=4 within 1.25x of N=1",
        "summary": summary, "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    kind = f"link{args.link_gbps:g}g" if args.link_gbps else "loopback"
    path = args.out / f"fanout-{kind}-{dt.datetime.now(dt.timezone.utc).strftime('%Y-%m-%dT%H%MZ')}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
