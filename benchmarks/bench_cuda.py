"""Benchmark on a GPU: packing the reference model into one VMM region.

All in one run, on the reference shape (``tensorxfer.synthetic.layout``:
820 BF16 tensors of a 91-layer decoder, 31.2 GB by default):

- ``from_tensors(device="cuda:0")`` (allocate + map + 820 device-to-device
  copies) and ``update_from`` (the copies alone) against PyTorch copying the
  same bytes device-to-device into preallocated memory: one contiguous
  ``copy_`` (the memcpy ceiling) and 820 per-tensor ``copy_`` calls.
  Ratio = torch time / tensorxfer time (1.0 = as fast).
- allocate + map (and release) of 31.2 GB for chunk sizes 2 MiB, 20 MiB,
  64 MiB, 1 GiB;
- extent resolution over every handle of the 2 MiB region (14,878 handles
  at 31.2 GB), walking ``cuMemGetAddressRange``;
- dmabuf export of the whole extent.

    python benchmarks/bench_cuda.py --size 31.2e9 --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from tensorxfer import TensorRegion, synthetic
from tensorxfer.memory import CudaRegion
from tensorxfer.memory._cuda import device_info


def timed(fn, repeat: int, sync=torch.cuda.synchronize) -> tuple[float, list[float]]:
    times = []
    for _ in range(repeat):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times), times


def torch_reference(src: dict, nbytes: int, repeat: int) -> tuple[float, float]:
    """PyTorch copying the same bytes device-to-device into preallocated memory."""
    dev = next(iter(src.values())).device
    flat_src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    flat_dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    t_flat, _ = timed(lambda: flat_dst.copy_(flat_src), repeat)
    dsts, off = {}, 0
    for name, t in src.items():
        n = t.numel() * 2
        dsts[name] = flat_dst[off:off + n].view(torch.bfloat16).reshape(t.shape)
        off += n

    def per_tensor():
        for name, t in src.items():
            dsts[name].copy_(t)

    t_per, _ = timed(per_tensor, repeat)
    return t_flat, t_per


def tensorxfer_pack(src: dict, repeat: int, chunk_size: int | None, batch: bool) -> dict:
    """from_tensors (region closed outside the timer) and update_from, medians."""
    from tensorxfer.region import _as_source

    packs = []
    for _ in range(max(3, repeat)):
        torch.cuda.synchronize()
        t = time.perf_counter()
        region = TensorRegion.from_tensors(src, device="cuda:0", chunk_size=chunk_size)
        torch.cuda.synchronize()
        packs.append(time.perf_counter() - t)
        region.close()
    region = TensorRegion.from_tensors(src, device="cuda:0", chunk_size=chunk_size)
    region.batch_copies = batch
    t_update, _ = timed(lambda: region.update_from(src), repeat)
    t_prep, _ = timed(lambda: [_as_source(n, v, True) for n, v in src.items()], repeat)
    views = region.tensors()
    names = list(src)[:5] + list(src)[-5:]
    ok = all(torch.equal(views[n].view(torch.int16), src[n].view(torch.int16)) for n in names)
    del views
    handles = len(region.region.chunks)
    region.close()
    return {"from_tensors_s": statistics.median(packs), "from_tensors_all": packs, "update_from_s": t_update,
            "python_prep_s": t_prep, "verified_sample": ok, "handles": handles, "chunk_size": chunk_size,
            "batch_api": batch}


def probe_copy_paths(src: dict, nbytes: int, repeat: int) -> dict:
    """Where does a batched copy's time go: the copy API, or the destination memory?"""
    from tensorxfer.memory._copy import Copier

    out = {}
    names = list(src)
    region = TensorRegion.from_tensors(src, device="cuda:0")
    views = region.tensors()
    flat = torch.empty(nbytes + 256 * len(src), dtype=torch.uint8, device="cuda")
    srcp = torch.tensor([src[n].data_ptr() for n in names], dtype=torch.int64).numpy().view("uint64")
    sizes = torch.tensor([src[n].numel() * 2 for n in names], dtype=torch.int64).numpy().view("uint64")
    offs = [t.offset for t in region.manifest.tensors]
    dst_region = (torch.tensor(offs, dtype=torch.int64).numpy().view("uint64") + region.region.ptr)
    dst_torch = (torch.tensor(offs, dtype=torch.int64).numpy().view("uint64") + flat.data_ptr())
    with Copier(0) as c:
        out["cuMemcpyDtoDAsync_into_region_ms"] = timed(lambda: (c.dtod_batch(dst_region, srcp, sizes),
                                                                  c.synchronize()), repeat)[0] * 1e3
        out["cuMemcpyDtoDAsync_into_torch_memory_ms"] = timed(lambda: (c.dtod_batch(dst_torch, srcp, sizes),
                                                                        c.synchronize()), repeat)[0] * 1e3
        out["cuMemcpyBatchAsync_into_region_ms"] = timed(lambda: (c.dtod_batch(dst_region, srcp, sizes, True),
                                                                   c.synchronize()), repeat)[0] * 1e3

    def torch_into_region():
        for n in names:
            views[n].copy_(src[n])

    out["torch_copy_into_region_ms"] = timed(torch_into_region, repeat)[0] * 1e3
    side = torch.cuda.Stream()

    def torch_into_region_side_stream():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for n in names:
                views[n].copy_(src[n])
        side.synchronize()

    out["torch_copy_into_region_side_stream_ms"] = timed(torch_into_region_side_stream, repeat)[0] * 1e3
    views.clear()
    del flat
    region.close()
    for k, v in out.items():
        print(f"probe {k:45} {v:8.2f} ms", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=float, default=31.2e9)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args()
    dev = torch.device("cuda:0")
    info = device_info(0)

    layout = synthetic.layout(int(args.size))
    gen = torch.Generator(device=dev).manual_seed(0)
    src = {}
    for name, _, shape in layout:
        n = 1
        for d in shape:
            n *= d
        src[name] = torch.randint(-32768, 32767, (n,), dtype=torch.int16, device=dev, generator=gen).view(
            torch.bfloat16).reshape(shape)
    nbytes = sum(t.numel() * 2 for t in src.values())
    print(f"{len(src)} tensors, {nbytes / 1e9:.2f} GB on {info['name']}", flush=True)

    res: dict = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                 "command": " ".join(["python", *sys.argv]), "device": info, "torch": torch.__version__,
                 "tensors": len(src), "bytes": nbytes, "repeat": args.repeat}

    t_flat, t_per = torch_reference(src, nbytes, args.repeat)
    torch.cuda.empty_cache()
    res["probe"] = probe_copy_paths(src, nbytes, args.repeat)
    torch.cuda.empty_cache()
    variants = [tensorxfer_pack(src, args.repeat, chunk, batch)
                for chunk, batch in ((None, False), (None, True), (1 << 30, False), (64 << 20, False))]
    src.clear()
    torch.cuda.empty_cache()

    gbs = lambda t: nbytes / t / 1e9  # noqa: E731
    res["torch_copy_contiguous"] = {"seconds": t_flat, "GBps": gbs(t_flat)}
    res["torch_copy_per_tensor"] = {"seconds": t_per, "GBps": gbs(t_per)}
    res["variants"] = variants
    print(f"torch copy_, one contiguous buffer : {t_flat * 1e3:8.2f} ms {gbs(t_flat):8.1f} GB/s")
    print(f"torch copy_, 820 tensors           : {t_per * 1e3:8.2f} ms {gbs(t_per):8.1f} GB/s")
    for v in variants:
        print(f"tensorxfer chunk={v['chunk_size'] or 'default'} batch_api={v['batch_api']} handles={v['handles']}: "
              f"from_tensors {v['from_tensors_s'] * 1e3:8.2f} ms (ratio {t_per / v['from_tensors_s']:.3f}), "
              f"update_from {v['update_from_s'] * 1e3:8.2f} ms (ratio {t_per / v['update_from_s']:.3f}), "
              f"python prep {v['python_prep_s'] * 1e3:.2f} ms, verified {v['verified_sample']}", flush=True)
        v["ratio_from_tensors_vs_torch_per_tensor"] = t_per / v["from_tensors_s"]
        v["ratio_update_vs_torch_per_tensor"] = t_per / v["update_from_s"]
        v["ratio_update_vs_torch_contiguous"] = t_flat / v["update_from_s"]

    # --- allocate + map per chunk size; extent walk and dmabuf on each
    size = nbytes
    res["chunk_sweep"] = []
    for chunk in (2 << 20, 20 << 20, 64 << 20, 256 << 20, 1 << 30):
        t0 = time.perf_counter()
        r = CudaRegion.allocate(size, chunk_size=chunk)
        t_alloc = time.perf_counter() - t0
        n = len(r.chunks)
        walk, _ = timed(lambda r=r: r.resolve_extent(0, r.size), 5, sync=lambda: None)
        segs = len(r.resolve_extent(0, r.size).segments)
        t0 = time.perf_counter()
        fd = r.export_dmabuf()
        t_dmabuf = time.perf_counter() - t0
        dmabuf_size = os.lseek(fd, 0, os.SEEK_END)
        os.close(fd)
        t0 = time.perf_counter()
        r.close()
        t_free = time.perf_counter() - t0
        row = {"chunk_bytes": chunk, "handles": n, "allocate_map_s": t_alloc, "release_s": t_free,
               "resolve_extent_ms": walk * 1e3, "segments": segs, "dmabuf_export_ms": t_dmabuf * 1e3,
               "dmabuf_bytes": dmabuf_size}
        res["chunk_sweep"].append(row)
        print(f"chunk {chunk >> 20:5} MiB: {n:6} handles, allocate+map {t_alloc * 1e3:8.1f} ms, release "
              f"{t_free * 1e3:7.1f} ms, resolve_extent {walk * 1e3:7.2f} ms ({segs} segments), dmabuf export "
              f"{t_dmabuf * 1e3:6.2f} ms ({dmabuf_size} bytes)", flush=True)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"cuda-{datetime.now(timezone.utc):%Y-%m-%d}.json"
    path.write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
