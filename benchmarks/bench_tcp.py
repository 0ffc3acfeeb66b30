"""tensorxfer's TCP transport over loopback against iperf3 with the same stream counts.

Back to back in one invocation: ``tensorxfer-bench``'s engine (sender here,
receiver in a child process, an 820-tensor synthetic model; one cold
transfer, then per stream count a session of ``--repeat`` warm transfers,
median) and, per stream count, ``iperf3 -c 127.0.0.1 -P <streams> -n <same
bytes>`` (median of ``--iperf-runs`` runs).  Writes ``benchmarks/results/tcp-<UTC date>.json``
(the exact command, machine facts, every run) and a PNG plot of throughput
against streams when matplotlib is installed.

Not a timed test: run it by hand on an idle machine::

    .venv/bin/python benchmarks/bench_tcp.py --size 2e9 --streams 1 2 4 8
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import statistics
import sys
from pathlib import Path

from tensorxfer.cli.bench import iperf3_gbps, machine_facts, memcpy_gbps, run_bench
from tensorxfer.transport.tcp import DEFAULT_STREAMS, PIECE_BYTES, SOCKET_BUFFER_BYTES

RESULTS = Path(__file__).resolve().parent / "results"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=float, default=2e9, help="model bytes per transfer (default 2e9)")
    p.add_argument("--streams", type=int, nargs="+", default=sorted({1, 2, 4, 8, DEFAULT_STREAMS}))
    p.add_argument("--repeat", type=int, default=4, help="tensorxfer transfers per session (first is cold)")
    p.add_argument("--iperf-runs", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1, help="repeat the whole sweep (medians over rounds)")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    size = int(args.size)
    rows = []
    for rnd in range(args.rounds):
        tx = run_bench(size, list(args.streams), args.repeat, verify=False, transport="tcp", quiet=True)
        print(f"round {rnd}: cold transfer {tx['cold']['gbps']:.2f} Gbps (receiver first-touches its region)")
        for streams in args.streams:
            mine = tx["by_streams"][streams]
            ip_runs = []
            for _ in range(args.iperf_runs):
                r = iperf3_gbps(streams, tx["bytes"])
                if r is None:
                    print("iperf3 is not installed: apt-get install iperf3", file=sys.stderr)
                    return 2
                ip_runs.append(r)
            ip = statistics.median(r["gbps"] for r in ip_runs)
            runs = ", ".join(f"{r['gbps']:.1f}" for r in mine["runs"])
            rows.append({"round": rnd, "streams": streams, "tensorxfer_gbps": mine["gbps_median"],
                         "tensorxfer_runs": [r["gbps"] for r in mine["runs"]], "tensorxfer_cold_gbps":
                         tx["cold"]["gbps"], "iperf3_gbps": ip, "iperf3_runs": [r["gbps"] for r in ip_runs],
                         "iperf3_command": ip_runs[0]["command"], "ratio": mine["gbps_median"] / ip})
            print(f"round {rnd} streams {streams:2d}: tensorxfer {mine['gbps_median']:6.2f} Gbps (runs {runs}), "
                  f"iperf3 {ip:6.2f} Gbps -> ratio {mine['gbps_median'] / ip:.2f}", flush=True)
    summary = {}
    for streams in args.streams:
        mine = [r for r in rows if r["streams"] == streams]
        summary[str(streams)] = {"tensorxfer_gbps": statistics.median(r["tensorxfer_gbps"] for r in mine),
                                 "iperf3_gbps": statistics.median(r["iperf3_gbps"] for r in mine),
                                 "ratio": statistics.median(r["ratio"] for r in mine)}
    now = dt.datetime.now(dt.timezone.utc)
    record = {
        "date": now.isoformat(timespec="seconds"),
        "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
        "bytes": size, "tensors": 820, "default_streams": DEFAULT_STREAMS, "piece_bytes": PIECE_BYTES,
        "socket_buffer_bytes": SOCKET_BUFFER_BYTES or "kernel autotuning",
        "memcpy_gbps_1thread": memcpy_gbps(), "machine": machine_facts(),
        "summary_by_streams": summary, "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"tcp-{now:%Y-%m-%dT%H%M}Z"
    stem.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {stem.with_suffix('.json')}")
    for s in ("1", str(DEFAULT_STREAMS)):
        if s in summary:
            print(f"ratio tensorxfer/iperf3 at {s} stream(s): {summary[s]['ratio']:.2f} "
                  f"({summary[s]['tensorxfer_gbps']:.2f} vs {summary[s]['iperf3_gbps']:.2f} Gbps)")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return 0
    xs = [int(s) for s in summary]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(xs, [summary[str(x)]["tensorxfer_gbps"] for x in xs], "o-", label="tensorxfer tcp")
    ax.plot(xs, [summary[str(x)]["iperf3_gbps"] for x in xs], "s--", label="iperf3")
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("parallel TCP streams")
    ax.set_ylabel("Gbit/s (loopback)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"{size / 1e9:.1f} GB, 820 tensors, {record['machine'].get('cpus')} CPUs")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(stem.with_suffix(".png"), dpi=120)
    print(f"wrote {stem.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
