"""A bf16 trainer into FP8 inference ranks: quantizing on the way against what users do today, and the bound.

A Llama-shaped bf16 model of ``--size`` bytes (bench_sync's synthetic layout, every dimension rounded up
to a multiple of 256 so that TP=2 shards hold whole 128 x 128 blocks) is held by ``--sources`` source
processes (``torch.chunk`` dim-0 shards: FSDP2's layout, block rows cut anywhere) and served by
``--targets`` target processes in a TP layout whose linear weights (fused qkv, fused gate_up, row-parallel
o_proj and down_proj) are FP8 with ``weight_scale_inv`` of 128 x 128 blocks, the rest bf16.

Measured in the same run, same machine:

- ``fp8_sync``: :class:`tensorxfer.WeightSync` steps with FP8 targets: the sources quantize the blocks
  they share (one amax round through the store) and send FP8 and scales; on one GPU the pairs make every
  other block's FP8 on the way from the sources' bf16 (:mod:`tensorxfer.sync.fusing`), elsewhere the sources
  quantize those too.  ``paths`` says how many bytes took each way.
- ``today``: what RL frameworks do today (verl's and slime's FP8 rollouts): the targets receive bf16 (the
  same sync, bf16 targets: the fastest honest way to get bf16 there) into a staging copy of their shard,
  then quantize each tensor with torch operations into their FP8 weights and scales (the same formula in
  torch's operations, ``torch_quantize_into``; the FP8 sync's sources use the kernels / C loops).  A step ends when
  the last target finished quantizing.
- ``bound``: torch reading the bf16 bytes of the weights served in FP8 and writing their FP8 bytes once
  (one cast copy, ``fp8.copy_(bf16)``), plus one copy of the bf16 tensors, in one process; and
  ``bound_with_copy``: the same plus one copy of the FP8 bytes (sources and targets hold their own memory).

Also: wire bytes per step against the bf16 bytes, bytes quantized from blocks the sources shared, and on a
GPU each target process's device memory (``nvidia-smi``, the region's VMM memory is outside PyTorch).
Every target checks its FP8 bytes and scales against the reference quantization of the global values.

    python3 benchmarks/bench_fp8.py --size 2e9 --sources 4 --targets 2 --transport ipc --out /tmp/bfp8
    python3 benchmarks/bench_fp8.py --device cuda:0 --size 16e9 --sources 4 --targets 2 --transport ipc --out $OUT
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
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import bench_sync  # noqa: E402  (benchmarks/, beside this file)
import torch  # noqa: E402
import trace_sync  # noqa: E402

import tensorxfer as tx  # noqa: E402
from tensorxfer import synthetic  # noqa: E402
from tensorxfer.cli.bench import machine_facts  # noqa: E402
from tensorxfer.quant.quantize import block_amax, quantize_into, torch_block_amax, torch_quantize_into  # noqa: E402
from tensorxfer.sync import Quantization, Source, Target, chunk_box  # noqa: E402
from tensorxfer.sync.rendezvous import open_tcp_store  # noqa: E402

Q = Quantization.blocks(128, 128)
ALIGN = 256


def model_layout(size: float) -> list[tuple[str, tuple[int, ...]]]:
    return [(name, tuple(-(-d // ALIGN) * ALIGN for d in shape)) for name, _, shape in
            synthetic.layout(int(size), "BF16")]


def served_fp8(name: str) -> bool:
    return name.endswith("proj.weight")


def source_shards(layout: list[tuple[str, tuple[int, ...]]], rank: int, n: int, device: str) -> dict[str, Source]:
    out = {}
    for name, shape in layout:
        box = chunk_box(shape, 0, rank, n)
        local = bench_sync.global_value(name, shape, 0, device)[box.offsets[0]:box.offsets[0] + box.sizes[0]].clone()
        out[name] = Source(local, shape, box)
    return out


def scales_of(shape: tuple[int, ...], device: str) -> Any:
    return torch.empty(-(-shape[0] // 128), -(-shape[1] // 128), dtype=torch.float32, device=device)


def target_layout(layout: list[tuple[str, tuple[int, ...]]], rank: int, m: int, device: str,
                  fp8: bool) -> dict[str, Target]:
    """bench_sync's TP layout; with ``fp8`` the linear weights as FP8 with their scales."""
    plain = bench_sync.target_tensors(layout, rank, m, device)
    if not fp8:
        return plain
    out = {}
    for name, t in plain.items():
        if served_fp8(name):
            values = torch.empty(t.tensor.shape, dtype=torch.float8_e4m3fn, device=device)
            out[name] = Target(values, t.pieces, t.global_shapes).quantized(Q, scales_of(tuple(values.shape), device))
        else:
            out[name] = t
    del plain
    return out


