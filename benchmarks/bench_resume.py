"""Recovery within one tcp update, measured: one update of SIZE bytes through a real relay process
(``tests/cutting_relay.py``) that resets a data connection at a chosen fraction of the bytes, against
the same update through the relay without a cut.

    PYTHONPATH=. python benchmarks/bench_resume.py --gib 1 --cut 0.55 --rounds 3

Prints one JSON line per run: the sender's stats (seconds, retries, resent_bytes, recovery_seconds),
the receiver's (retries, recovery_seconds), and the relay's independent count of the data bytes it
carried from the sender (``wire_bytes``; a restart from zero would carry about (1 + cut) x SIZE).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tensorxfer import Receiver  # noqa: E402
from tests.test_resume import SENDER, payload_matches  # noqa: E402


def one(nbytes: int, cut: float | None) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT)
    with Receiver(stall_timeout=10) as rx:
        cuts = str(int(nbytes * cut)) if cut else ""
        relay = subprocess.Popen([sys.executable, "-m", "tests.cutting_relay", "--to", "{}:{}".format(*rx.address),
                                  "--cut", cuts], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT,
                                 env=env)
        assert relay.stdout is not None
        where = relay.stdout.readline().strip()         # the relay's HOST:PORT
        sender = subprocess.Popen([sys.executable, "-c", SENDER, where, str(nbytes), "on", "10"],
                                  stdout=subprocess.PIPE, text=True, env=env)
        t0 = time.perf_counter()
        region = rx.receive(timeout=120)
        out, _ = sender.communicate(timeout=120)
        wall = time.perf_counter() - t0
        relay.send_signal(signal.SIGTERM)
        wire = json.loads(relay.communicate(timeout=10)[0].strip().splitlines()[-1])
        sent = json.loads(out.strip().splitlines()[-1])
        got = rx.last_stats
        assert got is not None
        return {"bytes": nbytes, "cut_at": wire["cuts"], "identical": payload_matches(region), "wall_seconds": wall,
                "sender_seconds": sent["seconds"], "retries": sent["retries"], "resent_bytes": sent["resent_bytes"],
                "sender_recovery_seconds": sent["recovery_seconds"], "receiver_retries": got.retries,
                "receiver_recovery_seconds": got.recovery_seconds, "receiver_update": got.update,
                "wire_bytes": wire["data_bytes"], "wire_ratio": wire["data_bytes"] / nbytes}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--cut", type=float, default=0.55)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    nbytes = int(args.gib * (1 << 30)) // 4096 * 4096
    for _ in range(args.rounds):
        for cut in (None, args.cut):
            print(json.dumps({"cut": cut, **one(nbytes, cut)}), flush=True)


if __name__ == "__main__":
    main()
