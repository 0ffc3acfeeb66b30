"""Weights that live in the region: memory while adopting, and the cost of one training step's push.

``--what memory``: a model of ``--size`` bytes (synthetic, shaped like the reference run) is built as a
torch module on ``--device`` and adopted with ``TensorRegion.from_module``; a thread samples the memory
where it lives every millisecond (the GPU: ``cudaMemGetInfo``, which sees the region's VMM handles that
PyTorch's allocator does not; the host: this process's RSS).  The peak over the baseline is reported
against the model's bytes, beside ``from_tensors`` of the same module (a second copy), and
``torch.cuda.max_memory_allocated`` for reference.

``--what step``: a trainer (here) pushes an adopted ``--size`` model to a receiver process whose own
module is bound to what it receives (``receive(into=module)``), over ``--transport``; the warm per-step
cost of ``sender.send(region)`` is set against one torch ``dst.copy_(src)`` of the same bytes on the same
device, measured in the same run, and against the old step (``update_from`` of separate parameters,
then send).

``--what load``: ``TensorRegion.from_safetensors`` of ``--files`` safetensors files (``--size`` bytes in
all, in the page cache) against ``safetensors.torch.load_file(path, device=...)`` (GPU) or a plain read
of the same files (host), in the same run.

Writes one JSON file under ``--out`` (command, machine facts, every run).  Not a test: run it by hand::

    python3 benchmarks/bench_live.py --what memory --device cuda:0 --size 16e9 --out $OUT
    python3 benchmarks/bench_live.py --what step --device cuda:0 --size 31.2e9 --transport ipc --out $OUT
    python3 benchmarks/bench_live.py --what load --device cuda:0 --size 16e9 --files 8 --out $OUT
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
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import tensorxfer as tx  # noqa: E402
from tensorxfer import synthetic  # noqa: E402
from tensorxfer.cli.bench import machine_facts  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def build_module(size: int, device: str, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> torch.nn.Module:
    """A module whose state_dict is the synthetic reference layout (820 tensors) of about ``size`` bytes."""
    root = torch.nn.Module()
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, _, shape in synthetic.layout(int(size), "BF16"):
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            child = mod._modules.get(part)
            if child is None:
                child = torch.nn.Module()
                mod.add_module(part, child)
            mod = child
        p = torch.empty(shape, device=device, dtype=dtype)
        p.normal_(generator=gen) if device != "cpu" or p.numel() < (1 << 26) else p.fill_(0.5)
        mod.register_parameter(leaf, torch.nn.Parameter(p, requires_grad=False))
    return root


def model_bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in module.state_dict().values())


class Peak:
    """Samples the memory a device (or this process) uses, every millisecond, in a thread."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.base = self.now()
        self.peak = self.base
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def now(self) -> int:
        if self.device == "cpu":
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        free, total = torch.cuda.mem_get_info(torch.device(self.device))
        return total - free

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.now())
            time.sleep(0.001)

    def __enter__(self) -> Peak:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self.now())


