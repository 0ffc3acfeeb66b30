"""The CLI end to end on one host, per transport, against ``cp -r`` + ``sync`` and its floors, same runs.

A model directory of ``--size`` bytes in ``--files`` safetensors shards (bf16 tensors of random bytes, and a
config.json) is sent with ``tensorxfer-send DIR --to`` to ``tensorxfer-recv --out DIR --once`` over
loopback, from the start of the send command to the exit of both, each a separate pair of processes:
with the default transport (``auto``: ipc on one host), ``--transport tcp`` and ``--transport ipc``
(``--transports`` picks).  Beside them, in every round: ``cp -r DIR OUT && sync`` (what a user would do
on one host; ``sync`` flushes the whole machine, so other writers' dirty pages count too) and the
floors, each on the same bytes:

- ``read``: ``cat`` of the files to /dev/null (the page cache is warm for every measurement: the model was
  just written, and the CLI runs read it again);
- ``wire``: one warm transfer of a region of the same size between a Sender and a Receiver (tcp, loopback,
  two processes' worth of work in one: the 1-to-1 wire time);
- ``write``: ``dd if=/dev/zero of=OUT bs=16M conv=fsync`` of the same bytes into the output's filesystem.

The goals: the default transport within 1.3x of ``cp -r`` + ``sync`` (issue 38), and end to end within
1.3x of the slowest floor (the work overlaps: reading with sending on the sender, writing with receiving
on the receiver; fsync and rename at the end).  The sum of the floors is what doing them one after another
would cost.  Each round records the 1-minute load average before and after it (the machine may be
shared).  Writes ``cli-<UTC>.json`` under ``--out``::

    python3 benchmarks/bench_cli.py --size 2e9 --files 8 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import compileall
import datetime as dt
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import tensorxfer as tx  # noqa: E402
from tensorxfer.cli.bench import machine_facts  # noqa: E402


def make_model(d: Path, size: float, files: int) -> int:
    from safetensors.numpy import save_file

    d.mkdir(parents=True)
    per = int(size) // files
    rng = np.random.default_rng(0)
    for i in range(files):
        tensors, left, k = {}, per, 0
        while left > 0:
            n = min(left, 64 << 20)
            tensors[f"layers.{i}.w{k}"] = rng.integers(0, 1 << 16, n // 2, dtype=np.uint16).view(np.uint16)
            left -= n
            k += 1
        save_file(tensors, str(d / f"model-{i + 1:05d}-of-{files:05d}.safetensors"))
    (d / "config.json").write_text('{"model_type": "llama"}')
    return sum(p.stat().st_size for p in d.iterdir())


def timed(cmd: list[str], **kw: Any) -> float:
    t = time.perf_counter()
    subprocess.run(cmd, check=True, **kw)
    return time.perf_counter() - t


def read_floor(d: Path) -> float:
    files = sorted(str(p) for p in d.iterdir())
    with open(os.devnull, "wb") as null:
        return timed(["cat", *files], stdout=null)


def write_floor(where: Path, nbytes: int) -> float:
    target = where / "dd.bin"
    try:
        return timed(["dd", "if=/dev/zero", f"of={target}", "bs=16M", f"count={-(-nbytes // (16 << 20))}",
                      "conv=fsync", "status=none"])
    finally:
        target.unlink(missing_ok=True)


def wire_floor(nbytes: int, repeat: int) -> float:
    m = tx.Manifest.layout([("x", "U8", (nbytes,))])
    with tx.TensorRegion.from_manifest(m) as region, tx.Receiver(stall_timeout=300) as rx:
        got = threading.Thread(target=lambda: [rx.receive(timeout=300) for _ in range(repeat + 1)])
        got.start()
        with tx.Sender("{}:{}".format(*rx.address), transport="tcp", stall_timeout=300) as s:
            runs = [s.send(region).seconds for _ in range(repeat + 1)]
        got.join()
    return statistics.median(runs[1:])


def cp_sync(model: Path, out: Path) -> float:
    """``cp -r`` of the model directory and ``sync``: one host's copy, on disk when it returns."""
    try:
        return timed(["sh", "-c", 'cp -r "$0" "$1" && sync', str(model), str(out)])
    finally:
        shutil.rmtree(out, ignore_errors=True)


