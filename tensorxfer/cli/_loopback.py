"""A receiver in a child process, for ``tensorxfer demo`` and ``tensorxfer-bench``.

The parent starts ``python -m tensorxfer.cli._loopback ...``; the child binds
a :class:`~tensorxfer.Receiver` on 127.0.0.1, prints ``PORT <n>`` on stdout,
receives ``--count`` transfers and prints one JSON line per transfer (its
:class:`~tensorxfer.TransferStats` plus an xxh3 digest of every tensor when
``--digest`` is given, so the parent can check the bytes without shipping
them back).  Errors are printed as ``ERROR <type>: <message>`` with exit 1.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import IO, Any


def start(count: int, *, digest: bool = False, stall_timeout: float = 60.0,
          device: str = "cpu") -> tuple[subprocess.Popen, int]:
    """Start a receiver child; returns the process and its port.

    Raises
    ------
    RuntimeError
        The child did not start (its stderr is in the message).
    """
    cmd = [sys.executable, "-m", "tensorxfer.cli._loopback", "--count", str(count),
           "--stall-timeout", str(stall_timeout), "--device", device] + (["--digest"] if digest else [])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("PORT "):
        proc.kill()
        _, err = proc.communicate()
        raise RuntimeError(f"receiver process did not start: {line.strip()} {err.strip()}")
    return proc, int(line.split()[1])


def results(proc: subprocess.Popen, timeout: float = 600.0) -> list[dict[str, Any]]:
    """Wait for the child and return its per-transfer JSON records.

    Raises
    ------
    RuntimeError
        The child failed (its error line is in the message).
    """
    out, err = proc.communicate(timeout=timeout)
    records, errors = [], []
    for line in out.splitlines():
        if line.startswith("{"):
            records.append(json.loads(line))
        elif line.startswith("ERROR"):
            errors.append(line)
    if proc.returncode != 0 or errors:
        raise RuntimeError(f"receiver process failed (exit {proc.returncode}): {' '.join(errors)} {err.strip()}")
    return records


def _child(argv: list[str] | None = None, stdout: IO[str] = sys.stdout) -> int:
    from tensorxfer import Receiver, TensorXferError
    from tensorxfer.checksum import tensor_checksums

    p = argparse.ArgumentParser()
    p.add_argument("--count", type=int, default=1)
    p.add_argument("--digest", action="store_true")
    p.add_argument("--stall-timeout", type=float, default=60.0)
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    try:
        with Receiver("127.0.0.1:0", stall_timeout=args.stall_timeout, device=args.device) as rx:
            print(f"PORT {rx.address[1]}", file=stdout, flush=True)
            for _ in range(args.count):
                region = rx.receive(timeout=120)
                assert rx.last_stats is not None
                record = rx.last_stats.as_dict()
                if args.digest:
                    record["digests"] = tensor_checksums(region)
                print(json.dumps(record), file=stdout, flush=True)
    except TensorXferError as e:
        print(f"ERROR {type(e).__name__}: {e}", file=stdout, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(_child())
