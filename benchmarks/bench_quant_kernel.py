"""The FP8 quantize kernels alone, in one process: a source's shards quantized through one table, against
torch casting the same bytes once (the memory bound) on the same GPU, in the same run.

The shards are one source's share of a Llama-shaped bf16 (or fp32) model, cut at uneven rows as FSDP2 cuts
them (block rows shared with the neighbouring shards), 128 x 128 blocks.  Timed: a sync
step's three launches (the shared cells' amaxes; the others' amaxes and values; the shared cells' values);
``--image`` runs another build of ``fp8_quantize.cu`` (a fatbin), to compare builds side by side.

    python3 benchmarks/bench_quant_kernel.py --size 4.5e9 --image a.fatbin --image b.fatbin --out $OUT
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import bench_sync  # noqa: E402  (benchmarks/, beside this file)
import torch  # noqa: E402

from tensorxfer.cli.bench import machine_facts  # noqa: E402
from tensorxfer.quant import Quantization, kernel  # noqa: E402
from tensorxfer.quant.kernel import ShardTable  # noqa: E402
from tensorxfer.sync.quantizing import QuantizedShard  # noqa: E402


def shards(size: float, dtype: torch.dtype, device: str) -> list[QuantizedShard]:
    """``size`` bytes of 2-D weights (4096 x 4096 and 4096 x 14336, Llama-8B's), each a row shard starting
    at an uneven row, with its FP8 values and scales."""
    q = Quantization.blocks()
    out: list[QuantizedShard] = []
    total, i = 0, 0
    while total < size:
        rows, cols = (4096, 4096) if i % 3 else (14336, 4096)
        r0, r1 = 1000 + 7 * i, 3300 + 5 * i          # rows [r0, r1): block rows shared at both ends
        x = torch.randn(r1 - r0, cols, device=device).to(dtype)
        grid = q.grid((rows, cols))
        count = grid.cells((r0, 0), tuple(x.shape))[1]
        out.append(QuantizedShard(f"w{i}", (rows, cols), (r0, 0), q, x,
                                  torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=device),
                                  torch.empty(count, dtype=torch.float32, device=device)))
        total += x.numel() * x.element_size()
        i += 1
    return out


def run(parts: list[QuantizedShard], repeat: int) -> dict[str, Any]:
    table = ShardTable([(s.local, s.grid, s.offsets, s.q, s.values, s.scales) for s in parts])
    shared = torch.tensor([table.starts[i] + int(p) for i, s in enumerate(parts) for p in s.shared_pos],
                          dtype=torch.int64, device=table.device)
    whole = torch.tensor(sorted(set(range(table.cells)) - set(shared.tolist())), dtype=torch.int64,
                         device=table.device)

    def step() -> None:             # a sync step's three launches
        table.amaxes(shared)
        table.amaxes(whole, quantize_whole=True)
        table.quantize(shared)
    return {"seconds": bench_sync.median_seconds(step, "cuda", repeat), "shared_cells": int(shared.numel()),
            "cells": table.cells}


def bound(parts: list[QuantizedShard], repeat: int) -> float:
    """torch casting the shards' bytes to FP8 once, as one tensor: each byte read once and written once."""
    src = torch.cat([s.local.reshape(-1) for s in parts])
    dst = torch.empty(src.shape, dtype=torch.float8_e4m3fn, device=src.device)
    return bench_sync.median_seconds(lambda: dst.copy_(src), "cuda", repeat)


def _constant(data: bytes) -> Any:
    return lambda: data


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=float, default=4.5e9)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--image", type=Path, action="append", default=[], help="another fatbin of fp8_quantize.cu")
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    parts = shards(args.size, getattr(torch, args.dtype), "cuda")
    in_bytes = sum(s.local.numel() * s.local.element_size() for s in parts)
    out_bytes = sum(s.values.numel() for s in parts)
    result: dict[str, Any] = {"input_bytes": in_bytes, "fp8_bytes": out_bytes, "bound_s": bound(parts, args.repeat)}
    builds = {"built": None, **{str(i): i for i in args.image}}
    built = kernel._image
    for name, image in builds.items():
        built.cache_clear()
        kernel._functions.clear()      # the next launch loads this build's image
        kernel._image = built if image is None else _constant(image.read_bytes())  # type: ignore[assignment]
        r = run(parts, args.repeat)
        r["over_bound"] = r["seconds"] / result["bound_s"]
        r["gbps"] = (in_bytes + out_bytes) / r["seconds"] / 1e9
        result[name] = r
        print(f"{name}: {r['seconds'] * 1e3:.2f} ms, {r['gbps']:.0f} GB/s, {r['over_bound']:.2f}x the bound "
              f"({result['bound_s'] * 1e3:.2f} ms); {r['shared_cells']} of {r['cells']} cells shared", flush=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"quant-kernel-{args.dtype}.json").write_text(json.dumps(
            {"command": " ".join(sys.argv), "date": dt.datetime.now(dt.timezone.utc).isoformat(),
             "machine": machine_facts(), "result": result}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
