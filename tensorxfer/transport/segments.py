"""A transfer that is not a whole region: byte runs from the sender's region to other places in the receiver's.

A resharded weight sync moves, from each source rank to each target rank, exactly the bytes the target
needs, straight into its live weights: runs ``(src_off, dst_off, nbytes)``, often strided (a row-parallel
shard is a block of rows, each a run).  :class:`Segments` holds them as strided groups -- group ``i`` is
``count[i]`` runs of ``nbytes[i]`` bytes, run ``j`` at ``src_off[i] + j*src_stride[i]`` in the sender's
region and ``dst_off[i] + j*dst_stride[i]`` in the receiver's -- in the order the bytes travel.  Both ends
of a pair compute the same Segments (from the same plan), so no offsets cross the wire.

A pair whose two ends share a GPU may also carry quantizing tiles (``tiles``: a
:class:`~tensorxfer.quant.tiles.QuantTiles`): FP8 blocks the copy makes from the sender's input as it goes
(:mod:`tensorxfer.sync.fusing`).  Only a device-local ipc copy runs them; every other transport refuses
segments that carry any.

Transports take ``segments`` where they otherwise move ``[0, nbytes)`` (``None``): tcp cuts them into one
part per stream (:meth:`Segments.split`, the same cut on both ends) and moves each part with scatter /
gather socket calls; ipc copies them out of the sender's mapped memory (host: one strided numpy copy per
group; GPU: one 2-D copy per group); rdma writes each run to its place.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from tensorxfer.errors import ProtocolError

_FIELDS = ("src_off", "dst_off", "nbytes", "count", "src_stride", "dst_stride")


@dataclass(frozen=True, eq=False)
class Segments:
    """Strided groups of byte runs, in wire order (see the module docstring).  Arrays are uint64."""

    src_off: np.ndarray
    dst_off: np.ndarray
    nbytes: np.ndarray
    count: np.ndarray
    src_stride: np.ndarray
    dst_stride: np.ndarray
    tiles: Any = None       # QuantTiles, or None

    @classmethod
    def of(cls, src_off: object, dst_off: object, nbytes: object, count: object = None, src_stride: object = None,
           dst_stride: object = None) -> Segments:
        """From array-likes; ``count`` defaults to 1 (plain runs), strides to 0."""
        cols = [np.ascontiguousarray(np.asarray(a, dtype=np.uint64).reshape(-1)) for a in (src_off, dst_off, nbytes)]
        n = len(cols[0])
        for extra, default in ((count, 1), (src_stride, 0), (dst_stride, 0)):
            cols.append(np.full(n, default, np.uint64) if extra is None else
                        np.ascontiguousarray(np.asarray(extra, dtype=np.uint64).reshape(-1)))
        if any(len(c) != n for c in cols):
            raise ValueError("segments: every column must have one entry per group")
        return cls(*cols)

    @classmethod
    def whole(cls, nbytes: int) -> Segments:
        """``[0, nbytes)`` to ``[0, nbytes)``: what a plain update moves."""
        return cls.of([0], [0], [nbytes]) if nbytes else cls.of([], [], [])

    def __len__(self) -> int:
        return len(self.nbytes)

    # A weight sync moves the same segments every step, and both ends ask these of ~a thousand groups each
    # step: computed once (the columns are never written after construction).
    @functools.cached_property
    def total_bytes(self) -> int:
        """Bytes written into the receiver: the runs', and the quantizing tiles' (FP8 values and scales)."""
        return int((self.nbytes * self.count).sum()) + (self.tiles.written_bytes if self.tiles is not None else 0)

    @functools.cached_property
    def num_runs(self) -> int:
        """Plain runs once the groups are expanded (as the planner's ``Runs.num_runs``)."""
        return int(self.count.sum())

    @functools.cached_property
    def _ends(self) -> tuple[int, int]:
        """The furthest byte the runs reach in the source and in the destination."""
        if not len(self):
            return 0, 0
        last = self.count - np.minimum(self.count, 1)
        return (int((self.src_off + last * self.src_stride + self.nbytes).max()),
                int((self.dst_off + last * self.dst_stride + self.nbytes).max()))

    @functools.cached_property
    def digest(self) -> str:
        """Hex sha256 of the groups (little-endian uint64 columns): the two ends of a pair compare it."""
        h = hashlib.sha256(b"tensorxfer.segments/1\0")
        for name in _FIELDS:
            h.update(np.ascontiguousarray(getattr(self, name)).astype("<u8", copy=False).data)
        if self.tiles is not None and len(self.tiles):
            h.update(b"tiles\0" + self.tiles.digest)
        return h.hexdigest()

    def check_within(self, src_size: int, dst_size: int) -> None:
        """Every run lies inside both regions.

        Raises
        ------
        ProtocolError
            A run reaches past ``src_size`` or ``dst_size`` (the two ends planned differently).
        """
        src_end, dst_end = self._ends
        if src_end > src_size or dst_end > dst_size:
            raise ProtocolError(f"segments reach past the regions ({src_end} > {src_size} or "
                                f"{dst_end} > {dst_size}): the two ends did not plan the same transfer")
        if self.tiles is not None:
            self.tiles.check_within(src_size, dst_size)

    def without_tiles(self) -> None:
        """Refuse quantizing tiles: for every transport but a device-local ipc copy.

        Raises
        ------
        TransportUnavailable
            These segments carry tiles (their pair was planned for one GPU, and is not on one).
        """
        if self.tiles is not None and len(self.tiles):
            from tensorxfer.errors import TransportUnavailable

            raise TransportUnavailable("this pair was planned to quantize on the way on one GPU (its source and "
                                       "target registered the same device), which only an ipc copy between GPU "
                                       "regions does: run the pair over ipc (transport 'auto' or 'ipc')")

    def runs(self) -> Iterator[tuple[int, int, int]]:
        """Every run ``(src_off, dst_off, nbytes)``, in wire order."""
        for i in range(len(self)):
            s, d, n = int(self.src_off[i]), int(self.dst_off[i]), int(self.nbytes[i])
            ss, ds = int(self.src_stride[i]), int(self.dst_stride[i])
            for j in range(int(self.count[i])):
                yield s + j * ss, d + j * ds, n

    def flat(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every run as three read-only uint64 arrays ``(src_off, dst_off, nbytes)`` (vectorized :meth:`runs`).

        Computed once: a weight sync moves the same segments every step, and both ends ask each step."""
        return self._flat

    @functools.cached_property
    def _flat(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        counts = self.count.astype(np.int64)
        if not len(self):
            empty = np.zeros(0, np.uint64)
            return empty, empty, empty
        group = np.repeat(np.arange(len(self)), counts)
        starts = np.cumsum(counts) - counts
        j = (np.arange(int(counts.sum())) - np.repeat(starts, counts)).astype(np.uint64)
        out = (self.src_off[group] + j * self.src_stride[group], self.dst_off[group] + j * self.dst_stride[group],
               self.nbytes[group].copy())
        for a in out:
            a.setflags(write=False)
        return out

    def split(self, parts: int) -> list[Segments]:
        """Cut into at most ``parts`` consecutive pieces of about equal bytes (whole runs; a group may be cut
        between its runs), in wire order: the same cut on both ends, one piece per stream (computed once per
        ``parts``)."""
        if parts <= 1 or len(self) == 0:
            return [self]
        cached = self._splits.get(parts)
        if cached is None:
            cached = self._splits[parts] = self._split(parts)
        return cached

    @functools.cached_property
    def _splits(self) -> dict[int, list[Segments]]:
        return {}

    def _split(self, parts: int) -> list[Segments]:
        src, dst, n = self.flat()
        ends = np.cumsum(n.astype(np.int64))
        total = int(ends[-1])
        cuts = [0]
        for k in range(1, parts):
            i = int(np.searchsorted(ends, total * k // parts, side="left")) + 1
            if cuts[-1] < i < len(n):
                cuts.append(i)
        cuts.append(len(n))
        return [Segments.of(src[a:b], dst[a:b], n[a:b]) for a, b in itertools.pairwise(cuts) if b > a]
