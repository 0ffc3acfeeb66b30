"""Strided device copies as one kernel launch: the tile list a static schedule becomes, and the kernel image.

A group is ``height`` rows of ``width`` bytes, ``src_pitch`` / ``dst_pitch`` apart (a contiguous run is a
group of one row).  :func:`tiles` cuts groups into tiles of about ``tile_bytes`` -- one thread block each,
so a launch spreads evenly over the multiprocessors whatever the groups' sizes -- and
:class:`~tensorxfer.memory._copy.StridedCopy` uploads them once and copies them all in one launch.
:func:`kernel_image` is the compiled kernel (``strided_copy.fatbin``, built by setup.py with nvcc), or
None where the package was built without nvcc: callers then fall back to the copy engines' pitched copies.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

TILE_BYTES = 256 << 10      # one thread block's share (measured: 256 KiB 1.93 TB/s, 1 MiB 1.89, 4 MiB 1.78)
ROW_BYTES = 64 << 10        # a contiguous run is cut into rows of this width (a warp per row)

_U64 = np.uint64


def read_image(path: Path, without: str, level: int = logging.WARNING) -> bytes | None:
    """A kernel image setup.py built with nvcc, or None (logged at ``level``, saying ``without`` it what
    happens) where the package was built without it."""
    try:
        return path.read_bytes()
    except OSError:
        log.log(level, "tensorxfer: %s is missing (built without nvcc): %s", path.name, without)
        return None


@functools.cache
def kernel_image() -> bytes | None:
    """The compiled strided-copy kernel, or None (logged once) where it was not built."""
    return read_image(Path(__file__).with_name("strided_copy.fatbin"),
                      "strided device copies fall back to cuMemcpy2DAsync, several times slower for narrow rows")


def tiles(src_off: np.ndarray, dst_off: np.ndarray, width: np.ndarray, height: np.ndarray,
          src_pitch: np.ndarray, dst_pitch: np.ndarray, tile_bytes: int = TILE_BYTES,
          row_bytes: int = ROW_BYTES) -> np.ndarray:
    """The tiles (uint64, shape (n, 6): src offset, dst offset, width, rows, src pitch, dst pitch) that
    copy exactly the given groups, each tile at most ``max(tile_bytes, one row)`` bytes."""
    cols = [np.ascontiguousarray(a, dtype=_U64).ravel() for a in (src_off, dst_off, width, height, src_pitch,
                                                                  dst_pitch)]
    so, do, w, h, sp, dp = cols
    if len({len(c) for c in cols}) != 1:
        raise ValueError("the group columns must have the same length")
    keep = (w > 0) & (h > 0)
    so, do, w, h, sp, dp = (c[keep] for c in (so, do, w, h, sp, dp))
    # a contiguous group (one row, or rows back to back on both sides) becomes rows of row_bytes, plus a tail
    flat = (h == 1) | ((sp == w) & (dp == w))
    total = w * h
    rb = _U64(row_bytes)
    full = np.where(flat, total // rb, 0).astype(_U64)
    tail = np.where(flat, total % rb, 0).astype(_U64)
    body = ~flat | (full > 0)
    g_so = np.concatenate([so[body], (so + full * rb)[flat & (tail > 0)]])
    g_do = np.concatenate([do[body], (do + full * rb)[flat & (tail > 0)]])
    g_w = np.concatenate([np.where(flat, rb, w)[body], tail[flat & (tail > 0)]])
    g_h = np.concatenate([np.where(flat, full, h)[body], np.ones(int((flat & (tail > 0)).sum()), _U64)])
    g_sp = np.concatenate([np.where(flat, rb, sp)[body], tail[flat & (tail > 0)]])
    g_dp = np.concatenate([np.where(flat, rb, dp)[body], tail[flat & (tail > 0)]])
    # a strided group of rows wider than row_bytes: cut each row into column strips of row_bytes
    strips = np.where(g_w > rb, (g_w + rb - 1) // rb, 1).astype(np.int64)
    idx = np.repeat(np.arange(len(g_w)), strips)
    j = (np.arange(len(idx)) - np.repeat(np.cumsum(strips) - strips, strips)).astype(_U64)
    wide = g_w[idx] > rb
    s_w = np.where(wide, np.minimum(rb, g_w[idx] - j * rb), g_w[idx])
    s_so = g_so[idx] + np.where(wide, j * rb, 0).astype(_U64)
    s_do = g_do[idx] + np.where(wide, j * rb, 0).astype(_U64)
    s_h, s_sp, s_dp = g_h[idx], g_sp[idx], g_dp[idx]
    # rows into tiles of about tile_bytes
    per = np.maximum(_U64(1), _U64(tile_bytes) // np.maximum(s_w, _U64(1)))
    count = ((s_h + per - 1) // per).astype(np.int64)
    idx = np.repeat(np.arange(len(s_w)), count)
    k = (np.arange(len(idx)) - np.repeat(np.cumsum(count) - count, count)).astype(_U64)
    first = k * per[idx]
    out = np.empty((len(idx), 6), dtype=_U64)
    out[:, 0] = s_so[idx] + first * s_sp[idx]
    out[:, 1] = s_do[idx] + first * s_dp[idx]
    out[:, 2] = s_w[idx]
    out[:, 3] = np.minimum(per[idx], s_h[idx] - first)
    out[:, 4] = s_sp[idx]
    out[:, 5] = s_dp[idx]
    return out
