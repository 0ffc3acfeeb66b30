"""The quantizing-tiles kernel alone, on one GPU: one 2-D bf16 shard of --gib GiB quantized into an FP8 tensor
in 128 x 128 tiles, against torch casting the same bytes (``fp8.copy_(bf16)``) and against the source path's
kernels (``ShardTable``: amaxes and values of whole cells in one launch), CUDA events, median of --repeat.

    python3 benchmarks/probe_tiles.py --gib 4 --repeat 20 [--image variant.fatbin]

``--image`` runs another build of ``fp8_quantize.cu`` (a fatbin), to compare kernel variants side by side.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np
import torch

from tensorxfer.quant import kernel, tiles
from tensorxfer.quant.layout import Quantization


def timed(fn, repeat: int) -> float:
    out = []
    for _ in range(repeat + 1):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) / 1e3)
    return statistics.median(out[1:])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gib", type=float, default=4)
    p.add_argument("--cols", type=int, default=8192)
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--image", default=None, help="a fatbin of fp8_quantize.cu to run instead of the package's")
    args = p.parse_args()
    if args.image is not None:
        image = Path(args.image).read_bytes()
        kernel._image = lambda: image      # before the first launch loads the package's

    cols = args.cols
    rows = int(args.gib * (1 << 30) / 2 / cols) // 128 * 128
    src = torch.randn(rows, cols, device="cuda").to(torch.bfloat16)
    dst = torch.empty(rows, cols, dtype=torch.float8_e4m3fn, device="cuda")
    scales = torch.empty(rows // 128, cols // 128, dtype=torch.float32, device="cuda")
    gi, gj = np.meshgrid(np.arange(rows // 128), np.arange(cols // 128), indexing="ij")
    gi, gj = gi.reshape(-1), gj.reshape(-1)
    t = np.zeros((len(gi), tiles.WIDTH), np.int64)
    t[:, tiles.SRC] = (gi * 128 * cols + gj * 128) * 2
    t[:, tiles.SRC_PITCH] = cols * 2
    t[:, tiles.ROWS] = t[:, tiles.COLS] = 128
    t[:, tiles.DST] = gi * 128 * cols + gj * 128
    t[:, tiles.DST_PITCH] = cols
    t[:, tiles.R1] = t[:, tiles.C1] = 128
    base = scales.data_ptr() - dst.data_ptr()
    t[:, tiles.SCALE] = base + (gi * (cols // 128) + gj) * 4
    t[:, tiles.AMAX] = -1       # whole blocks
    qt = tiles.QuantTiles(t, np.zeros(len(t), np.int32), ("w",))
    dev = tiles.DeviceTiles(qt, torch.cuda.current_device())
    stream = torch.cuda.current_stream().cuda_stream
    res = {"image": args.image or "package", "bytes_in": src.numel() * 2, "tiles": len(t)}
    res["tiles_s"] = timed(lambda: dev.launch(stream, dst.data_ptr(), src.data_ptr()), args.repeat)
    assert dev.failed() is None
    q = Quantization.blocks()
    table = kernel.ShardTable([(src, q.grid((rows, cols)), (0, 0), q, dst.view(torch.uint8), scales)])
    res["shard_table_s"] = timed(lambda: table.amaxes(None, quantize_whole=True), args.repeat)
    res["torch_cast_s"] = timed(lambda: dst.copy_(src), args.repeat)
    res["tiles_over_cast"] = res["tiles_s"] / res["torch_cast_s"]
    res["tiles_tb_s"] = (src.numel() * 3) / res["tiles_s"] / 1e12
    print(json.dumps(res))


if __name__ == "__main__":
    main()
