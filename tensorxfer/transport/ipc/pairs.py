"""Copying one weight-sync pair's segments out of a mapped source region into a target region.

Both the copying ipc receiver (:mod:`.copy`, in the target's own process) and a copy host (:mod:`.delegate`,
copying for the other targets on its GPU) run the same copies: on the host every row of every group by
``copy_groups`` on a few threads without the GIL; on a GPU one launch of the strided-copy kernel over the
pair's tiles (uploaded once: the plan is static), or one 2-D copy per group where the kernel was not built;
and, for a pair that quantizes on the way (:mod:`tensorxfer.sync.fusing`), one launch of its quantizing tiles
after it on the same stream.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from tensorxfer.errors import QuantizationError
from tensorxfer.memory import strided
from tensorxfer.memory._hostcopy import copy_groups
from tensorxfer.transport.segments import Segments


def copy_segments_in_host_memory(src: Any, dst: Any, segments: Segments, threads: int) -> None:
    """Copy ``segments`` from host region ``src`` to host region ``dst`` (both mapped here): every copy
    thread takes every ``threads``-th group, a memcpy per row, without the GIL."""
    with memoryview(src) as sv, memoryview(dst) as dv:
        cols = (segments.src_off, segments.dst_off, segments.nbytes, segments.count, segments.src_stride,
                segments.dst_stride)
        count = max(1, min(threads, len(segments)))
        run_threads(count, lambda k: copy_groups(sv, dv, *cols, k, count))


class DeviceSegments:
    """A pair's segments as device copies on ``device``: the strided-copy kernel over their tiles (built and
    uploaded here, once), or one 2-D copy per group where the kernel was not built.  :meth:`launch` only
    queues them on a copier's stream."""

    def __init__(self, segments: Segments, device: int) -> None:
        self.segments, self.device = segments, device
        self._kernel: Any = None
        self._tiles: Any = None
        if segments.tiles is not None and len(segments.tiles):
            from tensorxfer.quant.tiles import DeviceTiles

            self._tiles = DeviceTiles(segments.tiles, device)
        image = strided.kernel_image()
        if image is not None:
            from tensorxfer.memory._copy import StridedCopy

            self._kernel = StridedCopy(device, strided.tiles(segments.src_off, segments.dst_off, segments.nbytes,
                                                             segments.count, segments.src_stride,
                                                             segments.dst_stride), image)

    def launch(self, copier: Any, dst_ptr: int, src_ptr: int) -> None:
        if self._kernel is not None:       # the tiles too, in the same call without the GIL
            self._kernel.launch(copier, dst_ptr, src_ptr, self._tiles.launch_args if self._tiles is not None else None)
            return
        if len(self.segments):   # one 2-D copy per strided group (a block of rows), not one copy per row
            sg = self.segments
            copier.dtod_groups(sg.dst_off + np.uint64(dst_ptr), sg.src_off + np.uint64(src_ptr), sg.nbytes, sg.count,
                               sg.dst_stride, sg.src_stride)
        if self._tiles is not None:
            self._tiles.launch(copier.stream, dst_ptr, src_ptr)

    def check_quantized(self) -> None:
        """After the copier's stream synchronized: QuantizationError naming the tensor of the first block that
        held a NaN or an infinity (nothing of that block was written; the step must fail)."""
        if self._tiles is None:
            return
        bad = self._tiles.failed()
        if bad is not None:
            raise poisoned(self.segments, bad)

    def serve_lane(self, copier: Any, dst_ptr: int, src_ptr: int, fd: int, fence: int) -> tuple[int, bytes] | None:
        """A copy lane's steps served without the GIL (``StridedCopy.serve_lane``; a pair that quantizes on the
        way launches its tiles there too, and a step whose tiles met a NaN is answered ``Q``), each taken and
        finished on the lane's fence word at address ``fence``; None where the kernel was not built (the caller
        serves them itself)."""
        if self._kernel is None:
            return None
        quantizing = self._tiles.launch_args if self._tiles is not None else None
        return self._kernel.serve_lane(copier, dst_ptr, src_ptr, fd, fence, quantizing)

    def close(self) -> None:
        if self._tiles is not None:
            self._tiles.close()
            self._tiles = None
        kernel, self._kernel = self._kernel, None
        if kernel is not None:
            kernel.close()


def poisoned(segments: Segments, tile: int) -> QuantizationError:
    """The error of a pair whose quantizing tile ``tile`` met a NaN or an infinity, naming its tensor (the
    tile's index kept as ``.tile``: a copy host answers with it)."""
    name = segments.tiles.tensor_of(tile) if segments.tiles is not None and 0 <= tile < len(segments.tiles) else None
    e = QuantizationError(f"a block of {name!r} holds a NaN or an infinity in the source's weights (found as this "
                          f"pair quantized it on the way): the step fails; fix the weights, and the next push goes on",
                          name)
    e.tile = tile
    return e


def run_threads(count: int, work: Callable[[int], Any]) -> None:
    """``work(k)`` for k < ``count``, each in its own thread (k = 0 in this one); the first error is raised
    once all ended."""
    errors: list[BaseException] = []

    def run(k: int) -> None:
        try:
            work(k)
        except BaseException as e:
            errors.append(e)
    threads = [threading.Thread(target=run, args=(k,), name="tensorxfer-ipc-segments", daemon=True)
               for k in range(1, count)]
    for t in threads:
        t.start()
    run(0)
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