def quantize_today(staging: dict[str, Target], engine: dict[str, tuple[Any, Any]]) -> None:
    """The engine's load_weights today: each FP8-served tensor, received in bf16, quantized with torch ops."""
    for name, (values, scales) in engine.items():
        w = staging[name].tensor
        grid = Q.grid(tuple(w.shape))
        torch_quantize_into(w, grid, (0, 0), Q, torch_block_amax(w, grid, (0, 0)), values, scales)


def check(layout: list[tuple[str, tuple[int, ...]]], tensors: dict[str, Target], device: str) -> int:
    """Every FP8 target tensor and its scales equal the reference quantization of its pieces of the global
    values (each piece holds whole blocks); every bf16 one equals its pieces."""
    shapes = dict(layout)
    for name, target in tensors.items():
        for piece in target.pieces:
            full = bench_sync.global_value(piece.source_name, shapes[piece.source_name], 0, device)
            src = full[tuple(slice(o, o + k) for o, k in zip(piece.source_box.offsets, piece.source_box.sizes))]
            at = tuple(slice(a, a + k) for a, k in zip(piece.at, piece.source_box.sizes))
            if target.quantization is None:
                if not torch.equal(src, target.tensor[at]):
                    raise AssertionError(f"{name!r}: the piece of {piece.source_name!r} differs")
                continue
            grid = Q.grid(tuple(src.shape))
            values = torch.empty(src.shape, dtype=torch.float8_e4m3fn, device=device)
            scales = scales_of(tuple(src.shape), device)
            quantize_into(src, grid, (0, 0), Q, block_amax(src, grid, (0, 0)), values, scales)
            cells = tuple(slice(a // 128, a // 128 + s) for a, s in zip(piece.at, scales.shape))
            if not (torch.equal(values.view(torch.uint8), target.tensor[at].view(torch.uint8))
                    and torch.equal(scales, target.scales[cells])):
                raise AssertionError(f"{name!r}: the FP8 piece of {piece.source_name!r} differs from the reference")
    return len(tensors)


def device_memory(device: str) -> int | None:
    """This process's memory on the GPU (nvidia-smi: a region's VMM handles are outside PyTorch's counters)."""
    if device == "cpu":
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in out.splitlines():
        pid, _, mib = line.partition(",")
        if pid.strip() == str(os.getpid()):
            return int(mib.strip()) << 20
    return None


def rank_main(args: argparse.Namespace) -> int:
    if os.environ.get("BENCH_SWITCH_INTERVAL"):      # a diagnosis: the GIL's switch interval in every rank process
        sys.setswitchinterval(float(os.environ["BENCH_SWITCH_INTERVAL"]))
    torch.set_num_threads(1 if args.device != "cpu" else max(1, (os.cpu_count() or 1) // (args.sources + args.targets)))
    n, m = args.sources, args.targets
    layout = model_layout(args.size)
    store = open_tcp_store("127.0.0.1", args.store_port, False, timeout=600)
    role, rank, fp8 = args.role, args.rank, args.what == "fp8"
    prefix = "" if fp8 else "today/"
    traced = fp8 and args.trace is not None
    if traced:
        trace_sync.install()
    tensors: Any = (source_shards(layout, rank, n, args.device) if role == "source" else
                    target_layout(layout, rank, m, args.device, fp8))
    engine = {}
    if role == "target" and not fp8:        # the engine's own FP8 weights, filled from the bf16 staging
        engine = {name: (torch.empty(t.tensor.shape, dtype=torch.float8_e4m3fn, device=args.device),
                         scales_of(tuple(t.tensor.shape), args.device))
                  for name, t in tensors.items() if served_fp8(name)}
    sync = tx.WeightSync(store, f"bench-{args.what}", role, rank, (n, m), tensors, token="bench",
                         transport=args.transport, timeout=600, stall_timeout=300, elastic=False)
    if args.device != "cpu":
        torch.cuda.empty_cache()
    store.set(f"{prefix}ready/{role}/{rank}", b"1")
    steps, cpu = [], []
    kineto = os.environ.get("BENCH_KINETO") if fp8 and args.device != "cpu" else None
    profiler: Any = None
    for step in range(args.repeat + 1):
        bench_sync.wait_go(store, f"{prefix}go/{step}")
        t0, c0 = time.time(), time.process_time()
        if role == "source":
            st = sync.push()
        else:
            sync.wait(timeout=600)
            st = sync.last_stats
            if engine:
                quantize_today(tensors, engine)
            if args.device != "cpu":
                torch.cuda.synchronize(args.device)
        steps.append((t0, time.time()))
        cpu.append(time.process_time() - c0)
        if profiler is not None:
            profiler.stop()
            Path(kineto).mkdir(parents=True, exist_ok=True)
            profiler.export_chrome_trace(str(Path(kineto) / f"{role}{rank}.json"))
            (Path(kineto) / f"{role}{rank}.step.json").write_text(json.dumps(steps[-1]))
        if kineto and step == args.repeat - 1:
            # a diagnosis: every process's GPU work in the last step (CUPTI), started before this rank says it
            # is done (starting takes a while: the next step's start instant is set once every rank said so)
            profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            profiler.start()
        store.set(f"{prefix}done/{step}/{role}/{rank}", json.dumps({"start": t0, "end": steps[-1][1]}).encode())
    if traced:
        trace_sync.dump(args.trace, role, rank, steps)
    report = {**st.as_dict(), "device_memory_bytes": device_memory(args.device), "region_bytes": sync.region.nbytes,
              "step_seconds": [end - start for start, end in steps], "cpu_seconds": cpu}
    if role == "target":
        report["engine_fp8_bytes"] = sum(v.numel() + s.numel() * 4 for v, s in engine.values())
        # a diagnosis (private: no user needs it): whether this target copies for the others on its GPU
        report["copy_host"] = sync._copy_host is not None
        checked = check(layout, tensors, args.device) if fp8 else len(tensors)
        print(f"{args.what} target {rank}: {checked} tensors checked", flush=True)
    store.set(f"{prefix}stats/{role}/{rank}", json.dumps(report).encode())
    sync.close()
    return 0


def spawn(args: argparse.Namespace, port: int, role: str, rank: int, what: str) -> subprocess.Popen:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--what", what, "--role", role, "--rank", str(rank),
           "--store-port", str(port), "--size", str(args.size), "--sources", str(args.sources), "--targets",
           str(args.targets), "--transport", args.transport, "--device", args.device, "--repeat", str(args.repeat),
           *(["--trace", str(args.trace)] if args.trace else [])]
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen(cmd, env=dict(os.environ, PYTHONPATH=path))    # keep where cuda-bindings is


def run(args: argparse.Namespace, store: Any, what: str) -> dict[str, Any]:
    n, m = args.sources, args.targets
    prefix = "" if what == "fp8" else "today/"
    procs = [spawn(args, store.port, "target", t, what) for t in range(m)] + \
        [spawn(args, store.port, "source", s, what) for s in range(n)]
    _, times = bench_sync.run_steps(args, store, prefix, procs, [f"{prefix}ready/{r}/{i}" for r, c in
                                                                 (("source", n), ("target", m)) for i in range(c)])
    ranks = {f"{role}{r}": json.loads(store.get(f"{prefix}stats/{role}/{r}"))
             for role, count in (("source", n), ("target", m)) for r in range(count)}
    paths = {k: sum(ranks[f"source{s}"]["quantized"][k] for s in range(n))
             for k in ("values_bytes", "shared_bytes", "fused_bytes", "fused_input_bytes")}
    return {"runs_s": times[1:], "cold_s": times[0], "median_s": statistics.median(times[1:]),
            "wire_bytes": sum(ranks[f"source{s}"]["bytes"] for s in range(n)), "paths": paths, "ranks": ranks}


def bound(layout: list[tuple[str, tuple[int, ...]]], device: str, repeat: int) -> float:
    """One process: cast the bf16 bytes of the FP8-served weights to FP8 once, and copy the bf16 ones."""
    fp8_elems = sum(torch.Size(s).numel() for n, s in layout if served_fp8(n))
    bf16_elems = sum(torch.Size(s).numel() for n, s in layout if not served_fp8(n))
    src = torch.ones(fp8_elems, dtype=torch.bfloat16, device=device)
    dst = torch.empty(fp8_elems, dtype=torch.float8_e4m3fn, device=device)
    src2 = torch.ones(bf16_elems, dtype=torch.bfloat16, device=device)
    dst2 = torch.empty_like(src2)
    return bench_sync.median_seconds(lambda: (dst.copy_(src), dst2.copy_(src2)), device, repeat)


def bound_with_copy(layout: list[tuple[str, tuple[int, ...]]], device: str, repeat: int) -> float:
    """:func:`bound`, plus one copy of the FP8 bytes: the least memory traffic when sources and targets hold
    their own memory (the FP8 bytes are made where the bf16 ones are, then land in the target's)."""
    fp8_elems = sum(torch.Size(s).numel() for n, s in layout if served_fp8(n))
    bf16_elems = sum(torch.Size(s).numel() for n, s in layout if not served_fp8(n))
    src = torch.ones(fp8_elems, dtype=torch.bfloat16, device=device)
    dst = torch.empty(fp8_elems, dtype=torch.float8_e4m3fn, device=device)
    landed = torch.empty_like(dst)
    src2 = torch.ones(bf16_elems, dtype=torch.bfloat16, device=device)
    dst2 = torch.empty_like(src2)
    return bench_sync.median_seconds(lambda: (dst.copy_(src), landed.copy_(dst), dst2.copy_(src2)), device, repeat)


def cpu_of(rank: dict[str, Any]) -> str:
    """A rank's CPU time in each warm step (all its threads: a thread spinning on the GPU counts its whole wait)."""
    cpu = rank.get("cpu_seconds")
    return f"; CPU ms a step {' '.join(f'{x * 1e3:.1f}' for x in cpu[1:])}" if cpu else ""


def timeline(ranks: dict[str, Any]) -> list[str]:
    """Each source's last step, in ms from its push's start: its quantizer's first half and its whole round
    (the part waiting for peers' amaxes), and when each of its pairs' parts ended (from the pair's first offer);
    each target's steps, from the start instant to its wait's end, and whether it is its GPU's copy host (a noisy
    H100 call had one target's steps end up to 16 ms after the other's)."""
    ms = lambda x: f"{x * 1e3:.2f}"       # noqa: E731
    out = []
    for name, r in sorted(ranks.items()):
        if name.startswith("target") and "step_seconds" in r:
            out.append(f"  {name}{' (copy host)' if r.get('copy_host') else ''}: steps "
                       f"{' '.join(ms(x) for x in r['step_seconds'][1:])} (cold {ms(r['step_seconds'][0])})"
                       f"{cpu_of(r)}")
        q = r.get("quantized")
        if not name.startswith("source") or q is None:
            continue
        pairs = "; ".join(f"target {p['target']}: " + " / ".join(ms(x) for x in (p.get("part_seconds") or
                                                                                 [p["seconds"]]))
                          for p in r["pairs"])
        out.append(f"  {name}: quantizer first half {ms(q.get('begin_seconds', 0.0))}, round {ms(q['seconds'])} "
                   f"(waiting for peers {ms(q['wait_seconds'])}); parts ended at {pairs}{cpu_of(r)}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--what", choices=["bench", "fp8", "today"], default="bench")
    bench_sync.rank_arguments(p, "ipc")
    p.add_argument("--out", type=Path, default=bench_sync.RESULTS)
    p.add_argument("--trace", type=Path, default=None,
                   help="write each rank's timeline of the FP8 sync's steps here and print it (trace_sync.py; the "
                        "traced steps run slightly slower)")
    args = p.parse_args(argv)
    if args.what != "bench":
        return rank_main(args)
    store = open_tcp_store("127.0.0.1", 0, True, timeout=900)
    layout = model_layout(args.size)
    bf16_bytes = sum(2 * torch.Size(s).numel() for _, s in layout)
    result: dict[str, Any] = {"model_bf16_bytes": bf16_bytes}
    result["fp8_sync"] = run(args, store, "fp8")
    paths = result["fp8_sync"]["paths"]
    print("fp8 sync", f"{result['fp8_sync']['median_s'] * 1e3:.2f} ms, wire",
          f"{result['fp8_sync']['wire_bytes'] / 1e9:.3f} GB; FP8 made on the way",
          f"{paths['fused_bytes'] / 1e9:.3f} GB (from {paths['fused_input_bytes'] / 1e9:.3f} GB of input), by the "
          f"sources {paths['values_bytes'] / 1e9:.3f} GB (shared blocks {paths['shared_bytes'] / 1e9:.3f} GB)",
          flush=True)
    for line in timeline(result["fp8_sync"]["ranks"]):
        print(line, flush=True)
    if args.trace:
        print(trace_sync.summarize(args.trace), flush=True)
    result["today"] = run(args, store, "today")
    print("today (bf16 sync, targets quantize)", f"{result['today']['median_s'] * 1e3:.2f} ms, wire",
          f"{result['today']['wire_bytes'] / 1e9:.3f} GB", flush=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    result["bound_s"] = bound(layout, args.device, args.repeat)
    result["bound_with_copy_s"] = bound_with_copy(layout, args.device, args.repeat)
    torch.set_num_threads(threads)
    fp8, today = result["fp8_sync"]["median_s"], result["today"]["median_s"]
    result.update(speedup_over_today=today / fp8, fp8_over_bound=fp8 / result["bound_s"],
                  fp8_over_bound_with_copy=fp8 / result["bound_with_copy_s"],
                  wire_over_bf16=result["fp8_sync"]["wire_bytes"] / result["today"]["wire_bytes"])
    print("bound", f"{result['bound_s'] * 1e3:.2f} ms;", "speedup over today", f"{result['speedup_over_today']:.2f}x;",
          "fp8 sync / bound", f"{result['fp8_over_bound']:.2f};", "bound with a copy",
          f"{result['bound_with_copy_s'] * 1e3:.2f} ms, fp8 sync / it", f"{result['fp8_over_bound_with_copy']:.2f};",
          "wire fp8/bf16", f"{result['wire_over_bf16']:.3f}",
          flush=True)
    out = {"command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
           "date": dt.datetime.now(dt.timezone.utc).isoformat(), "machine": machine_facts(), "size": args.size,
           "sources": args.sources, "targets": args.targets, "transport": args.transport, "device": args.device,
           "result": result}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"fp8-{args.device.replace(':', '')}-{args.transport}-{args.sources}to{args.targets}-" \
                      f"{dt.datetime.now(dt.timezone.utc).strftime('%Y%m%dT%H%M%SZ')}.json"
    path.write_text(json.dumps(out, indent=1))
    print("wrote", path, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
