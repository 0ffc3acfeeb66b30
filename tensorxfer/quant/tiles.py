"""Quantizing tiles: FP8 made on the way by the process that copies a weight-sync pair on one GPU.

Where a source and a target share a GPU, the pair's copy already runs there (the target, or its copy host,
maps the source's region).  For the blocks the source holds whole, that copy can quantize as it goes: read
the source's bf16 (or float32) block from the source's region, take its amax, and write its FP8 values and
its scale straight into the target's region -- one read of the input and one write of the FP8 bytes, the
least memory traffic FP8 targets can cost (quantizing at the source and then copying the FP8 bytes reads
and writes them once more, and the six processes of a 4-to-2 sync time-slice the GPU for it).
:mod:`tensorxfer.sync.fusing` turns a pair's planned FP8 runs into these tiles; the blocks that straddle
sources still come quantized from the sources (their amaxes agreed through the store), as byte runs.

A tile is one block of one source shard: a row of :data:`WIDTH` int64 (the kernel's ``TileColumn``,
``fp8_quantize.cu``), byte offsets relative to the two regions' bases:

``src, src_pitch, rows, cols``
    the whole block in the source's region (its first element; bytes per shard row; its extent);
``dst, dst_pitch, r0, r1, c0, c1``
    the part of the block the target holds (rows ``[r0, r1)``, columns ``[c0, c1)`` of the block) and where
    its first element goes in the target's region (bytes per target row);
``scale``
    where the block's scale goes in the target's region (-1: this tile writes none);
``dtype, formula``
    the input's dtype (0 bf16, 1 float32) and the layout's formula (:data:`tensorxfer.quant.kernel.FORMULAS`);
``amax``
    -1 for a block the source holds whole; for a block it shares with other sources (``src, rows, cols``
    are then the source's part of it), where the sources' agreed amax of the whole block lies in the
    source's region (a float32 it wrote after their store round): the tile's amax is the larger of its
    rows' and that one -- the agreed one, so the bytes are the source path's.

The formula is the source path's, so the bytes are the same (``tests/test_fusing.py``; on the GPU
``tests/test_quant_gpu.py``).  A block with a NaN or an infinity writes nothing and fails the pair naming
its tensor (:meth:`DeviceTiles.failed`).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
from dataclasses import dataclass

import numpy as np

from tensorxfer.errors import ProtocolError

__all__ = ["COLUMNS", "WIDTH", "DeviceTiles", "QuantTiles", "available"]

COLUMNS = ("src", "src_pitch", "rows", "cols", "dst", "dst_pitch", "r0", "r1", "c0", "c1", "scale", "dtype",
           "formula", "amax")
WIDTH = len(COLUMNS)
(SRC, SRC_PITCH, ROWS, COLS, DST, DST_PITCH, R0, R1, C0, C1, SCALE, DTYPE, FORMULA, AMAX) = range(WIDTH)
INPUT_SIZES = (2, 4)        # bytes per input element, by the dtype column
E8M0 = 2                    # the formula column of power-of-two scales (kernel.FORMULAS): one byte each
_MAX_EXTENT = 1 << 24       # a block's rows or columns, at most
_MAX_PLACE = 1 << 40        # an offset or a pitch, at most (1 TiB): (rows - 1) * pitch stays far from wrapping


@functools.cache
def available() -> bool:
    """Whether this process can run quantizing tiles: the kernel image built and cuda-bindings importable."""
    from tensorxfer.quant import kernel

    return kernel._image() is not None and kernel._driver() is not None


@dataclass(frozen=True, eq=False)
class QuantTiles:
    """A pair's quantizing tiles: ``table`` (n x :data:`WIDTH` int64, read-only) and the tensor each tile
    belongs to (``tensor``: indices into ``names``)."""

    table: np.ndarray
    tensor: np.ndarray
    names: tuple[str, ...]

    def __post_init__(self) -> None:
        for a in (self.table, self.tensor):
            a.setflags(write=False)

    def __len__(self) -> int:
        return len(self.table)

    @functools.cached_property
    def values_bytes(self) -> int:
        """FP8 bytes the tiles write."""
        t = self.table
        return int(((t[:, R1] - t[:, R0]) * (t[:, C1] - t[:, C0])).sum())

    @functools.cached_property
    def scale_bytes(self) -> np.ndarray:
        """Each tile's scale's size: an e8m0 byte, or a float32."""
        return np.where(self.table[:, FORMULA] == E8M0, 1, 4)

    @functools.cached_property
    def written_bytes(self) -> int:
        """Every byte the tiles write into the target: values and scales."""
        return self.values_bytes + int(self.scale_bytes[self.table[:, SCALE] >= 0].sum())

    @functools.cached_property
    def input_bytes(self) -> int:
        """Bytes of the source's input the tiles read."""
        t = self.table
        return int((t[:, ROWS] * t[:, COLS] * np.take(INPUT_SIZES, t[:, DTYPE])).sum())

    @functools.cached_property
    def digest(self) -> bytes:
        h = hashlib.sha256(b"tensorxfer.tiles/1\0")
        h.update(np.ascontiguousarray(self.table).astype("<i8", copy=False).data)
        return h.digest()

    def tensor_of(self, index: int) -> str:
        return self.names[int(self.tensor[index])]

    def where(self, rows: np.ndarray) -> QuantTiles:
        """The tiles selected by boolean mask ``rows`` (their order kept)."""
        return QuantTiles(np.ascontiguousarray(self.table[rows]), np.ascontiguousarray(self.tensor[rows]), self.names)

    @functools.cached_property
    def agreed(self) -> np.ndarray:
        """Which tiles take an agreed amax from the source's region (blocks shared between sources)."""
        return self.table[:, AMAX] >= 0

    def check_within(self, src_size: int, dst_size: int) -> None:
        """Every tile reads inside the source's region and writes inside the target's (each step: the reach is
        computed once).  Exact in int64: every column is bounded first, so no product wraps (a copy host takes
        a follower's table as it came).

        Raises
        ------
        ProtocolError
            A tile reaches past a region or names a column out of range (the ends planned differently).
        """
        bad, src_ends, dst_ends = self._reach
        if bad is None and (not len(src_ends) or (int(src_ends.max()) <= src_size
                                                   and int(dst_ends.max()) <= dst_size)):
            return
        i = bad if bad is not None else int(np.argmax((src_ends > src_size) | (dst_ends > dst_size)))
        raise ProtocolError(f"quantizing tile {i} of {self.tensor_of(i)!r} reaches past the regions "
                            f"({dict(zip(COLUMNS, self.table[i].tolist()))}; regions of {src_size} and {dst_size} "
                            f"bytes): the two ends did not plan the same transfer")

    @functools.cached_property
    def _reach(self) -> tuple[int | None, np.ndarray, np.ndarray]:
        """(the first tile with a column out of range, or None; each tile's furthest byte read, and written)."""
        t = self.table
        extents, places = t[:, [ROWS, COLS, R0, R1, C0, C1]], t[:, [SRC, SRC_PITCH, DST, DST_PITCH]]
        sane = (((extents >= 0) & (extents <= _MAX_EXTENT)).all(axis=1)
                & ((places >= 0) & (places <= _MAX_PLACE)).all(axis=1) & (t[:, SCALE] >= -1)
                & (t[:, SCALE] <= _MAX_PLACE) & (t[:, DTYPE] >= 0) & (t[:, DTYPE] <= 1)
                & ((t[:, AMAX] == -1) | ((t[:, AMAX] >= 0) & (t[:, AMAX] % 4 == 0))) & (t[:, AMAX] <= _MAX_PLACE))
        t = np.where(sane[:, None], t, 0)       # no arithmetic on the insane rows (they are refused)
        size = np.take(INPUT_SIZES, t[:, DTYPE])
        ok = (sane & (t[:, ROWS] >= 1) & (t[:, COLS] >= 1) & (t[:, SRC_PITCH] >= t[:, COLS] * size)
              & (t[:, R0] <= t[:, R1]) & (t[:, R1] <= t[:, ROWS]) & (t[:, C0] <= t[:, C1]) & (t[:, C1] <= t[:, COLS]))
        rows = t[:, R1] - t[:, R0]
        ok &= (rows <= 1) | (t[:, DST_PITCH] >= t[:, C1] - t[:, C0])
        src_end = t[:, SRC] + np.maximum(t[:, ROWS] - 1, 0) * t[:, SRC_PITCH] + t[:, COLS] * size
        dst_end = np.where(rows > 0, t[:, DST] + np.maximum(rows - 1, 0) * t[:, DST_PITCH] + (t[:, C1] - t[:, C0]), 0)
        dst_end = np.maximum(dst_end, t[:, SCALE] + self.scale_bytes)
        src_end = np.maximum(src_end, t[:, AMAX] + 4)        # an agreed amax is read from the source's region
        return (None if ok.all() else int(np.argmin(ok))), src_end, dst_end