def measure_memory(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for how in ("from_module", "from_tensors"):
        baseline = Peak(args.device)
        model = build_module(args.size, args.device)
        nbytes = model_bytes(model)
        if args.device != "cpu":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        with Peak(args.device) as peak:
            t = time.perf_counter()
            region = (tx.TensorRegion.from_module(model) if how == "from_module" else
                      tx.TensorRegion.from_tensors(model.state_dict(), device=args.device))
            seconds = time.perf_counter() - t
        row = {"model_bytes": nbytes, "seconds": seconds,
               "peak_over_baseline_bytes": peak.peak - baseline.base,
               "peak_over_model_bytes_ratio": (peak.peak - baseline.base) / nbytes,
               "sampled": "cudaMemGetInfo (device)" if args.device != "cpu" else "RSS (/proc/self/statm)"}
        if args.device != "cpu":
            row["torch_max_memory_allocated_bytes"] = torch.cuda.max_memory_allocated()
        out[how] = row
        print(how, json.dumps(row), flush=True)
        region.close()
        del model, region
        if args.device != "cpu":
            torch.cuda.empty_cache()
    return out


def receiver_main(args: argparse.Namespace) -> int:
    model = build_module(args.size, args.device, seed=1)
    with tx.Receiver(device=args.device, share=args.share, stall_timeout=300) as rx:
        print("{}:{}".format(*rx.address), flush=True)
        for i in range(args.count):
            with profiled(args.profile, "receiver", i > 0):
                rx.receive(timeout=600, into=model)
        assert rx.last_stats is not None
        print(json.dumps(rx.last_stats.as_dict()), flush=True)     # the last update as the receiver saw it
    return 0


@contextlib.contextmanager
def profiled(where: Path | None, side: str, on: bool) -> Iterator[None]:
    """cProfile the block into ``where``/profile-<side>.txt (accumulated over the blocks; timings inflate)."""
    if where is None or not on:
        yield
        return
    prof = PROFILES.setdefault(side, cProfile.Profile())
    prof.enable()
    try:
        yield
    finally:
        prof.disable()
        where.mkdir(parents=True, exist_ok=True)
        with open(where / f"profile-{side}.txt", "w") as f:
            for key in ("cumulative", "tottime"):
                pstats.Stats(prof, stream=f).sort_stats(key).print_stats(45)


PROFILES: dict[str, cProfile.Profile] = {}


def start_receiver(args: argparse.Namespace, count: int) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--role", "receiver", "--device", args.device,
           "--size", str(args.size), "--count", str(count)] + (["--share"] if args.share else []) + \
        (["--profile", str(args.profile)] if args.profile else [])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if not line:
        proc.wait(timeout=120)
        raise RuntimeError(f"receiver exited with {proc.returncode} before listening")
    return proc, line


def torch_copy(nbytes: int, device: str, repeat: int) -> dict[str, Any]:
    src = torch.full((nbytes,), 0x5A, dtype=torch.uint8, device=device)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    runs = []
    for _ in range(repeat + 1):
        if device != "cpu":
            torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src)
        if device != "cpu":
            torch.cuda.synchronize()
        runs.append(time.perf_counter() - t)
    del src, dst
    if device != "cpu":
        torch.cuda.empty_cache()
    return {"runs_s": runs[1:], "median_s": statistics.median(runs[1:]), "what": "torch dst.copy_(src) + sync"}