def cli_once(model: Path, out: Path, transport: str = "tcp") -> tuple[float, dict[str, Any]]:
    """One send of ``model`` to a fresh ``tensorxfer-recv --out out --once``, two processes;
    ``transport`` ``"auto"`` passes no ``--transport`` (the default)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    recv = subprocess.Popen([sys.executable, "-m", "tensorxfer.cli.recv", "--out", str(out), "--once", "--json",
                             "--listen", "127.0.0.1:0"], stdout=subprocess.PIPE, text=True, env=env)
    assert recv.stdout is not None
    listening = json.loads(recv.stdout.readline())
    where = f"{listening['host']}:{listening['port']}"
    t = time.perf_counter()
    forced = [] if transport == "auto" else ["--transport", transport]
    send = subprocess.run([sys.executable, "-m", "tensorxfer.cli.send", str(model), "--to", where, "--json",
                           *forced], capture_output=True, text=True, env=env)
    rest = recv.communicate(timeout=600)[0]
    seconds = time.perf_counter() - t
    if send.returncode or recv.returncode:
        raise RuntimeError(f"send {send.returncode}: {send.stderr[-2000:]}; recv {recv.returncode}")
    received = next(r for r in map(json.loads, rest.splitlines()) if r.get("event") == "received")
    return seconds, {"sent": json.loads(send.stdout.splitlines()[-1]), "received": received}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=float, default=2e9)
    p.add_argument("--files", type=int, default=8)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--tmp", default=None, help="where the model and the output go (default: the temp dir)")
    p.add_argument("--no-compile", action="store_true",
                   help="do not byte-compile the package first (each CLI process then compiles what it imports)")
    p.add_argument("--transports", default="auto,tcp,ipc",
                   help="the CLI runs of each round, in order (auto: no --transport flag; default auto,tcp,ipc)")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = p.parse_args(argv)
    if not args.no_compile:
        # As a pip install leaves it: with PYTHONDONTWRITEBYTECODE=1 (this sandbox sets it) every CLI process
        # compiles the ~100 modules it imports, measured on the dev VM: `tensorxfer-send --help` 0.9-1.3 s
        # that way, 0.33 s byte-compiled -- twice per transfer, more than cp -r takes for the 2 GB here.
        compileall.compile_dir(str(ROOT / "tensorxfer"), quiet=1)
    work = Path(tempfile.mkdtemp(prefix="tensorxfer-bench-cli-", dir=args.tmp))
    try:
        model = work / "model"
        file_bytes = make_model(model, args.size, args.files)
        rounds = []
        transports = [t.strip() for t in args.transports.split(",") if t.strip()]
        for r in range(args.repeat):
            row: dict[str, Any] = {"load_before": os.getloadavg()[0], "read_s": read_floor(model)}
            for transport in transports:
                out = work / f"out{r}-{transport}"
                row[f"cli_{transport}_s"], records = cli_once(model, out, transport)
                row[f"cli_{transport}_transport"] = records["sent"].get("transport")
                row[f"cli_{transport}_sender_read"] = records["sent"].get("read")    # mapped | passed | while sending
                row[f"cli_{transport}_written_while_landing"] = records["received"].get("written_while_landing")
                # where the time went: offer to ack (the rest of cli_s is two processes starting, reading
                # headers, connecting, exiting), of it setting up and the data phase (the copy; the receiver's
                # last writes, fsync and renames come after it)
                for key in ("seconds", "setup_seconds", "wire_seconds"):
                    row[f"cli_{transport}_sender_{key}"] = records["sent"].get(key)
                shutil.rmtree(out)
            row["cp_sync_s"] = cp_sync(model, work / f"cp{r}")
            row["write_s"] = write_floor(work, file_bytes)
            row["wire_s"] = wire_floor(file_bytes, 2)
            row["cli_s"] = row[f"cli_{transports[0]}_s"]
            row["cli_over_cp_sync"] = row["cli_s"] / row["cp_sync_s"]
            row["slowest_floor_s"] = max(row["read_s"], row["wire_s"], row["write_s"])
            row["cli_over_slowest_floor"] = row["cli_s"] / row["slowest_floor_s"]
            row["sum_of_floors_s"] = row["read_s"] + row["wire_s"] + row["write_s"]
            row["load_after"] = os.getloadavg()[0]
            print(json.dumps(row), flush=True)
            rounds.append(row)
        ratio = statistics.median(r["cli_over_slowest_floor"] for r in rounds)
        result = {"file_bytes": file_bytes, "files": args.files, "transports": transports, "rounds": rounds,
                  "median_cli_s": statistics.median(r["cli_s"] for r in rounds),
                  "median_cli_over_slowest_floor": ratio,
                  "median_cli_over_cp_sync": statistics.median(r["cli_over_cp_sync"] for r in rounds),
                  **{f"median_cli_{t}_s": statistics.median(r[f"cli_{t}_s"] for r in rounds) for t in transports},
                  "median_cp_sync_s": statistics.median(r["cp_sync_s"] for r in rounds),
                  "median_dd_fsync_s": statistics.median(r["write_s"] for r in rounds),
                  "last_records": records}
        print(f"{transports[0]} / cp -r + sync: {result['median_cli_over_cp_sync']:.2f} (goal <= 1.3)", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    doc = {"command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
           "byte_compiled": not args.no_compile,
           "date": dt.datetime.now(dt.timezone.utc).isoformat(), "machine": machine_facts(), "result": result}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"cli-{dt.datetime.now(dt.timezone.utc).strftime('%Y%m%dT%H%MZ')}.json"
    path.write_text(json.dumps(doc, indent=1))
    print("wrote", path, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
