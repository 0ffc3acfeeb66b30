"""The ipc transport against a plain copy of the same bytes, in the same run.

Host (default): a sender here and a receiver in a child process move a
``--size`` region over ipc (copy mode: the receiver maps the sender's memfds
read-only and copies into its own region); the reference is ``numpy.copyto``
of the same number of bytes into a preallocated, already-touched buffer, split
over as many threads as the receiver copies with (since 2026-12-05; before,
one thread, which is still printed).  ``--device cuda:0``: both regions on the GPU; the
reference is ``torch`` ``dst.copy_(src)`` of the same bytes on the same
device.  Each mode: one cold transfer (the receiver allocates), then
``--repeat`` warm ones in one session (median); share mode is timed too
(the receiver maps the sender's memory instead of copying; informative).

Writes ``<out>/ipc-<device>-<UTC date>.json`` (exact command, machine facts,
every run) and prints a short table last.  Unattended: no prompts; exits 0
when it measured, 2 when something needed is missing (said on stderr).

    .venv/bin/python benchmarks/bench_ipc.py --size 2e9
    python3 benchmarks/bench_ipc.py --device cuda:0 --size 31.2e9 --out $OUT
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tensorxfer import Manifest, Receiver, Sender, TensorRegion  # noqa: E402
from tensorxfer.cli.bench import machine_facts  # noqa: E402
from tensorxfer.transport import ipc  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def receiver_main(device: str, count: int, share: bool) -> int:
    with Receiver(device=device, share=share, stall_timeout=300) as rx:
        print("{}:{}".format(*rx.address), flush=True)
        for _ in range(count):
            r = rx.receive(timeout=600)
            del r
    return 0


def start_receiver(device: str, count: int, share: bool, threads: int | None = None) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--role", "receiver", "--device", device,
           "--count", str(count)] + (["--share"] if share else [])
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if threads:
        env["TENSORXFER_IPC_THREADS"] = str(threads)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if not line:
        proc.wait(timeout=60)
        raise RuntimeError(f"receiver child exited with {proc.returncode} before listening")
    return proc, line


def fill(region: TensorRegion) -> None:
    if region.is_cuda:
        copier = region._get_copier()
        copier.memset(region.region.ptr, region.nbytes, 0x5A)
        copier.synchronize()
        return
    block = np.random.default_rng(0).integers(0, 256, size=1 << 20, dtype=np.uint8)
    view = np.frombuffer(region.region, dtype=np.uint8, count=region.nbytes)
    for off in range(0, view.size, block.size):
        n = min(block.size, view.size - off)
        view[off:off + n] = block[:n]
    del view


def time_ipc(region: TensorRegion, device: str, repeat: int, share: bool, threads: int | None = None) -> dict[str, Any]:
    proc, where = start_receiver(device, repeat + 1, share, threads)
    try:
        with Sender(where, transport="ipc", stall_timeout=300) as s:
            stats = [s.send(region) for _ in range(repeat + 1)]
        runs = [st.seconds for st in stats]
        if proc.wait(timeout=120) != 0:
            raise RuntimeError(f"receiver child failed with {proc.returncode}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    warm = runs[1:]
    return {"cold_s": runs[0], "runs_s": warm, "median_s": statistics.median(warm),
            "cold_setup_s": stats[0].setup_seconds,
            "warm_wire_median_s": statistics.median(st.wire_seconds for st in stats[1:]),
            "warm_setup": [st.setup for st in stats[1:]], "counters_after": dict(stats[-1].counters)}


def time_host_memcpy(nbytes: int, repeat: int, threads: int = 1) -> dict[str, Any]:
    """``numpy.copyto`` of ``nbytes`` between warm buffers, split into ``threads`` equal parts copied at once
    (each in its own thread; numpy releases the GIL).  Parts of 192 MB or more are what glibc streams past
    the caches on the dev VM; smaller ones it copies with ``rep movsb``, at about half the speed there."""
    import threading

    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)          # first touch outside the timing, like the receiver's warm region
    bounds = [nbytes * k // threads for k in range(threads + 1)]
    parts = [(dst[a:b], src[a:b]) for a, b in itertools.pairwise(bounds)]
    runs = []
    for _ in range(repeat):
        workers = [threading.Thread(target=np.copyto, args=part) for part in parts[1:]]
        t = time.perf_counter()
        for w in workers:
            w.start()
        np.copyto(*parts[0])
        for w in workers:
            w.join()
        runs.append(time.perf_counter() - t)
    del src, dst, parts
    return {"runs_s": runs, "median_s": statistics.median(runs),
            "what": f"numpy.copyto, {threads} thread{'s' if threads > 1 else ''}"}


def time_torch_copy(nbytes: int, device: str, repeat: int, dst_device: str | None = None) -> dict[str, Any]:
    import torch

    src = torch.full((nbytes,), 0x5A, dtype=torch.uint8, device=device)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dst_device or device)   # another GPU: a P2P copy
    dst.copy_(src)
    torch.cuda.synchronize()
    runs = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        runs.append(time.perf_counter() - t)
    del src, dst
    torch.cuda.empty_cache()
    return {"runs_s": runs, "median_s": statistics.median(runs), "what": "torch dst.copy_(src) + synchronize",
            "torch": torch.__version__}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=float, default=2e9, help="payload bytes (default 2e9; fits a 24 GiB machine)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda:N")
    p.add_argument("--receiver-device", default=None,
                   help="where the receiver's region lives (default: --device); cuda:1 with --device cuda:0 "
                        "measures GPU 0 -> GPU 1 over NVLink/P2P against torch's cuda:0 -> cuda:1 copy")
    p.add_argument("--repeat", type=int, default=5, help="warm transfers / reference copies (median)")
    p.add_argument("--no-share", action="store_true", help="skip the share-mode timing")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--role", default="bench", choices=["bench", "receiver"], help=argparse.SUPPRESS)
    p.add_argument("--count", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--share", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.role == "receiver":
        return receiver_main(args.device, args.count, args.share)
    rx_device = args.receiver_device or args.device

    reason = ipc.IpcSender.available()
    if reason:
        print(f"ipc cannot run here: {reason}", file=sys.stderr)
        return 2
    cuda = args.device.startswith("cuda")
    if cuda:
        try:
            import torch
            if not torch.cuda.is_available():
                raise ImportError("torch sees no GPU")
        except ImportError as e:
            print(f"--device {args.device} needs torch with CUDA for the reference copy: {e}", file=sys.stderr)
            return 2
    nbytes = int(args.size)
    facts = machine_facts()
    if cuda:
        import torch

        props = torch.cuda.get_device_properties(torch.device(args.device))
        facts.update(gpu=props.name, gpu_memory_bytes=props.total_memory, torch=torch.__version__)
    print(f"ipc benchmark: {nbytes / 1e9:.2f} GB on {args.device}, {args.repeat} warm runs; "
          f"host copy threads {ipc.COPY_THREADS}", flush=True)

    # host: the reference copies with as many threads as the receiver (and, informative, with one)
    ref_before = (time_torch_copy(nbytes, args.device, args.repeat, rx_device) if cuda
                  else time_host_memcpy(nbytes, args.repeat, ipc.COPY_THREADS))
    ref1_before = None if cuda or ipc.COPY_THREADS == 1 else time_host_memcpy(nbytes, args.repeat)
    region = TensorRegion.from_manifest(Manifest.layout([("w", "U8", (nbytes,))]), device=args.device)
    try:
        fill(region)
        copy = time_ipc(region, rx_device, args.repeat, share=False)
        copy1 = None if cuda or ipc.COPY_THREADS == 1 else time_ipc(region, rx_device, args.repeat, False, 1)
        share = None if args.no_share else time_ipc(region, rx_device, args.repeat, share=True)
    finally:
        region.close()
    ref_after = (time_torch_copy(nbytes, args.device, args.repeat, rx_device) if cuda
                 else time_host_memcpy(nbytes, args.repeat, ipc.COPY_THREADS))
    ref1_after = None if ref1_before is None else time_host_memcpy(nbytes, args.repeat)
    ref_s = statistics.median(ref_before["runs_s"] + ref_after["runs_s"])
    ref1_s = None if ref1_before is None or ref1_after is None else \
        statistics.median(ref1_before["runs_s"] + ref1_after["runs_s"])
    goal = 0.9 if cuda else 0.8

    def gbs(seconds: float) -> float:
        return nbytes / seconds / 1e9

    result = {
        "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable, *sys.argv]),
        "machine": facts,
        "device": args.device,
        "receiver_device": rx_device,
        "bytes": nbytes,
        "copy_threads": None if cuda else ipc.COPY_THREADS,
        "reference": {"before": ref_before, "after": ref_after, "median_s": ref_s, "GBps": gbs(ref_s)},
        "reference_1_thread": None if ref1_s is None else {"before": ref1_before, "after": ref1_after,
                                                           "median_s": ref1_s, "GBps": gbs(ref1_s)},
        "ipc_copy": {**copy, "GBps": gbs(copy["median_s"]), "cold_GBps": gbs(copy["cold_s"])},
        "ipc_copy_1_thread": None if copy1 is None else {**copy1, "GBps": gbs(copy1["median_s"]),
                                                         "ratio": ref_s / copy1["median_s"]},
        "ipc_share": None if share is None else {**share, "GBps": gbs(share["median_s"])},
        "ratio": ref_s / copy["median_s"],
        "goal": goal,
        "note": "ipc seconds are the sender's offer-to-ack time (control frames, handle passing, mapping, copy, "
                "ack); the reference is the bare copy of the same bytes",
    }
    args.out.mkdir(parents=True, exist_ok=True)
    kind = "cuda" if cuda else "host"
    threads = 1 if cuda else ipc.COPY_THREADS
    path = args.out / f"ipc-{kind}-{dt.datetime.now(dt.timezone.utc):%Y-%m-%dT%H%MZ}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
    print()
    print(f"{'what':<34}{'median s':>10}{'GB/s':>9}")
    print(f"{result['reference']['before']['what']:<34}{ref_s:>10.4f}{gbs(ref_s):>9.2f}")
    if ref1_s is not None:
        print(f"{'numpy.copyto, 1 thread':<34}{ref1_s:>10.4f}{gbs(ref1_s):>9.2f}")
    print(f"{f'ipc copy, {threads} copy threads (warm)':<34}{copy['median_s']:>10.4f}{gbs(copy['median_s']):>9.2f}")
    if copy1 is not None:
        print(f"{'ipc copy, 1 copy thread (warm)':<34}{copy1['median_s']:>10.4f}{gbs(copy1['median_s']):>9.2f}")
    print(f"{'ipc copy (cold: receiver allocates)':<34}{copy['cold_s']:>10.4f}{gbs(copy['cold_s']):>9.2f}")
    if share is not None:
        print(f"{'ipc share (warm: region reused)':<34}{share['median_s']:>10.4f}{gbs(share['median_s']):>9.2f}")
    print(f"ratio ipc/reference = {result['ratio']:.2f} (goal >= {goal})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