def push(args: argparse.Namespace, adopted: bool) -> dict[str, Any]:
    """Warm per-step cost of pushing the model: adopted (send only) or the old way (update_from + send)."""
    model = build_module(args.size, args.device)
    params = {n: p.detach() for n, p in model.state_dict().items()}
    region = tx.TensorRegion.from_module(model) if adopted else tx.TensorRegion.from_tensors(params,
                                                                                               device=args.device)
    proc, where = start_receiver(args, args.repeat + 1)
    steps, stats = [], []
    try:
        with tx.Sender(where, transport=args.transport, stall_timeout=300) as s:
            for i in range(args.repeat + 1):
                if args.device != "cpu":
                    torch.cuda.synchronize()
                t = time.perf_counter()
                with profiled(args.profile, "sender", adopted and i > 0):
                    if not adopted:
                        region.update_from(params)
                    st = s.send(region)
                steps.append(time.perf_counter() - t)
                stats.append(st)
        assert proc.stdout is not None
        receiver_last = json.loads(proc.stdout.readline() or "null")
        if proc.wait(timeout=300) != 0:
            raise RuntimeError(f"receiver failed with {proc.returncode}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        region.close()
        del model, params, region
        if args.device != "cpu":
            torch.cuda.empty_cache()
    warm = steps[1:]
    return {"adopted": adopted, "cold_s": steps[0], "runs_s": warm, "median_s": statistics.median(warm),
            "wire_median_s": statistics.median(st.wire_seconds for st in stats[1:]),
            "transport": stats[-1].transport, "bytes": stats[-1].bytes, "counters_after": dict(stats[-1].counters),
            "warm_setup": [st.setup for st in stats[1:]], "last_sender_stats": stats[-1].as_dict(),
            "last_receiver_stats": receiver_last}


def measure_step(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"adopted": push(args, True), "update_from_then_send": push(args, False)}
    nbytes = out["adopted"]["bytes"]
    out["torch_copy"] = torch_copy(nbytes, args.device, args.repeat)
    ref = out["torch_copy"]["median_s"]
    out["ratio_adopted_vs_torch_copy"] = ref / out["adopted"]["median_s"]
    out["ratio_update_from_then_send_vs_torch_copy"] = ref / out["update_from_then_send"]["median_s"]
    for k in ("adopted", "update_from_then_send", "torch_copy"):
        print(k, f"{out[k]['median_s'] * 1e3:.2f} ms", flush=True)
    print("ratio adopted / torch copy:", f"{out['ratio_adopted_vs_torch_copy']:.3f}", flush=True)
    return out


def measure_load(args: argparse.Namespace) -> dict[str, Any]:
    import safetensors.torch as st

    d = Path(tempfile.mkdtemp(prefix="tensorxfer-load-", dir=args.tmp))
    layout = synthetic.layout(int(args.size), "BF16")
    per = -(-len(layout) // args.files)
    files = []
    for i in range(args.files):
        part = {name: torch.full(shape, float(i), dtype=torch.bfloat16) for name, _, shape in
                layout[i * per:(i + 1) * per]}
        f = d / f"model-{i + 1:05d}-of-{args.files:05d}.safetensors"
        st.save_file(part, str(f))
        files.append(f)
        del part
    total = sum(f.stat().st_size for f in files)
    runs: dict[str, list[float]] = {"tensorxfer": [], "reference": []}
    for _ in range(args.repeat + 1):          # the first round warms the page cache
        t = time.perf_counter()
        region = tx.TensorRegion.from_safetensors(d, device=args.device)
        if args.device != "cpu":
            torch.cuda.synchronize()
        runs["tensorxfer"].append(time.perf_counter() - t)
        region.close()
        t = time.perf_counter()
        if args.device != "cpu":
            loaded = [st.load_file(str(f), device=args.device) for f in files]
            torch.cuda.synchronize()
        else:
            loaded = []
            for f in files:
                with open(f, "rb") as fh:
                    while fh.readinto(buf := bytearray(64 << 20)):
                        pass
                del buf
        runs["reference"].append(time.perf_counter() - t)
        del loaded
        if args.device != "cpu":
            torch.cuda.empty_cache()
    for f in files:
        f.unlink()
    d.rmdir()
    ref_name = (f"safetensors.torch.load_file(device={args.device!r})" if args.device != "cpu" else
                "a plain read of the same files (readinto 64 MiB)")
    tx_med, ref_med = statistics.median(runs["tensorxfer"][1:]), statistics.median(runs["reference"][1:])
    out = {"file_bytes": total, "files": args.files, "tensorxfer_runs_s": runs["tensorxfer"][1:],
           "reference_runs_s": runs["reference"][1:], "reference": ref_name, "tensorxfer_median_s": tx_med,
           "reference_median_s": ref_med, "ratio_reference_over_tensorxfer": ref_med / tx_med,
           "tensorxfer_gbps": total * 8 / tx_med / 1e9}
    print(json.dumps(out), flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--what", choices=["memory", "step", "load"], default="step")
    p.add_argument("--role", choices=["bench", "receiver"], default="bench")
    p.add_argument("--device", default="cpu")
    p.add_argument("--size", type=float, default=1e9)
    p.add_argument("--transport", default="ipc")
    p.add_argument("--share", action="store_true", help="the receiver maps the trainer's memory (ipc)")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--count", type=int, default=0)
    p.add_argument("--files", type=int, default=8)
    p.add_argument("--tmp", default=None, help="where the load test writes its files (default: the temp dir)")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--profile", type=Path, default=None,
                   help="cProfile the warm adopted steps on both sides into this folder (times inflate)")
    args = p.parse_args(argv)
    args.size = int(args.size)
    if args.role == "receiver":
        return receiver_main(args)
    result = {"command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
              "date": dt.datetime.now(dt.timezone.utc).isoformat(), "machine": machine_facts(),
              "what": args.what, "device": args.device, "size": args.size,
              "result": {"memory": measure_memory, "step": measure_step, "load": measure_load}[args.what](args)}
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%MZ")
    path = args.out / f"live-{args.what}-{args.device.replace(':', '')}-{stamp}.json"
    path.write_text(json.dumps(result, indent=1))
    print("wrote", path, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