class DeviceTiles:
    """A pair's tiles on ``device``: the table uploaded once; :meth:`launch` queues the kernel on a stream,
    :meth:`failed` (once that stream is synchronized) names the first tile that found a NaN or an infinity."""

    def __init__(self, tiles: QuantTiles, device: int) -> None:
        import torch

        self.tiles, self.device = tiles, device
        self._table = torch.from_numpy(tiles.table.copy()).to(f"cuda:{device}")     # (a writable copy)
        self._status = torch.empty(1, dtype=torch.int64, device=f"cuda:{device}")
        # read back on the launch's own stream (no wait on torch's streams), into pinned memory
        self._word = torch.empty(1, dtype=torch.int64, pin_memory=True)

    def launch(self, stream: int, dst_base: int, src_base: int) -> None:
        """Queue the tiles (the failure word reset first) on CUDA stream handle ``stream``."""
        from tensorxfer.quant import kernel

        if not len(self.tiles):
            return
        cu = kernel._driver()
        ctx, kernels = kernel._context(self.device)
        handle = cu.CUstream(stream)
        kernel._check(cu.cuCtxPushCurrent(ctx), "cuCtxPushCurrent")
        try:
            kernel._check(cu.cuMemsetD32Async(self._status.data_ptr(), 0xFFFFFFFF, 2, handle), "cuMemsetD32Async")
            args = (self._table.data_ptr(), src_base, dst_base, self._status.data_ptr())
            types = (ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_void_p)
            kernel._check(cu.cuLaunchKernel(kernels["quantize_tiles"], len(self.tiles), 1, 1, kernel.THREADS, 1, 1,
                                            0, handle, (args, types), 0), "cuLaunchKernel(quantize_tiles)")
            kernel._check(cu.cuMemcpyDtoHAsync(self._word.data_ptr(), self._status.data_ptr(), 8, handle),
                          "cuMemcpyDtoHAsync")
        finally:
            kernel._check(cu.cuCtxPopCurrent(), "cuCtxPopCurrent")

    @functools.cached_property
    def launch_args(self) -> tuple[int, int, int, int, int]:
        """What the strided copy needs to launch these tiles after it without the GIL (``StridedCopy.launch``
        and ``serve_lane``): the kernel's function handle (loaded in the device's primary context), the
        table, the tiles, the failure word on the device and its pinned copy on the host (:meth:`failed`
        reads it).  Raw addresses: valid until :meth:`close`, which the pair's copy calls after its last launch."""
        from tensorxfer.quant import kernel

        _, kernels = kernel._context(self.device)
        return (int(kernels["quantize_tiles"]), self._table.data_ptr(), len(self.tiles), self._status.data_ptr(),
                self._word.data_ptr())

    def failed(self) -> int | None:
        """The lowest tile whose block held a NaN or an infinity in the last launch (its stream synchronized),
        or None."""
        if not len(self.tiles):
            return None
        word = int(self._word[0])       # all ones (-1 as int64): none failed
        return None if word < 0 else word

    def close(self) -> None:
        self._table = self._status = self._word = None     # type: ignore[assignment]
